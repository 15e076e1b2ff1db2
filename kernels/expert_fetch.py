"""Bring the experts a step misses from pinned host memory into GPU cache slots.

Note [Device-indexed expert fetch]
    Which experts a MoE step reads is decided by its router, on the GPU, inside the step (and
    inside a CUDA graph when vLLM captured it). A copy engine needs its source, destination and
    size from the host at launch, so feeding it the router's choice means a host sync per
    layer, which neither a graph replay nor a fast decode step allows. This kernel takes the
    list of (expert, slot) pairs and its length as device tensors and copies with the SMs,
    reading the host memory across PCIe through its device address (pinned memory is mapped
    into the GPU's address space under unified addressing). Its grid is fixed (``programs``
    programs, a loop over the work), so it is captured once and replayed for any routing; the
    entries past the device-side count do nothing. A few dozen programs saturate the host link,
    so it leaves most SMs to the concurrent compute: the measurement that chose it is in
    ``tools/expert_fetch_bench.py``.

    The host side is either a pinned CPU tensor (its device address is looked up once per
    call) or a CUDA tensor whose memory is pinned host memory, as vLLM's UVA offloader leaves
    its parameters (``get_accelerator_view_from_cpu_tensor``): the kernel reads both alike.

    Where Triton or a GPU is absent the torch path does the same copy (an ``index_copy_``), so
    the CPU tests exercise the same contract bit for bit.
"""

from __future__ import annotations

import torch

from ringflow.errors import KernelError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

WORD = torch.int32  # the kernel moves 4-byte words: any dtype whose expert is a whole number of them
BLOCK = 2048  # words per program per iteration (8 KiB)
PROGRAMS = 32  # enough to fill the host link on an H200 (tools/expert_fetch_bench.py)

if triton is not None:
    @triton.jit
    def _fetch_kernel(host, cache, expert_ids, slot_ids, count, words, chunks,
                      BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        total = tl.load(count) * chunks
        for w in range(pid, total, programs):
            m = w // chunks
            c = w - m * chunks
            e = tl.load(expert_ids + m).to(tl.int64)
            s = tl.load(slot_ids + m).to(tl.int64)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            keep = offs < words
            x = tl.load(host + e * words + offs, mask=keep)
            tl.store(cache + s * words + offs, x, mask=keep)


class _HostWords:
    """A pinned host tensor as Triton sees a pointer: its device address and a word dtype."""

    def __init__(self, t: torch.Tensor) -> None:
        from ringflow.cudart import device_address
        self.dtype = WORD
        self._ptr = device_address(t.data_ptr())

    def data_ptr(self) -> int:
        return self._ptr


def _words(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise KernelError(f"{name} must be contiguous (one expert after another), got strides "
                          f"{t.stride()}")
    if (t[0].numel() * t.element_size()) % 4:
        raise KernelError(f"one expert of {name} is {t[0].numel() * t.element_size()} bytes; the "
                          f"fetch moves 4-byte words: pad the expert to a multiple of 4 bytes")
    return t.view(t.shape[0], -1).view(WORD)


def check(host: torch.Tensor, cache: torch.Tensor) -> None:
    """Raise ``KernelError`` unless ``host`` [experts, ...] can fill ``cache`` [slots, ...]."""
    if host.dim() < 2 or host.shape[1:] != cache.shape[1:] or host.dtype != cache.dtype:
        raise KernelError(f"host experts {tuple(host.shape)} {host.dtype} do not match cache "
                          f"slots {tuple(cache.shape)} {cache.dtype}: the trailing dimensions "
                          f"and dtype must be the same")
    if cache.is_cuda and host.device.type == "cpu" and not host.is_pinned():
        raise KernelError("host experts are pageable: the GPU can only read pinned memory; "
                          "pin them (tensor.pin_memory()) when they are created")


def fetch_experts(host: torch.Tensor, cache: torch.Tensor, expert_ids: torch.Tensor,
                  slot_ids: torch.Tensor, count: torch.Tensor,
                  programs: int = PROGRAMS) -> torch.Tensor:
    """``cache[slot_ids[i]] = host[expert_ids[i]]`` for ``i < count`` (Note [Device-indexed
    expert fetch]); entries from ``count`` on are not read.

    ``expert_ids`` and ``slot_ids`` are 1-D int32/int64 on ``cache``'s device, ``count`` a
    one-element int tensor there; slots are distinct within a call (the caller's plan makes
    them so). No host sync, capture-safe on CUDA. Launches on the current stream.
    """
    check(host, cache)
    if expert_ids.shape != slot_ids.shape or expert_ids.dim() != 1 or count.numel() != 1:
        raise KernelError(f"expert_ids {tuple(expert_ids.shape)} and slot_ids "
                          f"{tuple(slot_ids.shape)} must be 1-D of one length, count one element")
    if triton is not None and cache.is_cuda:
        src, dst = _words(host, "host experts"), _words(cache, "cache slots")
        words = src.shape[1]
        source = _HostWords(src) if src.device.type == "cpu" else src  # a CUDA view: as it is
        with torch.cuda.device(cache.device):
            _fetch_kernel[(programs,)](source, dst, expert_ids, slot_ids, count, words,
                                       triton.cdiv(words, BLOCK), BLOCK=BLOCK)
        return cache
    n = int(count.reshape(()).item())  # CPU (or a GPU without Triton): a plain indexed copy
    if n > expert_ids.shape[0]:
        raise KernelError(f"count {n} exceeds the {expert_ids.shape[0]} entries given")
    # as bytes: torch indexes no fp8 dtype on the CPU, and a byte copy is exact for any
    raw_host = host.reshape(host.shape[0], -1).view(torch.uint8)
    raw_cache = cache.view(cache.shape[0], -1).view(torch.uint8)
    picked = raw_host.index_select(0, expert_ids[:n].to(host.device, torch.long))
    raw_cache.index_copy_(0, slot_ids[:n].to(cache.device, torch.long), picked.to(cache.device))
    return cache
