"""One kernel per DCP gather pass: a rank's own tokens into their rows of a slot (the peer
transport), or every row from the gathered parts (the NCCL transport).

Note [Own rows in one launch]
    Under the aligned DCP layout (Note [DCP layout] in kv_gathers.py) a rank's rows of a slot
    are a fixed pattern, and which token each holds follows from the lengths alone. Computed
    with torch ops, that index math is some 35 small kernels per layer (a search, gathers from
    the block table, masks), each a launch and a pass over memory, for a copy of a few bytes
    per row: the index math, not the bytes, would set the pass's time. This kernel does the
    search (over the requests' aligned ends, two torch ops before it), the block-table lookup
    and the copy in one launch (``tools/dcp_passes.py`` times both). The torch path in
    kv_gathers.py serves CPUs and
    machines without Triton, bit for bit the same (both clamp a block-table column past the
    table's width, which the callers' lengths never reach).
"""

from __future__ import annotations

import torch

from ringflow.kernels.row_gather import flat_rows, triton

BLOCK_R = 16  # rows per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _locate(p, in_range, ends, lens, requests, search_steps, align):
        """Slot rows ``p`` -> (request, token index there, holds a token): a binary search
        over the requests' aligned ends (Note [DCP layout])."""
        lo = tl.zeros_like(p)                                    # requests whose end <= p
        hi = tl.zeros_like(p) + requests
        for _ in range(search_steps):
            active = (lo < hi) & in_range
            mid = (lo + hi) // 2
            end = tl.load(ends + mid, mask=active, other=0)
            lo = tl.where(active & (end <= p), mid + 1, lo)
            hi = tl.where(active & (end > p), mid, hi)
        q = tl.minimum(lo, requests - 1)
        n = tl.load(lens + q, mask=in_range, other=0).to(tl.int64)
        t = p - (tl.load(ends + q, mask=in_range, other=0) - (n + align - 1) // align * align)
        return q, t, in_range & (lo < requests) & (t < n)

    @triton.jit
    def _copy_rows(src, source, valid, src_stride, out, target, in_range, out_stride, width,
                   BLOCK_C: tl.constexpr):
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cols = c < width
            x = tl.load(src + source[:, None] * src_stride + c[None, :],
                        mask=valid[:, None] & cols[None, :], other=0)
            tl.store(out + target[:, None] * out_stride + c[None, :], x,
                     mask=in_range[:, None] & cols[None, :])

    # small ints that may be 1 stay runtime values: Triton specialises an argument equal to 1
    # into a constant, and Triton 3.x fails to compile a search loop of one constant step
    # ("mask type matches ptr type"); a runtime step count compiles once
    @triton.jit(do_not_specialize=["requests", "search_steps", "table_width", "size", "rank",
                                   "interleave"])
    def _own_rows_kernel(cache, table, lens, ends, out, n_rows, requests, search_steps, width,
                         cache_stride, out_stride, table_stride, table_width, per_block,
                         block_size, size, rank, interleave, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
        j = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)   # this rank's j-th row
        in_range = j < n_rows
        align = size * interleave
        p = (j // interleave).to(tl.int64) * align + rank * interleave + j % interleave
        q, t, valid = _locate(p, in_range, ends, lens, requests, search_steps, align)
        local = (t // align) * interleave + t % interleave      # position in the rank's cache
        column = tl.minimum(local // block_size, table_width - 1)
        block = tl.load(table + q * table_stride + column, mask=valid, other=0).to(tl.int64)
        _copy_rows(cache, block * per_block + local % block_size, valid, cache_stride, out, p,
                   in_range, out_stride, width, BLOCK_C)

    @triton.jit(do_not_specialize=["requests", "search_steps", "size", "interleave"])
    def _restore_kernel(staging, starts, lens, ends, out, n_rows, requests, search_steps, width,
                        staging_stride, out_stride, part_rows, size, interleave,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        p = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        in_range = p < n_rows
        align = size * interleave
        q, t, valid = _locate(p, in_range, ends, lens, requests, search_steps, align)
        owner = (t // interleave) % size
        position = (t // align) * interleave + t % interleave
        start = tl.load(starts + q * size + owner, mask=valid, other=0)
        _copy_rows(staging, owner * part_rows + start + position, valid, staging_stride, out, p,
                   in_range, out_stride, width, BLOCK_C)


def _aligned_ends(seq_lens: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = seq_lens.to(torch.int64)
    return lens, torch.cumsum((lens + align - 1) // align * align, 0)


def _block_c(width: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(width)))


def write_own_rows_fused(cache_rows: torch.Tensor, per_block: int, block_size: int,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                         size: int, rank: int, interleave: int) -> bool:
    """The kernel of Note [Own rows in one launch], where it can run (CUDA, Triton, rows whose
    elements are contiguous, a contiguous block table); False when the caller must use the
    torch path. ``cache_rows`` is the cache as one row axis (``gathers.row_view``)."""
    layouts = (flat_rows(cache_rows), flat_rows(out))
    requests = block_table.shape[0]
    if (triton is None or not out.is_cuda or cache_rows.device != out.device
            or None in layouts or layouts[0][1] != layouts[1][1] or cache_rows.dtype != out.dtype
            or requests == 0 or block_table.shape[1] == 0
            or block_table.stride(1) != 1 or not seq_lens.is_contiguous()):
        return False
    (cache_stride, width), (out_stride, _) = layouts  # equal widths: checked above
    lens, ends = _aligned_ends(seq_lens, size * interleave)
    n_rows = out.shape[0] // size
    with torch.cuda.device(out.device):
        _own_rows_kernel[(triton.cdiv(n_rows, BLOCK_R),)](
            cache_rows, block_table, lens, ends, out, n_rows, requests, requests.bit_length(),
            width, cache_stride, out_stride, block_table.stride(0), block_table.shape[1],
            per_block, block_size, size, rank, interleave, BLOCK_R=BLOCK_R,
            BLOCK_C=_block_c(width))
    return True


def restore_order_fused(staging: torch.Tensor, starts: torch.Tensor, seq_lens: torch.Tensor,
                        out: torch.Tensor, interleave: int) -> bool:
    """The NCCL path's order restoring in one launch (Note [Own rows in one launch]): every row
    of ``out`` from its owner's part of ``staging`` ([size, part_rows, *row], contiguous);
    ``starts[r, s]`` is where request r begins in rank s's part. False when the caller must use
    the torch path."""
    size, part_rows = staging.shape[:2]
    flat = staging.view(size * part_rows, *staging.shape[2:])
    layouts = (flat_rows(flat), flat_rows(out))
    requests = starts.shape[0]
    if (triton is None or not out.is_cuda or staging.device != out.device or None in layouts
            or layouts[0][1] != layouts[1][1] or staging.dtype != out.dtype or requests == 0
            or out.shape[0] == 0):
        return False
    (staging_stride, width), (out_stride, _) = layouts
    lens, ends = _aligned_ends(seq_lens, size * interleave)
    with torch.cuda.device(out.device):
        _restore_kernel[(triton.cdiv(out.shape[0], BLOCK_R),)](
            flat, starts.to(torch.int64).contiguous(), lens, ends, out, out.shape[0], requests,
            requests.bit_length(), width, staging_stride, out_stride, part_rows, size,
            interleave, BLOCK_R=BLOCK_R, BLOCK_C=_block_c(width))
    return True
