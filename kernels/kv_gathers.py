"""Full-KV gathers for attention: a request's pages, and a DCP group's interleaved shards.

Both write into a slot and launch on the current stream with no host sync; every index is
computed on the device from the lengths, so the launch sequence does not depend on them (one
CUDA graph serves any lengths that fit the slot).

Note [DCP layout]
    Under decode context parallelism (DCP) of size N with interleave I, token t of a request is
    stored on rank ``(t // I) % N`` at local position ``(t // (I * N)) * I + t % I``; each rank
    keeps its tokens in its own paged cache (addressed by the block table) and its local length
    is ``base + clip(len - base * N - rank * I, 0, I)`` with ``base = len // I // N * I``. This
    is vLLM's layout (``get_dcp_local_seq_lens``).

    A DCP slot holds the requests in order, each starting at a multiple of ``N * I`` rows
    (:func:`dcp_slot_starts`; the rows between a request's last token and the next start are
    zero). Aligned so, row p of the slot belongs to rank ``(p // I) % N`` whatever the lengths:
    every rank's rows form one fixed strided pattern, which a copy engine moves in one 2-D copy
    straight into sequence order (:class:`ringflow.kernels.peer_exchange.PeerExchange`: each
    rank writes its own rows into its slot with one SM pass over its local tokens, then pulls
    the peers' rows from their slots; no pass restores order). The NCCL path packs each rank's
    local rows into its part of a staging buffer, all-gathers the parts, and restores the
    aligned order with one index gather. With one request, or lengths that are multiples of
    ``N * I``, the slot is the plain packed full KV.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ringflow.errors import KernelError
from ringflow.timing import interleaved_ms
from ringflow.kernels.gathers import check_paged_args, packed_positions, paged_gather, row_view
from ringflow.kernels.dcp_rows import restore_order_fused, write_own_rows_fused
from ringflow.kernels.row_gather import gather_rows


# torch >= 2.12 names it all_gather_single and deprecates the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_parts(out: torch.Tensor, part: torch.Tensor, group) -> None:
    """Every rank's ``part`` into ``out``, rank after rank (rank ``r``'s rows at
    ``r * len(part)``), over ``group`` on the current stream."""
    _all_gather(out, part, group=group)


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


def dcp_slot_rows(tokens: int, requests: int, size: int, interleave: int = 1) -> int:
    """Rows of a DCP slot for ``tokens`` context tokens over at most ``requests`` requests:
    each request padded to a multiple of ``size * interleave`` (Note [DCP layout])."""
    align = size * interleave  # each request pads fewer than `align` rows; the sum is aligned
    return (tokens + requests * (align - 1)) // align * align


def dcp_slot_starts(seq_lens: torch.Tensor, size: int, interleave: int = 1) -> torch.Tensor:
    """``[requests]``: the slot row where each request's first token lies (Note [DCP layout])."""
    padded = _padded(seq_lens.to(torch.int64), size * interleave)
    return torch.cumsum(padded, 0) - padded


def _padded(lens: torch.Tensor, align: int) -> torch.Tensor:
    return (lens + align - 1) // align * align


def _slot_positions(lens: torch.Tensor, rows: torch.Tensor, align: int):
    """For slot rows ``rows`` (int64, ascending): the request each lies in, its token index
    there, and whether it holds a token (not padding, not past the last request)."""
    padded = _padded(lens, align)
    ends = torch.cumsum(padded, 0)
    request = torch.searchsorted(ends, rows, right=True)
    valid = request < lens.shape[0]
    request = request.clamp_(max=max(lens.shape[0] - 1, 0))
    t = rows - (ends[request] - padded[request])
    return request, t, valid & (t < lens[request])


def _local_position(t: torch.Tensor, size: int, interleave: int) -> torch.Tensor:
    """Where token ``t`` of a request lies in its owner's cache (Note [DCP layout])."""
    return (t // (interleave * size)) * interleave + t % interleave


def _check_dcp(out: torch.Tensor, staging: torch.Tensor | None, staged: bool, size: int,
               requests: int, interleave: int, seq_lens: torch.Tensor) -> None:
    if interleave < 1:
        raise KernelError(f"interleave must be positive, got {interleave}")
    align = size * interleave
    if out.shape[0] % align:
        raise KernelError(f"a DCP slot's rows must be a multiple of size * interleave = {align} "
                          f"(dcp_slot_rows), got {out.shape[0]}")
    if seq_lens.shape != (requests,):
        raise KernelError(f"seq_lens must have one entry per request ({requests}), got "
                          f"{tuple(seq_lens.shape)}")
    if not staged:  # the exchange lands the rows in place
        return
    if staging is None:
        raise KernelError("an NCCL exchange needs a staging buffer ([size, rows // size, *row])")
    if staging.dim() < 2 or staging.shape[0] != size or staging.shape[2:] != out.shape[1:]:
        raise KernelError(f"staging must be [{size}, local_capacity, *row] for a group of "
                          f"{size} and a slot of {tuple(out.shape)}, got {tuple(staging.shape)}")
    if not staging.is_contiguous() or staging.dtype != out.dtype:
        raise KernelError("staging must be contiguous and of the slot's dtype")
    if staging.shape[1] < out.shape[0] // size:  # a rank holds 1/size of every aligned chunk
        raise KernelError(f"staging holds {staging.shape[1]} rows per rank; a slot of "
                          f"{out.shape[0]} rows over {size} ranks needs {out.shape[0] // size} "
                          f"(the slot's rows / size)")


def restore_order(staging: torch.Tensor, local: torch.Tensor, seq_lens: torch.Tensor,
                   out: torch.Tensor, interleave: int, *, fused: bool = True) -> torch.Tensor:
    """Every rank's part of ``staging`` (its local rows, request after request) into ``out`` in
    the slot's order: one index gather (Note [DCP layout]), in one launch where Triton runs
    (Note [Own rows in one launch]; ``fused=False`` forces the torch ops)."""
    size = staging.shape[0]
    starts = torch.cumsum(local, 0) - local                                # [R, N] exclusive
    if fused and restore_order_fused(staging, starts, seq_lens, out, interleave):
        return out
    rows = torch.arange(out.shape[0], device=out.device)
    request, t, valid = _slot_positions(seq_lens.to(torch.int64), rows, size * interleave)
    owner = (t // interleave) % size
    position = _local_position(t, size, interleave)
    source = owner * staging.shape[1] + starts[request, owner] + position
    source = torch.where(valid, source, torch.zeros_like(source))
    return gather_rows(staging.view(-1, *staging.shape[2:]), source, valid, out)


def write_own_rows(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    out: torch.Tensor, size: int, rank: int, interleave: int, *,
                    fused: bool = True) -> torch.Tensor:
    """This rank's tokens into their rows of ``out`` (the rows ``(p // I) % N == rank``; padding
    among them zeroed), read from its paged cache: one pass over 1/N of the slot, in one launch
    where Triton runs (Note [Own rows in one launch]; ``fused=False`` forces the torch ops)."""
    cache_rows, per_block = row_view(cache)
    block_size = cache.shape[1]
    if fused and cache_rows is not None and write_own_rows_fused(
            cache_rows, per_block, block_size, block_table, seq_lens, out, size, rank, interleave):
        return out
    align = size * interleave
    chunk = torch.arange(out.shape[0] // align, device=out.device).unsqueeze(1) * align
    rows = (chunk + rank * interleave + torch.arange(interleave, device=out.device)).flatten()
    request, t, valid = _slot_positions(seq_lens.to(torch.int64), rows, align)
    position = _local_position(t, size, interleave)
    table = block_table.to(torch.int64)
    block = torch.where(valid, table[request, (position // block_size).clamp_(
        0, table.shape[1] - 1)], torch.zeros_like(request))
    offset = torch.where(valid, position % block_size, torch.zeros_like(position))
    if cache_rows is not None:
        return gather_rows(cache_rows, block * per_block + offset, valid, out, out_index=rows)
    # rows that no stride pattern reaches: index in place (a temporary of 1/size of the slot)
    picked = cache[block, offset]
    picked.masked_fill_(~valid.view(-1, *([1] * (picked.dim() - 1))), 0)
    return out.index_copy_(0, rows, picked)


class NcclExchange:
    """The DCP gather's parts exchanged by one NCCL all-gather (on the SMs) over the gather
    lane's own process group (never the one the main stream uses), through a staging buffer."""

    in_place = False  # the parts come back rank by rank: an index gather restores the order

    def __init__(self, group) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def exchange(self, out: torch.Tensor, staging: torch.Tensor, interleave: int) -> None:
        """Fill every peer's part of ``staging`` ([size, rows, *row]) with the peer's own."""
        all_gather_parts(staging.view(-1, *staging.shape[2:]), staging[self.rank], self.group)


def dcp_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               out: torch.Tensor, staging: torch.Tensor | None, exchange, *,
               interleave: int = 1) -> torch.Tensor:
    """The full KV of every request from a DCP group's local caches, in the slot's order
    (Note [DCP layout]: requests in order, each from a multiple of ``size * interleave``).

    An exchange with ``in_place`` true (:class:`ringflow.kernels.peer_exchange.PeerExchange`)
    has this rank write its own rows straight into ``out`` and pulls the peers' rows into theirs
    with copy engines (Note [Peer exchange]); ``staging`` is not used. Otherwise
    (:class:`NcclExchange`) this rank packs its local rows into its part of ``staging``, the
    exchange fills the other parts, and one index gather restores the order.

    Args:
        cache: this rank's ``[num_blocks, block_size, *row]`` paged cache (its local tokens;
            contiguous rows).
        block_table: ``[requests, max_blocks]``, addressing local positions.
        seq_lens: ``[requests]`` global token counts (identical on every rank).
        out: ``[rows, *row]``, ``rows`` a multiple of ``size * interleave`` and at least
            :func:`dcp_slot_rows`; padding and the tail are zeroed.
        staging: ``[size, rows // size, *row]`` (or more rows per rank) for an exchange
            that is not in place; it belongs to the same slot as ``out``, so a ring never shares
            it between two gathers.
        exchange: has ``size``, ``rank``, ``in_place`` and ``exchange(out, staging, interleave)``.
        interleave: vLLM's ``cp_kv_cache_interleave_size``.
    """
    size, rank = exchange.size, exchange.rank
    requests = block_table.shape[0]
    _check_dcp(out, staging, not exchange.in_place, size, requests, interleave, seq_lens)
    if requests == 0:  # every rank sees the same batch: all skip the exchange together
        return out.zero_()
    if exchange.in_place:
        check_paged_args(cache, 2, block_table, seq_lens, out)
        write_own_rows(cache, block_table, seq_lens, out, size, rank, interleave)
        exchange.exchange(out, None, interleave)
        return out
    local = dcp_local_lens(seq_lens, size, interleave)                      # [R, N]
    paged_gather(cache, block_table, local[:, rank], staging[rank])
    exchange.exchange(out, staging, interleave)
    return restore_order(staging, local, seq_lens, out, interleave)


def dcp_all_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   out: torch.Tensor, staging: torch.Tensor, group, *,
                   interleave: int = 1) -> torch.Tensor:
    """:func:`dcp_gather` with an NCCL all-gather over ``group``."""
    return dcp_gather(cache, block_table, seq_lens, out, staging, NcclExchange(group),
                      interleave=interleave)


def time_exchanges(out: torch.Tensor, staging: torch.Tensor | None, exchanges: dict, group, *,
                   interleave: int = 1, rounds: int = 5) -> dict[str, float]:
    """Median ms of each of ``exchanges`` moving a slot's bytes between the ranks (``out`` for
    an exchange in place, ``staging`` otherwise), interleaved round by round, the slowest
    rank's (collective: every rank of ``group`` calls it; host-syncs)."""
    ms = interleaved_ms({name: functools.partial(exchange.exchange, out, staging, interleave)
                         for name, exchange in exchanges.items()}, rounds, warmup=2)
    slowest = torch.tensor([ms[name] for name in exchanges], device=out.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(exchanges, slowest.tolist()))
