"""One kernel that writes a DCP rank's own tokens into their rows of a slot.

Note [Own rows in one launch]
    Under the aligned DCP layout (Note [DCP layout] in kv_gathers.py) a rank's rows of a slot
    are a fixed pattern, and which token each holds follows from the lengths alone. Computed
    with torch ops, that index math is some 35 small kernels per layer (a search, gathers from
    the block table, masks): measured on the H200 inside a CUDA graph, 76 µs per layer at 64k
    context (197 µs at 400k) for a copy whose bytes take about 25 µs. This kernel does the
    search (over the requests' aligned ends, two torch ops before it), the block-table lookup
    and the copy in one launch: 30 µs (135 µs). The torch path in kv_gathers.py serves CPUs and
    machines without Triton, bit for bit the same (both clamp a block-table column past the
    table's width, which the callers' lengths never reach).
"""

from __future__ import annotations

import torch

from ringflow.kernels.row_gather import _flat_rows, triton

if triton is not None:
    import triton.language as tl

    # small ints that may be 1 stay runtime values: Triton specialises an argument equal to 1
    # into a constant, and a search loop of one constant step failed to compile on the H200
    # (Triton 3.x, "mask type matches ptr type"); a runtime step count compiles once
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
        lo = tl.zeros([BLOCK_R], dtype=tl.int64)                 # requests whose end <= p
        hi = tl.zeros([BLOCK_R], dtype=tl.int64) + requests
        for _ in range(search_steps):
            active = (lo < hi) & in_range
            mid = (lo + hi) // 2
            end = tl.load(ends + mid, mask=active, other=0)
            lo = tl.where(active & (end <= p), mid + 1, lo)
            hi = tl.where(active & (end > p), mid, hi)
        q = tl.minimum(lo, requests - 1)
        n = tl.load(lens + q, mask=in_range, other=0).to(tl.int64)
        t = p - (tl.load(ends + q, mask=in_range, other=0) - (n + align - 1) // align * align)
        valid = in_range & (lo < requests) & (t < n)
        local = (t // align) * interleave + t % interleave      # position in the rank's cache
        column = tl.minimum(local // block_size, table_width - 1)
        block = tl.load(table + q * table_stride + column, mask=valid, other=0).to(tl.int64)
        source = block * per_block + local % block_size
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cols = c < width
            x = tl.load(cache + source[:, None] * cache_stride + c[None, :],
                        mask=valid[:, None] & cols[None, :], other=0)
            tl.store(out + p[:, None] * out_stride + c[None, :], x,
                     mask=in_range[:, None] & cols[None, :])


def write_own_rows_fused(cache_rows: torch.Tensor, per_block: int, block_size: int,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                         size: int, rank: int, interleave: int) -> bool:
    """The kernel of Note [Own rows in one launch], where it can run (CUDA, Triton, rows whose
    elements are contiguous, a contiguous block table); False when the caller must use the
    torch path. ``cache_rows`` is the cache as one row axis (``gathers.row_view``)."""
    layouts = (_flat_rows(cache_rows), _flat_rows(out))
    requests = block_table.shape[0]
    if (triton is None or not out.is_cuda or cache_rows.device != out.device
            or None in layouts or layouts[0][1] != layouts[1][1] or cache_rows.dtype != out.dtype
            or requests == 0 or block_table.shape[1] == 0
            or block_table.stride(1) != 1 or not seq_lens.is_contiguous()):
        return False
    (cache_stride, width), (out_stride, _) = layouts  # equal widths: checked above
    align = size * interleave
    lens = seq_lens.to(torch.int64)
    ends = torch.cumsum((lens + align - 1) // align * align, 0)
    n_rows = out.shape[0] // size
    block_r, block_c = 16, min(1024, max(16, triton.next_power_of_2(width)))
    with torch.cuda.device(out.device):
        _own_rows_kernel[(triton.cdiv(n_rows, block_r),)](
            cache_rows, block_table, lens, ends, out, n_rows, requests, requests.bit_length(),
            width, cache_stride, out_stride, block_table.stride(0), block_table.shape[1],
            per_block, block_size, size, rank, interleave, BLOCK_R=block_r, BLOCK_C=block_c)
    return True
