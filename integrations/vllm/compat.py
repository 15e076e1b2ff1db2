"""The vLLM versions this plugin supports, and the engine surfaces that differ between them.

Tested: vLLM 0.26 (the CUDA build, on an H200, both model runners) and 0.32 (the CPU build,
in CI). Every hook that needs to know which vLLM it runs in asks here, so a new version is one
place to teach:

* model runners: 0.26 and later have two GPU model runners (V1 ``GPUModelRunner`` and the V2
  runner under ``vllm.v1.worker.gpu``), each with its own ``initialize_kv_cache``;
* attention metadata: 0.32 builds it through ``AttentionGroup.build_metadata*``, 0.26 calls the
  backends' metadata builders directly; both end in ``AttentionMetadataBuilder.build`` (and
  ``update_block_table`` for groups that share a build), which is where the plugin listens.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("ringflow")

#: oldest and newest (major, minor) the plugin was tested with, inclusive
SUPPORTED = ((0, 26), (0, 32))


def version_tuple(text: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


def check_version() -> None:
    """Log one line when vLLM's version is outside :data:`SUPPORTED`."""
    import vllm

    found = version_tuple(getattr(vllm, "__version__", ""))
    low, high = SUPPORTED
    if found is None or not low <= found <= high:
        log.warning("ringflow: vLLM %s is outside the versions this plugin was tested with "
                    "(%d.%d to %d.%d); it loads, but its hooks may not fire (each says so in "
                    "the log if it cannot install)", getattr(vllm, "__version__", "?"),
                    *low, *high)


def model_runner_classes() -> list[type]:
    """Every GPU model runner class this vLLM has (each initializes the KV cache itself)."""
    from vllm.v1.worker import gpu_model_runner

    classes = [gpu_model_runner.GPUModelRunner]
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except ImportError:
        return classes
    return classes + [v2.GPUModelRunner]


def engine_core_class() -> type | None:
    """vLLM's engine core (it pauses the scheduler, then asks the workers to sleep), or None
    where this vLLM has none under that name."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return None
    return EngineCore


def metadata_builder_class(layer) -> type | None:
    """The metadata builder class of an attention layer's backend (None if it has none)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        return backend.get_builder_cls() if backend is not None else None
    except (AttributeError, NotImplementedError):
        return None
