"""One pass that gathers rows by index and zeroes the rows that are not used.

Note [One-pass row gather]
    Every full-KV gather ends in ``out[i] = src[index[i]] if valid[i] else 0``. In torch that
    is an ``index_select`` plus a ``masked_fill_``: two passes over the slot, and the
    ``index_select`` kernel moves a 1152-byte MLA row a few bytes per thread, so such SM passes
    can take longer than moving the same bytes between GPUs, and they take the SMs the
    attention needs. This Triton kernel does
    it in one pass with a tile of rows per program and wide loads along each row. It runs where
    it can (CUDA tensors, Triton importable, rows whose elements are contiguous); everywhere
    else the torch pair runs, with the same result bit for bit (a copy either way).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

if triton is not None:
    @triton.jit
    def _gather_rows_kernel(src, index, valid, out, out_index, rows, width, src_stride,
                            out_stride, SCATTER: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = r < rows
        i = tl.load(index + r, mask=in_range, other=0).to(tl.int64)
        keep = tl.load(valid + r, mask=in_range, other=0) != 0
        if SCATTER:
            o = tl.load(out_index + r, mask=in_range, other=0).to(tl.int64)
        else:
            o = r.to(tl.int64)
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cols = c < width
            x = tl.load(src + i[:, None] * src_stride + c[None, :],
                        mask=(in_range & keep)[:, None] & cols[None, :], other=0)
            tl.store(out + o[:, None] * out_stride + c[None, :], x,
                     mask=in_range[:, None] & cols[None, :])


def flat_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(row stride, row width) in elements when each row's elements are contiguous."""
    width = 1
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
        width *= size
    return t.stride(0), width


def gather_rows(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                out: torch.Tensor, out_index: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[index[i]]`` where ``valid[i]``, else zeros (Note [One-pass row gather]);
    with ``out_index``, row ``out_index[i]`` of ``out`` instead of row i (a scatter: the other
    rows are not touched).

    ``index``, ``valid`` (and ``out_index``) have one entry per row written: ``out.shape[0]``
    without ``out_index``. ``index`` is in range wherever ``valid`` is true and ``out_index``
    everywhere, without repeats (the callers compute them so; unlike ``index_select``, the
    kernel does not check). No host sync, capture-safe.
    """
    layouts = (flat_rows(src), flat_rows(out))
    rows = index.shape[0] if out_index is not None else out.shape[0]
    targets = (out_index,) if out_index is not None else ()
    if (triton is not None and out.is_cuda and src.device == out.device and None not in layouts
            and src.dtype == out.dtype and rows > 0 and index.shape == (rows,)
            and valid.shape == (rows,) and index.is_contiguous() and valid.is_contiguous()
            and all(t.shape == (rows,) and t.is_contiguous() for t in targets)):
        (src_stride, width), (out_stride, _) = layouts
        block_r, block_c = 16, min(1024, max(16, triton.next_power_of_2(width)))
        grid = (triton.cdiv(rows, block_r),)
        with torch.cuda.device(out.device):
            _gather_rows_kernel[grid](src, index, valid, out, out_index if targets else index,
                                      rows, width, src_stride, out_stride,
                                      SCATTER=bool(targets), BLOCK_R=block_r, BLOCK_C=block_c)
        return out
    if out_index is not None:
        picked = torch.index_select(src, 0, index)
        picked.masked_fill_(~valid.view(-1, *([1] * (picked.dim() - 1))), 0)
        return out.index_copy_(0, out_index, picked)
    torch.index_select(src, 0, index, out=out)
    out.masked_fill_(~valid.view(-1, *([1] * (out.dim() - 1))), 0)
    return out
