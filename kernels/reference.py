"""CPU references of the gather kernels: plain loops that tests compare the kernels against."""

from __future__ import annotations

import torch


def copy_host_to_device_ref(src: torch.Tensor, out_shape, dtype) -> torch.Tensor:
    out = torch.full(tuple(out_shape), float("nan"), dtype=dtype)
    for i in range(src.shape[0]):
        out[i] = src[i].cpu()
    return out


def index_gather_ref(src: torch.Tensor, index: torch.Tensor, out_rows: int) -> torch.Tensor:
    src = src.cpu()
    out = torch.full((out_rows, *src.shape[1:]), float("nan"), dtype=src.dtype)
    for i, j in enumerate(index.tolist()):
        out[i] = src[j]
    return out


def paged_gather_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     capacity: int) -> torch.Tensor:
    cache, block_table = cache.cpu(), block_table.cpu()
    block_size = cache.shape[1]
    out = torch.zeros((capacity, *cache.shape[2:]), dtype=cache.dtype)
    row = 0
    for r, n in enumerate(seq_lens.tolist()):
        assert row + n <= capacity, "requests do not fit the slot"
        for t in range(n):
            out[row] = cache[block_table[r, t // block_size], t % block_size]
            row += 1
    return out
