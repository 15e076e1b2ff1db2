"""A mistake ringflow finds while vLLM's engine starts reaches the user as one line, last.

vLLM loads the model in its engine-core process (a child of the process the user started,
unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). An exception there is logged with its traceback by
the engine core, and the front end then fails with its own traceback ending in "Engine core
initialization failed. See root cause above": ringflow's line sits in the middle of some 200.

Note [One line at start-up]
    The front end (``frontend.on_create_engine_config``) names a relay file in the environment
    its engine processes inherit (:data:`RELAY`). A ringflow hook that fails during start-up in
    an engine-core or worker process (:func:`fail`) writes its line there and ends the process
    with ``SystemExit``, which vLLM's engine core lets through without a traceback; where the
    worker is a process of its own, the engine core's start-up fails in turn and ends the same
    way (:func:`on_workers_ready`). The front end's
    wait for the engines (``vllm.v1.engine.utils.wait_for_engine_startup``, :func:`on_wait`)
    then finds the line: under vLLM's command line the process exits with it (status 2, as
    vLLM's own argument errors do); under ``LLM(...)`` it raises :class:`EngineError` whose
    message is that line. Anywhere else (one process, no relay) the hook logs the line and
    raises its typed error as before.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import tempfile
from typing import NoReturn

from ringflow.errors import EngineError, RingflowError

log = logging.getLogger("ringflow")

RELAY = "_RINGFLOW_STARTUP_RELAY"  # not a RINGFLOW_* switch: ringflow sets it, users do not


def open_relay() -> None:
    """In the front end, before vLLM starts its engine processes: a fresh relay file."""
    if os.environ.get(RELAY):
        return
    handle, path = tempfile.mkstemp(prefix="ringflow-startup-", suffix=".txt")
    os.close(handle)
    os.environ[RELAY] = path
    atexit.register(_remove, path)  # the front end outlives its engine processes


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _in_engine_child() -> bool:
    """An engine-core process, or a worker process of vLLM's multiprocess executor."""
    return multiprocessing.current_process().name.startswith(("EngineCore", "VllmWorker"))


def fail(exc: RingflowError) -> NoReturn:
    """A start-up hook's mistake (Note [One line at start-up]): relayed to the front end from
    an engine-core process, else logged and raised."""
    path = os.environ.get(RELAY)
    if path and _in_engine_child():
        try:
            with open(path, "w", encoding="utf-8") as out:
                out.write(f"ringflow: {exc}".replace("\n", " "))
        except OSError:
            pass
        else:
            raise SystemExit(2) from None
    log.error("%s", exc)
    raise exc


def pending() -> bool:
    """Whether an engine process relayed a line (it stays for the front end to take)."""
    path = os.environ.get(RELAY)
    try:
        return bool(path) and os.path.getsize(path) > 0
    except OSError:
        return False


def on_workers_ready(state, original, *args, **kwargs):
    """The hook on ``WorkerProc.wait_for_ready`` (an engine-core process, vLLM's multiprocess
    executor): where a worker relayed ringflow's line and ended, the wait fails with an
    exception the engine core would log with its traceback; the engine core ends quietly
    instead (vLLM loads plugins there before it starts its workers), so the line is all the
    user sees."""
    try:
        return original(*args, **kwargs)
    except Exception:
        if pending() and _in_engine_child():
            raise SystemExit(2) from None
        raise


def taken() -> str | None:
    """The relayed line, if an engine process left one (the file is emptied)."""
    path = os.environ.get(RELAY)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as src:
            line = src.read().strip()
        open(path, "w").close()
    except OSError:
        return None
    return line or None


def from_vllms_cli() -> bool:
    """Whether this process is vLLM's command line (``vllm serve``, ``python -m
    vllm.entrypoints...``), where a mistake ends the process with its one line, as vLLM's own
    argument errors do, not with a traceback."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(spec, "name", "") or "").startswith("vllm.entrypoints") or \
        os.path.basename(sys.argv[0] if sys.argv else "") == "vllm"


def exit_if_cli(line: str) -> None:
    """Under vLLM's command line, end the process with ``line`` as its last output (status 2);
    elsewhere return, and the caller raises its typed error."""
    if from_vllms_cli():
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def on_wait(state, original, *args, **kwargs):
    """The hook on ``vllm.v1.engine.utils.wait_for_engine_startup`` (the front end)."""
    try:
        return original(*args, **kwargs)
    except RuntimeError:
        line = taken()
        if line is None:
            raise
        exit_if_cli(line)
        raise EngineError(line.removeprefix("ringflow: ")) from None
