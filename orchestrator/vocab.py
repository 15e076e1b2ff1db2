"""The names every room shares, defined once at the lowest level that needs them: slot element
types, capture policies, gather priorities, the synthetic workload's kinds, DCP transports.

Pure data (no torch): the profile schema quotes them, the executors and integrations check
their arguments against them.
"""

from __future__ import annotations

#: slot element type -> bytes per element (``graphs/slots.py`` maps the names to torch)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}
#: what a forward does inside a CUDA graph capture ringflow did not open (graphs/eager.py)
CAPTURE_POLICIES = ("join", "sync", "error")
#: gather_priority -> CUDA stream priority of the gather streams (lower runs first)
GATHER_PRIORITIES = {"normal": 0, "high": -1}
#: how the synthetic workload fills a slot
GATHER_KINDS = ("h2d", "index", "paged")
#: what a synthetic layer computes from its slot
COMPUTE_KINDS = ("attention", "decoder")
#: how a DCP group's KV parts are exchanged (integrations/torch/kv_prefetch.py)
DCP_TRANSPORTS = ("nccl", "peer", "auto")
#: who reads a kv_prefetch section's slots (integrations/vllm/context_hooks.py, attention.py)
KV_CONSUMERS = ("context", "full_kv_check")


def check_choice(what: str, value: object, choices, error: type[Exception]) -> None:
    """Raise ``error`` naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise error(f"{what} must be one of {', '.join(choices)}, got {value!r}")
