"""Copy-engine exchange for the DCP gather: every rank's ring in memory the others map.

Note [Peer exchange]
    NCCL's all-gather runs on the SMs, which the attention it should hide behind needs. Copy
    engines move bytes between
    GPUs over NVLink without SMs. So the DCP lane's ring is allocated in symmetric memory
    (``torch.distributed._symmetric_memory``: the same allocation size on every rank, each
    mapped into every other's address space), and every rank's rows of a slot lie in one fixed
    strided pattern (Note [DCP layout] in kv_gathers.py). A rank writes its own tokens into
    its rows of its slot (one SM pass over 1/N of the slot), then pulls each peer's rows from
    the same rows of the peer's slot with one 2-D device-to-device copy (``cudaMemcpy2DAsync``:
    a chunk of ``interleave`` rows every ``N * interleave`` rows), which the driver issues on a
    copy engine, straight into sequence order. A slot's rows of rank ``s`` are written only by
    rank ``s`` (in its own slot) and by the pulls of the others (in theirs). The aligned
    layout is what makes this possible: packed parts would need a staging buffer (as big as
    the slot) and an order-restoring pass on the SMs, the work the copy engines are meant to
    take off them.

    Ordering across processes is two barriers per gather, on the gather stream (tiny kernels on
    each rank's signal pad): after the own rows are written (no one pulls rows before their
    owner wrote them), and after the pulls (no one writes, poisons or re-gathers into a slot a
    peer still reads; with a one-slot ring the next gather writes the same slot at once). Each
    rank issues its gathers in the same order (the plan is the same on every rank), so the
    barriers pair up.

    NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before the first
    allocation unless the caller set it); nothing here creates a multicast object. torch reads
    the variable at each check, so it holds for the whole process: vLLM's own symmetric-memory
    paths in the same worker see no multicast either (set it to 0 beforehand to keep it).

    Each ring is a symmetric block of its own. ``symm_mem.empty`` carves tensors out of an
    implicit pool (torch 2.13's default), where a tensor may start partway into a block:
    ``get_buffer`` counts its offsets from the block's start, and every tensor of a block
    shares one signal pad, so a peer's rows would be read from the wrong bytes and two rings'
    barriers would pair with each other. :func:`symmetric_exchange` allocates the block
    directly, at offset 0 with its own pad.
"""

from __future__ import annotations

import os

import torch

from ringflow.errors import KernelError


BARRIER_TIMEOUT_MS = 600_000  # as NCCL's watchdog: ten minutes


def all_ranks_agree(ok: bool, group, device: torch.device) -> bool:
    """True on every rank when ``ok`` is true on every rank of ``group`` (collective)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class PeerExchange:
    """A ring every rank of a group maps: ``storage`` (this rank's) and its peers' copies."""

    in_place = True  # the rows land in sequence order (Note [DCP layout])

    def __init__(self, storage: torch.Tensor, handle, size: int, rank: int) -> None:
        self.storage, self.size, self.rank = storage, size, rank
        self._handle = handle
        self._remote: dict[int, torch.Tensor] = {}  # rank -> its whole storage, as bytes

    def remote(self, rank: int, view: torch.Tensor) -> torch.Tensor:
        """``view`` (contiguous, inside :attr:`storage`) as it lies in ``rank``'s memory: a
        slice of ``rank``'s whole storage, mapped once (views of every shape come from it; a
        step's context length changes them)."""
        offset = view.data_ptr() - self.storage.data_ptr()
        size = view.numel() * view.element_size()
        whole = self.storage.numel() * self.storage.element_size()
        if not view.is_contiguous() or offset < 0 or offset + size > whole:
            raise KernelError("a peer view must be a contiguous part of the exchange's storage")
        peer = self._remote.get(rank)
        if peer is None:  # a captured graph keeps the address anyway
            peer = self._remote[rank] = self._handle.get_buffer(rank, (whole,), torch.uint8, 0)
        return peer[offset: offset + size].view(view.dtype).view(view.shape)

    def barrier(self) -> None:
        """Every rank's current stream reaches this point before any goes on (no host sync).
        A peer that never arrives traps the kernel after :data:`BARRIER_TIMEOUT_MS` (a CUDA
        error, not a silent hang)."""
        self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def exchange(self, out: torch.Tensor, staging: torch.Tensor | None, interleave: int) -> None:
        """Fill every peer's rows of ``out`` (a slot inside :attr:`storage`, Note [DCP layout])
        from the same rows of the peer's slot, once each has written them (Note [Peer
        exchange]). ``staging`` is not used (the rows land in order; ``auto`` rings have one)."""
        align = self.size * interleave
        if out.shape[0] % align or not out.is_contiguous():
            raise KernelError(f"a peer exchange needs a contiguous slot of a multiple of "
                              f"{align} rows, got {tuple(out.shape)}")
        shape = (out.shape[0] // align, self.size, interleave, *out.shape[1:])
        self.barrier()
        for step in range(1, self.size):  # staggered: each rank starts with a different peer
            peer = (self.rank + step) % self.size
            copy_strided(out.view(shape)[:, peer], self.remote(peer, out).view(shape)[:, peer])
        self.barrier()

    def gather_parts(self, gathered: torch.Tensor, local: torch.Tensor) -> None:
        """vLLM's all-gather of ``local`` into ``gathered``, rank after rank, with copy
        engines: every rank's ``local`` lies at the same place in its own storage (the MLA
        context ring's slot, Note [DCP context exchange] in dcp.py), so each rank
        copies its own rows into its part and pulls every peer's from the peer's storage.
        The same two barriers as :meth:`exchange`: after the owners wrote ``local``, after
        the pulls (no rank rewrites ``local`` while a peer still reads it)."""
        rows = local.shape[0]
        if (gathered.shape[0] != rows * self.size or gathered.shape[1:] != local.shape[1:]
                or gathered.dtype != local.dtype or not gathered.is_contiguous()
                or local.dim() < 2):
            raise KernelError(f"a peer all-gather of {tuple(local.shape)} {local.dtype} over "
                              f"{self.size} ranks fills {self.size * rows} contiguous rows of "
                              f"the same width and dtype, got {tuple(gathered.shape)} "
                              f"{gathered.dtype}")
        parts = gathered.view(self.size, rows, *local.shape[1:])
        self.barrier()
        for step in range(self.size):  # staggered: each rank starts with a different peer
            peer = (self.rank + step) % self.size
            copy_strided(parts[peer], local if peer == self.rank else self.remote(peer, local))
        self.barrier()


def copy_strided(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two views of one shape and strides whose every step along dim 0
    is a run of contiguous bytes: on CUDA one 2-D memcpy on the current stream (a copy engine,
    no SMs; capture-safe); elsewhere (the CPU tests) a torch copy."""
    if dst.shape != src.shape or dst.stride() != src.stride() or dst.dtype != src.dtype or \
            dst.dim() < 2 or dst.numel() and not dst[0].is_contiguous():
        raise KernelError(f"a strided copy needs two views of one shape, strides and dtype whose "
                          f"rows (dim 0) are contiguous, got {tuple(dst.shape)} {dst.stride()} "
                          f"and {tuple(src.shape)} {src.stride()}")
    if not dst.is_cuda or dst.numel() == 0:  # no rows (a chunk of no tokens): nothing to copy
        dst.copy_(src)
        return
    from ringflow.cudart import checked, runtime
    rt = runtime()
    size = dst.element_size()
    checked("cudaMemcpy2DAsync",
            rt.cudaMemcpy2DAsync(dst.data_ptr(), dst.stride(0) * size, src.data_ptr(),
                                 src.stride(0) * size, dst[0].numel() * size, dst.shape[0],
                                 rt.cudaMemcpyKind.cudaMemcpyDefault,
                                 torch.cuda.current_stream(dst.device).cuda_stream),
            KernelError, "the peer exchange could not copy; run with dcp_transport: nccl")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def symmetric_block(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``shape`` of ``dtype`` in a symmetric-memory block of its own (Note [Peer exchange]:
    offset 0, its own signal pad), not carved from torch's implicit pool."""
    from torch._C._distributed_c10d import _SymmetricMemory

    shape = tuple(shape)
    stride, step = [], 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= n
    try:
        return _SymmetricMemory.empty_strided_p2p(shape, tuple(stride), dtype, device)
    except TypeError:  # a torch whose call still names the group: it has no implicit pool
        from torch.distributed import _symmetric_memory as symm_mem
        return symm_mem.empty(*shape, dtype=dtype, device=device)


def symmetric_exchange(shape, dtype: torch.dtype, device: torch.device, group) -> PeerExchange:
    """Allocate ``shape`` in symmetric memory on every rank of ``group`` (collective: every
    rank calls it at the same point) and return the exchange over it.

    Raises:
        KernelError: symmetric memory is not available on some rank (torch, driver, GPUs or
            memory); every rank raises it together, so all fall back to NCCL together.
    """
    import torch.distributed as dist

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    storage, handle, why = None, None, None
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        name = group.group_name
        if _torch_version() < (2, 11) and not symm_mem.is_symm_mem_enabled_for_group(name):
            symm_mem.enable_symm_mem_for_group(name)  # needed before rendezvous until 2.11
        storage = symmetric_block(shape, dtype, device)
    except Exception as exc:  # not built with it, out of memory, old driver...
        why = exc
    # every rank goes on to the rendezvous, or none does: one that failed alone would leave the
    # others waiting in it, or later pair an NCCL all-gather with their barriers
    if all_ranks_agree(why is None, group, device):
        try:
            handle = symm_mem.rendezvous(storage, name)
        except Exception as exc:  # no P2P between these GPUs, an IPC failure...
            why = exc
    elif why is None:
        why = RuntimeError("another rank of the group could not allocate symmetric memory")
    if not all_ranks_agree(why is None and handle is not None, group, device):
        why = why or RuntimeError("another rank of the group failed its rendezvous")
        raise KernelError(f"symmetric memory is not available for the DCP group "
                          f"({type(why).__name__}: {str(why).splitlines()[0] if str(why) else ''})"
                          ) from why
    return PeerExchange(storage, handle, dist.get_world_size(group), dist.get_rank(group))
