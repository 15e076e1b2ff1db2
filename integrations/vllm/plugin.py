"""The vLLM plugin (entry point group ``vllm.general_plugins``, name ``ringflow``).

vLLM calls :func:`register` in every process it starts (the front end, the engine core, each
worker; multiprocessing on or off), with no ``try`` around it. It installs ringflow's hooks
from the table of surfaces (``surfaces.py``, ``compat.install``) and nothing else; they do
nothing unless a profile is given, by ``RINGFLOW_PROFILE`` (a path or built-in name) or by
``additional_config={"ringflow": {...}}`` (a profile mapping, or ``{"profile": "path"}``).
Whatever this vLLM lacks turns its feature off with one log line, and vLLM runs on
(Note [ringflow never stops vLLM] in ``compat.py``).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("ringflow")


def register() -> None:
    """Install ringflow's hooks into vLLM. Safe to call more than once; inert until enabled;
    never raises."""
    try:
        _ensure_log_handler()
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
