"""Gather kernels: fill a leased slot from where a layer's data lives.

Each is a small function that writes into ``out`` (a slot) and launches on the current stream,
so an executor that makes a gather stream current runs it there. None of them host-syncs or
allocates outside the caching allocator, so each is safe inside a CUDA graph capture.
"""

from __future__ import annotations

import torch

from ringflow.errors import KernelError
from ringflow.kernels.row_gather import gather_rows


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 1:
        raise KernelError(f"{name} must have at least one dimension, got a scalar")
    return t


def copy_host_to_device(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` (pinned host memory) into ``out[:len(src)]`` without blocking the host.

    Raises:
        KernelError: shapes or dtypes differ, or ``src`` is pageable while ``out`` is on a GPU
            (the copy would silently become synchronous and hide nothing).
    """
    _rows("src", src)
    if src.dtype != out.dtype or src.shape[1:] != out.shape[1:] or src.shape[0] > out.shape[0]:
        raise KernelError(f"cannot copy {tuple(src.shape)} {src.dtype} into a slot of "
                          f"{tuple(out.shape)} {out.dtype}; match dtype and trailing dimensions")
    if out.is_cuda and src.device.type == "cpu" and not src.is_pinned():
        raise KernelError("host source is pageable: a copy from it blocks the host and cannot "
                          "overlap; pin it (tensor.pin_memory()) when it is created")
    dst = out if src.shape[0] == out.shape[0] else out[: src.shape[0]]
    dst.copy_(src, non_blocking=True)
    return dst


def index_gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:n] = src[index]`` along dim 0 (``n = len(index)``), on ``src``'s device.

    Raises:
        KernelError: dtypes, devices or trailing dimensions differ, or ``index`` is too long.
    """
    _rows("src", src)
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise KernelError(f"index must be a 1-D int32/int64 tensor, got {tuple(index.shape)} "
                          f"{index.dtype}")
    if src.dtype != out.dtype or src.shape[1:] != out.shape[1:]:
        raise KernelError(f"cannot gather rows of {tuple(src.shape)} {src.dtype} into a slot of "
                          f"{tuple(out.shape)} {out.dtype}")
    if index.shape[0] > out.shape[0]:
        raise KernelError(f"{index.shape[0]} rows do not fit a slot of {out.shape[0]} rows")
    if not (src.device == index.device == out.device):
        raise KernelError(f"src, index and out must share a device, got {src.device}, "
                          f"{index.device}, {out.device}")
    dst = out[: index.shape[0]]
    torch.index_select(src, 0, index, out=dst)
    return dst


def check_paged_args(cache: torch.Tensor, row_dim: int, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor) -> None:
    """What every paged gather needs: a table per request, rows that fit ``out``, one device.

    ``cache.shape[row_dim:]`` is one unit copied (a token row, or a whole page)."""
    if cache.dim() < row_dim:
        unit = "block_size, *row" if row_dim == 2 else "*page"
        raise KernelError(f"cache must be [num_blocks, {unit}], got {tuple(cache.shape)}")
    if block_table.dim() != 2 or seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise KernelError(f"block_table must be [requests, max_blocks] and seq_lens [requests], "
                          f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if cache.dtype != out.dtype or cache.shape[row_dim:] != out.shape[1:]:
        raise KernelError(f"cannot gather pages of {tuple(cache.shape)} {cache.dtype} into a "
                          f"slot of {tuple(out.shape)} {out.dtype}")
    if not (cache.device == block_table.device == seq_lens.device == out.device):
        raise KernelError("cache, block_table, seq_lens and out must share a device")


def packed_positions(units: torch.Tensor, capacity: int):
    """Requests packed one after another into ``capacity`` rows, computed on the device.

    ``units[r]`` rows belong to request r. Returns, per row: the request it belongs to, its
    index within that request, and whether it is used at all (rows past the last are not).
    """
    ends = torch.cumsum(units, 0)
    row = torch.arange(capacity, device=units.device)
    request = torch.searchsorted(ends, row, right=True)
    valid = request < units.shape[0]
    request = request.clamp_(max=max(units.shape[0] - 1, 0))
    return request, row - (ends[request] - units[request]), valid


def paged_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """Pack the paged rows of each request into ``out``, request after request, no host sync.

    Args:
        cache: ``[num_blocks, block_size, *row]`` paged storage.
        block_table: ``[requests, max_blocks]`` block ids of each request (int32/int64).
        seq_lens: ``[requests]`` tokens of each request.
        out: ``[capacity, *row]`` slot; rows past ``sum(seq_lens)`` are set to zero.

    The row index is computed on the device from ``seq_lens`` (prefix sums and a search), so
    the launch count and shapes do not depend on the lengths: capture-safe, one graph for any
    lengths that fit. The caller guarantees ``sum(seq_lens) <= capacity``; the CPU reference
    checks it.
    """
    check_paged_args(cache, 2, block_table, seq_lens, out)
    if block_table.shape[0] == 0:
        return out.zero_()
    block_size = cache.shape[1]
    lens = seq_lens.to(torch.int64)
    request, pos, valid = packed_positions(lens, out.shape[0])
    block = block_table.to(torch.int64)[request, (pos // block_size).clamp_(max=block_table.shape[1] - 1)]
    block = torch.where(valid, block, torch.zeros_like(block))
    offset = torch.where(valid, pos % block_size, torch.zeros_like(pos))
    rows, per_block = row_view(cache)
    if rows is not None:
        return gather_rows(rows, block * per_block + offset, valid, out)
    # rows that no stride pattern reaches: index in place (a temporary of out's size)
    out.copy_(cache[block, offset])
    out.masked_fill_(~valid.view(-1, *([1] * (out.dim() - 1))), 0)
    return out


def row_view(cache: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``cache`` ``[blocks, block_size, *row]`` as one row axis, without a copy.

    A block may be padded or its rows interleaved with other data (K and V planes): as long as
    a block's stride is a whole number of row strides, row ``b * per_block + t`` is token t of
    block b. Returns (None, 0) when no such view exists.
    """
    step = cache.stride(1)
    if step <= 0 or cache.stride(0) % step:
        return None, 0
    per_block = cache.stride(0) // step
    if cache.shape[0] == 0:
        return None, 0
    # up to the last block's last token only: rows past a block's tokens may reach beyond the
    # storage when other data (the other heads) sits between a block's rows
    count = (cache.shape[0] - 1) * per_block + cache.shape[1]
    rows = cache.as_strided((count, *cache.shape[2:]), (step, *cache.stride()[2:]),
                            cache.storage_offset())
    return rows, per_block
