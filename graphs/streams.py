"""Streams that belong to ringflow alone.

Note [Dedicated streams]
    ``torch.cuda.Stream()`` does not create a stream: it hands out the next of 32 streams per
    priority that PyTorch keeps per device, round robin. Anyone else's ``torch.cuda.Stream()``
    can therefore be the very stream ringflow gathers on: ``torch.cuda.graph``'s default capture
    stream, vLLM's graph stream, another plan's lane. A gather stream that is already part of
    someone's capture cannot join another one (``join`` falls back to the synchronous path),
    and a gather stream that is the compute stream serialises every prefetch behind compute
    with nothing to show for it. So the executors create their own
    streams through the CUDA runtime (non-blocking, with the requested priority clamped to the
    device's range) and hand them to torch as ``torch.cuda.ExternalStream``.

    Such a stream is never destroyed: torch keeps the streams a tensor was used on (its caching
    allocator records an event on them when the tensor is freed, cuBLAS keeps a workspace per
    stream), and destroying one while torch still refers to it fails later, far from the cause
    ("invalid device context" from an event record in a tensor's destructor). Instead a
    collected owner's streams go back to a free list per device and priority, and the next
    executor takes them: each stream belongs to one live owner at a time, the number ever
    created is the most alive at once, and work still queued on a recycled stream only runs
    before the new owner's (stream order).
"""

from __future__ import annotations

import threading
import weakref

import torch

from ringflow.errors import ExecutorError
from ringflow.cudart import checked, runtime


def _checked(name: str, result):
    return checked(name, result, ExecutorError, "is the CUDA device usable from this process?")


_free: dict[tuple[int, int], list[int]] = {}  # (device, priority) -> idle stream handles
_lock = threading.RLock()  # a collection inside the lock may run _recycle on this thread
_created = [0]  # streams this process ever created (they are never destroyed)


def streams_created() -> int:
    """How many CUDA streams ringflow created in this process so far."""
    return _created[0]


def idle_streams() -> int:
    """How many of them wait for an owner."""
    with _lock:
        return sum(len(v) for v in _free.values())


def _recycle(key: tuple[int, int], handles: list[int]) -> None:
    with _lock:
        _free.setdefault(key, []).extend(handles)


def dedicated_streams(owner: object, device: torch.device, names, priority: int
                      ) -> dict[str, torch.cuda.ExternalStream]:
    """One stream per name on ``device`` that no one else uses while ``owner`` lives.

    ``priority`` is a CUDA stream priority (lower runs first); it is clamped to the device's
    range, as ``torch.cuda.Stream`` does.
    """
    names = list(names)
    if not names:
        return {}
    rt = runtime()
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams, handles = {}, []
    with torch.cuda.device(index):
        least, greatest = _checked("cudaDeviceGetStreamPriorityRange",
                                   rt.cudaDeviceGetStreamPriorityRange())
        key = (index, min(max(priority, greatest), least))
        with _lock:
            idle = _free.setdefault(key, [])
            reused = [idle.pop() for _ in range(min(len(idle), len(names)))]
        try:
            for name in names:
                if reused:
                    handle = reused.pop()
                else:
                    handle = int(_checked("cudaStreamCreateWithPriority",
                                          rt.cudaStreamCreateWithPriority(
                                              rt.cudaStreamNonBlocking, key[1])))
                    with _lock:
                        _created[0] += 1
                handles.append(handle)
                streams[name] = torch.cuda.ExternalStream(handle,
                                                          device=torch.device("cuda", index))
        except BaseException:  # nothing is lost: every stream taken so far goes back
            _recycle(key, handles + reused)
            raise
    weakref.finalize(owner, _recycle, key, handles)
    return streams
