"""One pass that gathers rows by index and zeroes the rows that are not used.

Note [One-pass row gather]
    Every full-KV gather ends in ``out[i] = src[index[i]] if valid[i] else 0``. In torch that
    is an ``index_select`` plus a ``masked_fill_``: two passes over the slot, and the
    ``index_select`` kernel moves a 1152-byte MLA row a few bytes per thread. On the H200 the
    DCP gather's pack and restore passes took about 330 µs of the ~460 µs per layer at 64k
    context while the NVLink exchange itself took 124 µs: the SM passes, not the bytes between
    GPUs, set the gather's time and steal the SMs the attention needs. This Triton kernel does
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
    def _gather_rows_kernel(src, index, valid, out, rows, width, src_stride, out_stride,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = r < rows
        i = tl.load(index + r, mask=in_range, other=0).to(tl.int64)
        keep = tl.load(valid + r, mask=in_range, other=0) != 0
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cols = c < width
            x = tl.load(src + i[:, None] * src_stride + c[None, :],
                        mask=(in_range & keep)[:, None] & cols[None, :], other=0)
            tl.store(out + r.to(tl.int64)[:, None] * out_stride + c[None, :], x,
                     mask=in_range[:, None] & cols[None, :])


def _flat_rows(t: torch.Tensor) -> tuple[int, int] | None:
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
                out: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[index[i]]`` where ``valid[i]``, else zeros (Note [One-pass row gather]).

    ``index`` and ``valid`` have ``out.shape[0]`` entries; ``index`` is in range wherever
    ``valid`` is true (the callers compute it so; unlike ``index_select``, the kernel does not
    check). No host sync, capture-safe.
    """
    layouts = (_flat_rows(src), _flat_rows(out))
    rows = out.shape[0]
    if (triton is not None and out.is_cuda and src.device == out.device and None not in layouts
            and src.dtype == out.dtype and rows > 0 and index.shape == (rows,)
            and valid.shape == (rows,) and index.is_contiguous() and valid.is_contiguous()):
        (src_stride, width), (out_stride, _) = layouts
        block_r, block_c = 16, min(1024, max(16, triton.next_power_of_2(width)))
        grid = (triton.cdiv(rows, block_r),)
        with torch.cuda.device(out.device):
            _gather_rows_kernel[grid](src, index, valid, out, rows, width, src_stride,
                                      out_stride, BLOCK_R=block_r, BLOCK_C=block_c)
        return out
    torch.index_select(src, 0, index, out=out)
    out.masked_fill_(~valid.view(-1, *([1] * (out.dim() - 1))), 0)
    return out
