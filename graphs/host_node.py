"""HostNode: CPU work ordered against a stream without a host sync, run by a worker that needs no
Python, woken by a doorbell the stream writes and joined by a flag the stream waits on.

Note [Host node]
    A host compute node (DESIGN.md, "the host as a compute node") runs a fixed piece of work,
    reading and writing host memory only, between two points of a stream:

    * ``post()``, issued on the stream: once the stream has run what was issued before it
      (the copies of the work's inputs to pinned memory), the stream writes a doorbell,
      ``flags[0] = 1``, in pinned memory (``cuStreamWriteValue32``);
    * ``join()``, issued later on the same stream: the stream waits until ``flags[1] == 1``
      (``cuStreamWaitValue32``), then resets it; what it runs next (the copy of the work's
      output back) follows the work.

    The worker polls the doorbell, resets it, does the work, and sets ``flags[1]``. Between
    the two points the stream runs the GPU's own share; nothing on the host waits, and the
    driver calls no function of ours. Both values written and waited for are constants, so a
    captured graph replays the node as it is (memory-operation nodes), each replay waking the
    worker once.

    **Why the worker is one TorchScript call, not Python.** A Python thread computing with
    torch's CPU ops takes the GIL between every two ops. Beside a thread that runs Python
    (vLLM's scheduler and model runner prepare the next step while the GPU runs this one) it
    waits up to the interpreter's switch interval (5 ms) at every op: on this project's CPU
    machine 320 small ops took 1.1 ms alone and 2,135 ms beside a busy Python thread (two
    other runs: 1,696 and 1,993 ms); the same loop compiled by TorchScript and called once
    took 0.46 ms and 16 ms, the GIL taken only at the call and its return
    (``tools/host_worker_gil.py``, ``profiles/results/host-worker-gil-cpu.json``). So the worker's loop (``serve``, a
    TorchScript function polling ``flags``) is entered once from a thread of its own and
    returns to Python only when it is stopped: no step waits for the GIL. It polls, so it
    keeps one CPU busy while the engine runs (unless it parks: Note [An idle worker parks]).
    CUDA
    host functions (``cuLaunchHostFunc``) were the first design: their driver thread must not
    call CUDA and should not take the GIL (cuda-python's own ``cudaLaunchHostFunc`` wraps
    the function in a trampoline that takes the GIL and frees its record after the first
    call, which a graph would replay), and a worker woken by them still needs Python.

    A loop that raises (TorchScript cannot catch) returns to the thread's Python, which logs
    it once and from then on answers every doorbell itself with a bad output (``fail``: NaN)
    and ``flags[1]``, so no stream waits for good; the next ``post()`` from Python raises the
    error. Under a replayed graph no Python runs to raise: those steps' rows are NaN. On the
    CPU (a device without streams) ``post`` writes the doorbell and ``join`` polls the flag
    from Python: the same worker, under test in CI.

Note [An idle worker parks]
    A polling worker keeps a CPU busy for as long as its engine lives, idle or not: a core per
    GPU on a tensor-parallel box, and, in a benchmark whose engines live side by side, a core
    the engine being measured may need (the H200 run at 72829bc had two engines with a host
    share side by side, the likely reason its share gained nothing). So a loop may park: after
    ``idle_polls`` polls in a row without a doorbell it sets ``flags[2]`` and returns to its
    thread's Python, which waits without spinning (an event, looking at the doorbell every
    ``PARK_POLL_S``) until the doorbell is set or ``wake()`` is called, then enters the loop
    again. Nothing is lost: the doorbell stays set in pinned memory, the stream waits for the
    done flag as before, and a replayed graph's doorbell is seen within ``PARK_POLL_S`` plus the
    GIL's wait (the thread needs Python for that while); ``wake()`` (called where a step starts,
    before its forward is issued) makes the re-entry start before the first doorbell.
    ``close()`` wakes a parked loop to stop it. ``idle_polls_for(ms)`` converts a time into
    polls, measured once on this CPU (TorchScript has no clock). Off unless asked for
    (``RINGFLOW_HOST_IDLE_MS``). On an H100 (at 441e8ad), a captured step replayed with the
    worker parked before every replay, the stream's doorbell alone bringing it back, was
    exact at every replay (tests/unit/test_host_experts.py, the replayed-graph test's
    parking case); the re-entry's latency in vLLM's engine is not measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
import threading
import time
from collections.abc import Callable
from typing import ContextManager

import torch

from ringflow.errors import DeviceError, KernelError

log = logging.getLogger("ringflow")

GO, DONE, PARKED = 0, 1, 2  # the flags: the doorbell, the worker's done, its loop parked
PARK_POLL_S = 1e-3  # a parked worker looks at the doorbell this often (Note [An idle ...])
_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_cuda = None


def _driver() -> ctypes.CDLL:
    """The CUDA driver's stream memory operations (cuda-python's wrappers add nothing here)."""
    global _cuda
    if _cuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DeviceError(f"a host node on a GPU needs the CUDA driver (libcuda.so.1): "
                              f"{exc}") from exc
        for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
            fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            setattr(lib, f"ringflow_{name}", fn)
        _cuda = lib
    return _cuda


class HostNode:
    """Runs ``serve(flags, *args)`` (a TorchScript loop, Note [Host node]) on a thread of its
    own with ``threads`` CPU threads (0: torch's default), inside the context ``ranges()``
    makes on that thread (the profiler that turns the loop's ranges into NVTX ones: Note
    [Host work in NVTX] in graphs/nvtx_ranges.py), woken at each ``post()`` and joined at
    each ``join()`` on ``device``'s current stream; ``fail()`` marks the work's output bad
    when the loop raised. ``name`` names the thread."""

    def __init__(self, serve, args: tuple, device: torch.device | str, name: str,
                 fail: Callable[[], None] = lambda: None, threads: int = 0,
                 ranges: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.device = (device if isinstance(device, torch.device)
                       else torch.empty(0, device=device).device)
        if self.device.type == "cuda" and platform.machine() not in ("x86_64", "AMD64"):
            raise DeviceError(f"a host node's worker stores its output, then its flag, in "
                              f"x86's store order; on {platform.machine()} the GPU could see "
                              f"the flag first: set experts.host_share to off")
        self.serve, self.args, self.fail, self.name = serve, args, fail, name
        self.threads, self.ranges = threads, ranges
        self.flags = torch.zeros(4, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.error: BaseException | None = None
        self.parks = 0  # times the loop parked (Note [An idle worker parks])
        self._wake = threading.Event()
        self._stopping = self._closed_capturing = False
        self._address = None
        if self.device.type == "cuda":
            from ringflow import cudart
            self._address = cudart.device_address(self.flags.data_ptr())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.threads:  # torch's CPU threads are per thread: these are this worker's
            torch.set_num_threads(self.threads)
        try:
            with contextlib.ExitStack() as on:
                if self.device.type == "cuda":  # what the ranges' profiler syncs: this GPU,
                    on.enter_context(torch.cuda.device(self.device))  # not the thread's 0
                ranges = self.ranges()  # on this thread: a profiler's state is per thread
                ranges.__enter__()
                try:
                    while True:  # a loop that parked (flags[2]) is entered again
                        self.serve(self.flags, *self.args)
                        if int(self.flags[PARKED]) == 0:
                            break
                        self._park()
                finally:  # torch's NVTX profiler syncs the GPU as it ends: not while a
                    if not self._closed_capturing:  # graph is being captured (close())
                        ranges.__exit__(None, None, None)
            return
        except BaseException as exc:  # noqa: BLE001: the stream must not wait for good
            self.error = exc
            log.error("%s raised on the host; its output is marked bad (NaN) from now on and "
                      "the next eager step stops: %r", self.name, exc)
        self._answer_bad()

    def _park(self) -> None:
        """The loop parked: wait without spinning until the doorbell is set (or the node is
        stopping), then let it run again (Note [An idle worker parks])."""
        self.parks += 1
        while int(self.flags[GO]) == 0 and not self._stopping:
            if self._wake.wait(PARK_POLL_S):  # a step starts: poll for its doorbell
                self._wake.clear()
                break
        self.flags[PARKED] = 0

    def wake(self) -> None:
        """A step is about to start: a parked loop enters again now, before its doorbell."""
        self._wake.set()

    def _answer_bad(self) -> None:
        """After the loop raised: answer every doorbell with a bad output, so that no stream
        (a replayed graph included) waits for good, until stopped."""
        self.fail()
        self.flags[DONE] = 1  # the run that raised
        while not self._stopping:
            go = int(self.flags[GO])
            if go == 0:
                time.sleep(1e-4)
                continue
            self.flags[GO] = 0
            if go < 0:
                return
            self.fail()
            self.flags[DONE] = 1

    def _memop(self, name: str, offset: int, value: int, flags: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = getattr(_driver(), f"ringflow_{name}")(stream, self._address + 4 * offset, value,
                                                     flags)
        if err != 0:
            raise DeviceError(f"{name} failed with CUresult {err} for {self.name}")

    def post(self) -> None:
        """On the current stream: ring the worker's doorbell once what the stream issued so
        far has run."""
        if self.error is not None:
            raise KernelError(f"{self.name} raised on the host in an earlier step: "
                              f"{self.error!r}") from self.error
        if self._stopping or not self._thread.is_alive():
            raise KernelError(f"{self.name} is closed")
        if self._address is not None:
            self._memop("cuStreamWriteValue32", GO, 1, 0)
        else:
            self.flags[GO] = 1

    def join(self) -> None:
        """On the current stream: what the stream issues next runs after the worker's run."""
        if self._address is not None:
            self._memop("cuStreamWaitValue32", DONE, 1, _WAIT_EQ)
            self._memop("cuStreamWriteValue32", DONE, 0, 0)
            return
        while int(self.flags[DONE]) == 0:
            if not self._thread.is_alive():
                raise KernelError(f"{self.name} stopped before its work was done")
            time.sleep(0)
        self.flags[DONE] = 0

    def close(self) -> None:
        """Stop the worker (after any run in flight). Call only when no stream or graph will
        post this node again."""
        if self._stopping:
            return
        self._closed_capturing = (self.device.type == "cuda"
                                  and torch.cuda.is_current_stream_capturing())
        try:
            if self.device.type == "cuda" and not self._closed_capturing:
                torch.cuda.synchronize(self.device)  # a doorbell still queued on a stream
                # rings after the stop: let it ring first (not while a graph is captured: a
                # finalizer may close a dropped lane then, and a sync would end the capture)
        finally:
            self._stopping = True
            self.flags[GO] = -1
            self._wake.set()  # a parked loop stops too
            self._thread.join(timeout=5)


def _polls(flags: torch.Tensor, n: int) -> int:
    """``n`` polls of ``flags[0]``, as a worker's loop polls while idle (Note [An idle worker
    parks]); returns how many saw a doorbell."""
    seen = 0
    for _ in range(n):
        if int(flags[0]) != 0:
            seen += 1
    return seen


_polls_per_ms: float | None = None


def idle_polls_for(ms: float) -> int:
    """About how many idle polls of a worker's loop take ``ms`` milliseconds on this CPU
    (measured once, with TorchScript's loop; 0 for ``ms <= 0``: never park)."""
    global _polls_per_ms
    if ms <= 0:
        return 0
    if _polls_per_ms is None:
        import warnings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=".*torch.jit.script.*")
            loop = torch.jit.script(_polls)
        flags = torch.zeros(4, dtype=torch.int32)
        loop(flags, 1000)  # compiled and warm
        n = 200_000
        start = time.perf_counter()
        loop(flags, n)
        _polls_per_ms = n / max(1e-6, 1e3 * (time.perf_counter() - start))
    return max(1, round(ms * _polls_per_ms))
