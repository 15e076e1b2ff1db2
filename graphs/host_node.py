"""HostNode: work on a CPU thread, ordered against a stream without a host sync, and kept by a
CUDA graph capture as two host-function nodes.

Note [Host node]
    A host compute node (DESIGN.md, "the host as a compute node") runs a fixed piece of work,
    reading and writing host memory only, on a worker thread of its own, between two points
    of a stream:

    * ``post()``, issued on the stream: once the stream has run what was issued before it
      (the copies of the work's inputs to pinned memory), the worker is woken;
    * ``join()``, issued later on the same stream: what the stream runs after it waits until
      the worker has finished (then the work's output may be copied back and read).

    Between the two the stream runs the GPU's own share; nothing on the host waits. On a GPU
    both points are the CUDA driver's host functions (``cuLaunchHostFunc``), and the
    functions are libc's own ``sem_post`` and ``sem_wait`` on two POSIX semaphores: the
    driver's thread never enters Python and never calls CUDA, so a captured graph replays the
    node with no interpreter in the loop (each replay posts and waits once). cuda-python's
    ``cudaLaunchHostFunc`` is not used: it wraps the function in a trampoline that takes the
    GIL and frees its own record after the first call, which a graph replays.

    The worker waits on ``sem_wait`` through ctypes (the GIL released), then runs the work
    with torch's CPU ops, which release the GIL while they compute but take it between ops:
    a thread that holds the GIL while it waits for the stream (a CUDA call made with the GIL
    held) would stall the node for good. torch's syncs (``synchronize``, ``item``, ``cpu``)
    release it. The ``sem_wait`` host function blocks the driver's host-function thread while
    the CPU computes; host functions of other streams wait behind it (nothing else in the
    engine issues them).

    The join has a second form (``join_by="wait_value"``): the worker sets a flag in pinned
    memory when done, and the stream waits for it with the driver's stream memory operations
    (``cuStreamWaitValue32``, then ``cuStreamWriteValue32`` resets it), so the driver's
    host-function thread is never blocked; both values are constants, so a graph replays it.
    The worker's plain store of the flag follows its stores of the output in x86's store
    order; elsewhere (aarch64) only the semaphores' barriers order them, so it is refused.
    Which is cheaper is measured on the GPU (``tools/host_rates.py``), not assumed.

    A work that raises must not leave the stream waiting: the worker posts ``done`` whatever
    happens, marks the output bad (the work's ``fail`` fills it with NaN), logs once, and
    the next ``post()`` from Python raises the error. On the CPU (a device without streams)
    ``post`` and ``join`` are plain calls of the same semaphores, which keeps the thread and
    the protocol under test in CI.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading
import time
from collections.abc import Callable

import torch

from ringflow.errors import DeviceError, KernelError
from ringflow.graphs import nvtx_ranges

log = logging.getLogger("ringflow")

_SEM_BYTES = 64  # sem_t is 32 bytes on 64-bit glibc; room to spare
JOINS = ("host_function", "wait_value")  # how the stream waits for the worker
_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_libc = None
_cuda = None


def libc() -> ctypes.CDLL:
    """The C library, with its POSIX semaphore calls typed."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        for name, args in (("sem_init", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]),
                           ("sem_post", [ctypes.c_void_p]), ("sem_wait", [ctypes.c_void_p]),
                           ("sem_destroy", [ctypes.c_void_p])):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_int
        _libc = lib
    return _libc


def _driver() -> ctypes.CDLL:
    """The CUDA driver, for ``cuLaunchHostFunc`` with a C function pointer (Note [Host node])."""
    global _cuda
    if _cuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DeviceError(f"a host node on a GPU needs the CUDA driver (libcuda.so.1): "
                              f"{exc}") from exc
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
            fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            setattr(lib, f"ringflow_{name}", fn)
        _cuda = lib
    return _cuda


class _Semaphore:
    """A POSIX semaphore in memory that lives as long as this object (and any graph that posts
    or waits on it: keep the node alive as long as its graphs)."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(_SEM_BYTES)
        self.address = ctypes.addressof(self._buf)
        if libc().sem_init(self.address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self) -> None:
        libc().sem_post(self.address)

    def wait(self) -> None:
        while libc().sem_wait(self.address) != 0:  # EINTR: a signal woke it early
            pass


class HostNode:
    """Runs ``work()`` on its own thread between ``post()`` and ``join()`` on ``device``'s
    current stream (Note [Host node]); ``fail()`` marks the work's output bad when it raised.
    ``name`` names the thread and the NVTX range of each run; ``threads`` (0: torch's
    default) are torch's CPU threads for the work."""

    def __init__(self, work: Callable[[], None], device: torch.device | str, name: str,
                 fail: Callable[[], None] = lambda: None, threads: int = 0,
                 join_by: str = "host_function") -> None:
        if join_by not in JOINS:
            raise KernelError(f"a host node joins by one of {JOINS}, got {join_by!r}")
        if join_by == "wait_value" and platform.machine() not in ("x86_64", "AMD64"):
            raise KernelError(f"join_by='wait_value' orders the work's stores before the flag's "
                              f"by x86's store order; on {platform.machine()} use "
                              f"'host_function' (sem_post is a full barrier)")
        self.device = torch.empty(0, device=device).device if not isinstance(
            device, torch.device) else device
        self.work, self.fail, self.name = work, fail, name
        self._go, self._done = _Semaphore(), _Semaphore()
        self._range = nvtx_ranges.handle(name)
        self.runs, self.busy_s = 0, 0.0
        self.error: BaseException | None = None
        self._stopping = False
        self.threads, self.join_by = threads, join_by
        self._flag = None
        if self.device.type == "cuda" and join_by == "wait_value":
            self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # the GPU's address
            self._flag_host = ctypes.c_uint32.from_address(self._flag.data_ptr())  # too (UVA)
        if self.device.type == "cuda":
            addr = ctypes.cast(libc().sem_post, ctypes.c_void_p).value
            self._post_fn = addr
            self._wait_fn = ctypes.cast(libc().sem_wait, ctypes.c_void_p).value
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self.threads:  # torch's CPU threads are set per thread at its first parallel op
            torch.set_num_threads(self.threads)
        while True:
            self._go.wait()
            if self._stopping:
                self._done.post()
                return
            start = time.perf_counter()
            try:
                nvtx_ranges.call(self._range, self.work)
            except BaseException as exc:  # noqa: BLE001: the stream must not wait forever
                if self.error is None:
                    log.error("%s raised on the host; its output is marked bad (NaN) and the "
                              "next step stops: %r", self.name, exc)
                self.error = exc
                try:
                    self.fail()
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                self.busy_s += time.perf_counter() - start
                self.runs += 1
                if self._flag is not None:
                    self._flag_host.value = 1
                else:
                    self._done.post()

    def _launch(self, fn: int, sem: _Semaphore) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = _driver().cuLaunchHostFunc(stream, fn, sem.address)
        if err != 0:
            raise DeviceError(f"cuLaunchHostFunc failed with CUresult {err} for {self.name}")

    def post(self) -> None:
        """On the current stream: wake the worker once what the stream issued so far has run."""
        if self.error is not None:
            raise KernelError(f"{self.name} raised on the host in an earlier step: "
                              f"{self.error!r}") from self.error
        if self._stopping:
            raise KernelError(f"{self.name} is closed")
        if self.device.type == "cuda":
            self._launch(self._post_fn, self._go)
        else:
            self._go.post()

    def join(self) -> None:
        """On the current stream: what the stream issues next runs after the worker's run."""
        if self._flag is not None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
            address = self._flag.data_ptr()
            for fn, value, flags in (("ringflow_cuStreamWaitValue32", 1, _WAIT_EQ),
                                     ("ringflow_cuStreamWriteValue32", 0, 0)):
                err = getattr(_driver(), fn)(stream, address, value, flags)
                if err != 0:
                    raise DeviceError(f"{fn.removeprefix('ringflow_')} failed with CUresult "
                                      f"{err} for {self.name}; join_by='host_function' needs "
                                      f"no stream memory operations")
        elif self.device.type == "cuda":
            self._launch(self._wait_fn, self._done)
        else:
            self._done.wait()

    def close(self) -> None:
        """Stop the worker (after any run in flight). Call only when no stream or graph will
        post this node again."""
        if self._stopping:
            return
        if self.device.type == "cuda":  # a post still queued on a stream would wake nobody
            torch.cuda.synchronize(self.device)  # and its join would wait for good
        self._stopping = True
        self._go.post()
        self._done.wait()  # the worker posts done when it stops, whatever the join
        self._thread.join(timeout=5)

    def describe(self) -> dict:
        return {"runs": self.runs, "busy_ms": round(1e3 * self.busy_s, 3),
                "mean_ms": round(1e3 * self.busy_s / self.runs, 4) if self.runs else None}
