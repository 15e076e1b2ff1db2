"""NVTX ranges for executors: ``ringflow/<lane>/<kind>/L<layer>`` around every node.

The ``nvtx`` package is used when it is installed (domain ``ringflow``, attributes prebuilt so
the per-node cost is one push and one pop); without it, torch's own NVTX binding on a CUDA
build; otherwise nothing. ``NVTX_DISABLE=1`` (the nvtx package's switch) or
``RINGFLOW_NVTX=0`` (or ``off``, ``false``, ``no``) turns ranges off. ``RINGFLOW_TORCH_RANGES=1``
also opens each range in torch's profiler (``record_function``), so a ``torch.profiler`` trace
(vLLM's ``--profile``, ``tools/experts_bench.py --trace``) shows ringflow's ranges beside
vLLM's ops: the CPU time a range took, and the gaps between them.

Note [Host work in NVTX]
    A host node's worker (Note [Host node]) runs no Python, so it cannot push ranges through
    this module. Its TorchScript loop wraps each run in a profiler range (``record_function``,
    ``ringflow/experts/host/L<layer>``), and while a tool records ranges its thread runs the
    loop under torch's NVTX profiler (``emit_nvtx``), which turns that range, and every torch
    op inside it, into NVTX ranges on the worker's own thread (default domain). That profiler
    adds a callback to every op, which the host's runs carry while Nsight records them (not
    measured: the ranges may read long); without a tool (``NVTX_INJECTION64_PATH`` unset, or
    ranges off) the loop runs under no profiler (a quick check on this project's CPU machine:
    a two-op TorchScript loop took 11.7 us an iteration with the range, 12.1 without; no
    committed measurement). That profiler syncs the GPU as it starts and ends: the worker
    enters it on the node's GPU (not the thread's default, GPU 0, which a tensor-parallel
    rank does not own), and a node closed while a graph is being captured (a finalizer) does
    not end it, as a sync would end the capture. A profiler's state is per thread: vLLM's own
    torch profiler (``--trace``) sees vLLM's thread, not the worker's.

.. note::
    Ranges are host-side. Under a CUDA graph they appear once, at capture, not at replay; a
    replay gets one range (``ringflow/replay/<bucket>``) and per-node detail comes from
    ``nsys profile --cuda-graph-trace=node`` (see ``profiles/NSIGHT.md``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import ContextManager

import torch

from ringflow import envs


class _Null:
    name = "none"

    def handle(self, message: str) -> object:
        return None  # no range: ranged() hands the step back unwrapped

    def push(self, handle: object) -> None:
        pass

    def pop(self) -> None:
        pass


class _NvtxPackage:
    name = "nvtx"

    def __init__(self, nvtx_module) -> None:
        self._domain = nvtx_module.get_domain("ringflow")

    def handle(self, message: str) -> object:
        # DummyDomain (no tool attached, and none attaches later: the package looks for
        # one when the domain is made) returns None: ranged() then skips the range
        return self._domain.get_event_attributes(message=message)

    def push(self, handle: object) -> None:
        self._domain.push_range(handle)

    def pop(self) -> None:
        self._domain.pop_range()


class _TorchNvtx:
    name = "torch.cuda.nvtx"

    def handle(self, message: str) -> object:
        return message

    def push(self, handle: object) -> None:
        torch.cuda.nvtx.range_push(handle)

    def pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class WithTorchProfiler:
    """``inner``'s ranges, each also a torch profiler range (``RINGFLOW_TORCH_RANGES``): a
    per-thread stack of open ``record_function`` scopes, as NVTX keeps its own per thread."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, f"{inner.name}+torch.profiler"
        self._open = threading.local()

    def handle(self, message: str) -> object:
        return self.inner.handle(message), message

    def push(self, handle: object) -> None:
        inner, message = handle
        if inner is not None:
            self.inner.push(inner)
        scope = torch.autograd.profiler.record_function(message)
        scope.__enter__()
        self._stack().append((inner is not None, scope))

    def pop(self) -> None:
        pushed, scope = self._stack().pop()
        scope.__exit__(None, None, None)
        if pushed:
            self.inner.pop()

    def _stack(self) -> list:
        if not hasattr(self._open, "stack"):
            self._open.stack = []
        return self._open.stack


def select_backend():
    """The NVTX backend the switches and the installed packages give.

    Raises:
        ConfigError: ``RINGFLOW_NVTX`` or ``RINGFLOW_TORCH_RANGES`` holds something that is
            not a flag.
    """
    profiler = envs.flag("RINGFLOW_TORCH_RANGES")
    if not envs.flag("RINGFLOW_NVTX"):
        return _Null()
    try:
        import nvtx
    except ImportError:
        chosen = _TorchNvtx() if torch.cuda.is_available() else _Null()
    else:
        chosen = _NvtxPackage(nvtx)
    return WithTorchProfiler(chosen) if profiler else chosen


#: chosen at the first range a plan builds, not at import: a bad ``RINGFLOW_NVTX`` is then one
#: error where ringflow is used (an executor, the plugin's hook), not a failed import
backend = None


def handle(message: str) -> object:
    """Prebuild what :func:`push` needs for ``message`` (do this once, off the hot path)."""
    global backend
    if backend is None:
        backend = select_backend()
    return backend.handle(message)


def push(h: object) -> None:
    backend.push(h)


def pop() -> None:
    backend.pop()


def call(h: object, fn: Callable, *args):
    """``fn(*args)`` inside the range of handle ``h`` (from :func:`handle`; None: no range)."""
    if h is None:
        return fn(*args)
    backend.push(h)
    try:
        return fn(*args)
    finally:
        backend.pop()


def ranged(message: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` wrapped in the NVTX range ``message`` (popped even when ``fn`` raises); ``fn``
    itself where no range would be recorded (ranges off, or no tool attached): three Python
    calls less per node on the issue path."""
    h = handle(message)
    if h is None:
        return fn

    def run() -> None:
        backend.push(h)
        try:
            fn()
        finally:
            backend.pop()

    return run


def tool_attached() -> bool:
    """Whether ranges are on and a tool records them: NVTX finds its tool through
    ``NVTX_INJECTION64_PATH``, which Nsight sets in the process it launches."""
    return (bool(os.environ.get("NVTX_INJECTION64_PATH"))
            and os.environ.get("NVTX_DISABLE", "0") in ("", "0")
            and not isinstance(select_backend(), _Null))


def host_thread_ranges() -> ContextManager:
    """The context a host node's worker thread runs its loop in (Note [Host work in NVTX]):
    torch's NVTX profiler on that thread while a tool records ranges on a CUDA build, else
    nothing."""
    if tool_attached() and torch.cuda.is_available():
        return torch.autograd.profiler.emit_nvtx()
    return contextlib.nullcontext()
