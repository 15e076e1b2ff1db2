"""Full-KV gathers for attention: a request's pages, and a DCP group's interleaved shards.

Both write into a slot and launch on the current stream with no host sync; every index is
computed on the device from the lengths, so the launch sequence does not depend on them (one
CUDA graph serves any lengths that fit the slot).

Note [DCP layout]
    Under decode context parallelism (DCP) of size N with interleave I, token t of a request is
    stored on rank ``(t // I) % N`` at local position ``(t // (I * N)) * I + t % I``; each rank
    keeps its tokens in its own paged cache (addressed by the block table) and its local length
    is ``base + clip(len - base * N - rank * I, 0, I)`` with ``base = len // I // N * I``. This
    is vLLM's layout (``get_dcp_local_seq_lens``). The all-gather packs each rank's local rows
    into its part of a staging buffer, exchanges the parts (NCCL over a process group of its
    own, or copy engines pulling from the peers' memory), and restores sequence order with one
    index gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringflow.errors import KernelError
from ringflow.kernels.gathers import check_paged_args, packed_positions, paged_gather
from ringflow.kernels.row_gather import gather_rows


# torch >= 2.12 names it all_gather_single and deprecates the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def page_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Copy the pages holding each request's first ``seq_lens`` tokens into ``out``, packed.

    For caches whose page interior is a backend's private layout (packed or transposed for a
    kernel): ``cache`` is ``[num_blocks, *page]`` (a page may be strided: FLASH_ATTN keeps K and
    V in two planes) and pages are copied whole. ``out`` is ``[capacity, *page]`` or
    ``[capacity, page elements]``. Request r takes ``ceil(seq_lens[r] / block_size)`` pages;
    pages past the last are zeroed.
    """
    if out.dim() == 2 and out.shape[1:] != cache.shape[1:] and out.shape[1] == cache[0].numel():
        out = out.view(out.shape[0], *cache.shape[1:])  # a flat slot, shaped like the pages
    check_paged_args(cache, 1, block_table, seq_lens, out)
    if block_size < 1:
        raise KernelError(f"block_size must be positive, got {block_size}")
    if block_table.shape[0] == 0:
        return out.zero_()
    lens = seq_lens.to(torch.int64)
    pages = (lens + block_size - 1) // block_size
    request, index, valid = packed_positions(pages, out.shape[0])
    block = block_table.to(torch.int64)[request, index.clamp_(max=block_table.shape[1] - 1)]
    block = torch.where(valid, block, torch.zeros_like(block))
    return gather_rows(cache, block, valid, out)


def dcp_local_lens(seq_lens: torch.Tensor, size: int, interleave: int = 1) -> torch.Tensor:
    """``[requests, size]``: how many of each request's tokens each DCP rank holds."""
    lens = seq_lens.to(torch.int64).unsqueeze(-1)
    ranks = torch.arange(size, device=seq_lens.device)
    base = lens // interleave // size * interleave
    return base + (lens - base * size - ranks * interleave).clamp(min=0, max=interleave)


def dcp_local_capacity(capacity: int, requests: int, size: int, interleave: int = 1) -> int:
    """Rows one rank's part of the staging buffer needs for ``capacity`` tokens in all."""
    return -(-capacity // size) + interleave * requests


def _check_dcp(out: torch.Tensor, staging: torch.Tensor, size: int, requests: int,
               interleave: int) -> None:
    if staging.dim() < 2 or staging.shape[0] != size or staging.shape[2:] != out.shape[1:]:
        raise KernelError(f"staging must be [{size}, local_capacity, *row] for a group of "
                          f"{size} and a slot of {tuple(out.shape)}, got {tuple(staging.shape)}")
    if not staging.is_contiguous() or staging.dtype != out.dtype:
        raise KernelError("staging must be contiguous and of the slot's dtype")
    if interleave < 1:
        raise KernelError(f"interleave must be positive, got {interleave}")
    needed = dcp_local_capacity(out.shape[0], requests, size, interleave)
    if staging.shape[1] < needed:
        raise KernelError(f"staging holds {staging.shape[1]} rows per rank; {requests} requests "
                          f"of up to {out.shape[0]} tokens over {size} ranks need {needed} "
                          f"(dcp_local_capacity)")


def _restore_order(staging: torch.Tensor, local: torch.Tensor, seq_lens: torch.Tensor,
                   out: torch.Tensor, interleave: int) -> torch.Tensor:
    """Every rank's part of ``staging`` (its local rows, request after request) into ``out`` in
    sequence order: one index gather (Note [DCP layout])."""
    size = staging.shape[0]
    lens = seq_lens.to(torch.int64)
    request, t, valid = packed_positions(lens, out.shape[0])
    owner = (t // interleave) % size
    position = (t // (interleave * size)) * interleave + t % interleave
    starts = torch.cumsum(local, 0) - local                                # [R, N] exclusive
    source = owner * staging.shape[1] + starts[request, owner] + position
    source = torch.where(valid, source, torch.zeros_like(source))
    return gather_rows(staging.view(-1, *staging.shape[2:]), source, valid, out)


class NcclExchange:
    """The parts of a DCP staging buffer exchanged by one NCCL all-gather (on the SMs), over
    the gather lane's own process group (never the one the main stream uses)."""

    def __init__(self, group) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def pull_peers(self, staging: torch.Tensor) -> None:
        """Fill every peer's part of ``staging`` ([size, rows, *row]) with the peer's own."""
        _all_gather(staging.view(-1, *staging.shape[2:]), staging[self.rank], group=self.group)


def dcp_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               out: torch.Tensor, staging: torch.Tensor, exchange, *,
               interleave: int = 1) -> torch.Tensor:
    """The full KV of every request, in sequence order, from a DCP group's local caches.

    This rank packs its local rows into its part of ``staging``, ``exchange`` fills the other
    parts with the peers' (:class:`NcclExchange`, or a
    :class:`ringflow.kernels.peer_exchange.PeerExchange` whose copy engines pull them from the
    peers' memory: Note [Peer exchange]), and one gather restores sequence order.

    Args:
        cache: this rank's ``[num_blocks, block_size, *row]`` paged cache (its local tokens).
        block_table: ``[requests, max_blocks]``, addressing local positions.
        seq_lens: ``[requests]`` global token counts (identical on every rank).
        out: ``[capacity, *row]``; requests are packed in order, the tail is zeroed.
        staging: ``[size, local_capacity, *row]`` (see :func:`dcp_local_capacity`); it belongs
            to the same slot as ``out``, so a ring never shares it between two gathers.
        exchange: has ``size``, ``rank`` and ``pull_peers(staging)``.
        interleave: vLLM's ``cp_kv_cache_interleave_size``.
    """
    size, rank = exchange.size, exchange.rank
    requests = block_table.shape[0]
    _check_dcp(out, staging, size, requests, interleave)
    if requests == 0:  # every rank sees the same batch: all skip the exchange together
        return out.zero_()
    local = dcp_local_lens(seq_lens, size, interleave)                      # [R, N]
    paged_gather(cache, block_table, local[:, rank], staging[rank])
    exchange.pull_peers(staging)
    return _restore_order(staging, local, seq_lens, out, interleave)


def dcp_all_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   out: torch.Tensor, staging: torch.Tensor, group, *,
                   interleave: int = 1) -> torch.Tensor:
    """:func:`dcp_gather` with an NCCL all-gather over ``group``."""
    return dcp_gather(cache, block_table, seq_lens, out, staging, NcclExchange(group),
                      interleave=interleave)


def time_exchanges(staging: torch.Tensor, exchanges: dict, group, *, rounds: int = 5
                   ) -> dict[str, float]:
    """Median ms of each of ``exchanges`` filling ``staging``'s parts, the slowest rank's
    (collective: every rank of ``group`` calls it; host-syncs)."""
    ms = []
    for exchange in exchanges.values():
        times = []
        for i in range(rounds + 2):  # two warm-up rounds
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            exchange.pull_peers(staging)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        ms.append(sorted(times)[len(times) // 2])
    slowest = torch.tensor(ms, device=staging.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(exchanges, slowest.tolist()))
