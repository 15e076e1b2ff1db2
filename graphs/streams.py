"""Streams that belong to ringflow alone.

Note [Dedicated streams]
    ``torch.cuda.Stream()`` does not create a stream: it hands out the next of 32 streams per
    priority that PyTorch keeps per device, round robin. Anyone else's ``torch.cuda.Stream()``
    can therefore be the very stream ringflow gathers on: ``torch.cuda.graph``'s default capture
    stream, vLLM's graph stream, another plan's lane. On the H200 that happened in the CUDA
    suite (the gather stream was already capturing, so ``join`` fell back to the synchronous
    path), and in an engine it would be worse when the alias is the compute stream: every
    prefetch serialised behind compute with nothing logged. So the executors create their own
    streams through the CUDA runtime (non-blocking, with the requested priority clamped to the
    device's range), hand them to torch as ``torch.cuda.ExternalStream``, and destroy them when
    their owner is collected. Destroying a stream with work still queued is safe: CUDA releases
    it once that work is done, and a captured graph never refers to the stream it was captured on.
"""

from __future__ import annotations

import weakref

import torch

from ringflow.errors import ExecutorError
from ringflow.graphs.cudart import checked, runtime


def _checked(name: str, result):
    return checked(name, result, ExecutorError, "is the CUDA device usable from this process?")


def _destroy(handles: list[int]) -> None:
    rt = runtime()
    for handle in handles:
        rt.cudaStreamDestroy(handle)  # nothing to report at collection time


def dedicated_streams(owner: object, device: torch.device, names, priority: int
                      ) -> dict[str, torch.cuda.ExternalStream]:
    """One new CUDA stream per name on ``device``, destroyed when ``owner`` is collected.

    ``priority`` is a CUDA stream priority (lower runs first); it is clamped to the device's
    range, as ``torch.cuda.Stream`` does.
    """
    names = list(names)
    if not names:
        return {}
    rt = runtime()
    streams, handles = {}, []
    with torch.cuda.device(device):
        least, greatest = _checked("cudaDeviceGetStreamPriorityRange",
                                   rt.cudaDeviceGetStreamPriorityRange())
        clamped = min(max(priority, greatest), least)
        for name in names:
            handle = _checked("cudaStreamCreateWithPriority",
                              rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, clamped))
            handles.append(int(handle))
            streams[name] = torch.cuda.ExternalStream(int(handle), device=device)
    weakref.finalize(owner, _destroy, handles)
    return streams
