"""A DCP group's data for tests and benchmarks: every request's full KV, and each rank's shard of
it in a paged cache (vLLM's interleave of 1: token t of a request lives on rank t % world)."""

from __future__ import annotations

import torch

from ringflow.units import ceil_div

#: bf16 elements per token (MLA: kv_lora_rank 512 + rope 64) and tokens per cache block
ROW, BLOCK = 576, 64


def full_kv(batch: int, context: int, seed: int, device) -> torch.Tensor:
    """``batch`` requests of ``context`` tokens of MLA-shaped KV (``ROW`` bf16 per token), seeded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch * context, ROW, generator=gen, device=device).to(torch.bfloat16)


def shard(full: torch.Tensor, batch: int, context: int, rank: int, world: int):
    """This rank's paged cache and block table: token t of a request lives on rank t % world."""
    local = ceil_div(context, world)
    blocks_per = ceil_div(local, BLOCK)
    cache = torch.zeros(batch * blocks_per, BLOCK, ROW, dtype=full.dtype, device=full.device)
    table = torch.arange(batch * blocks_per, device=full.device, dtype=torch.int32)
    table = table.view(batch, blocks_per).flip(1).contiguous()  # not the identity map
    for r in range(batch):
        mine = full[r * context:(r + 1) * context][rank::world]
        pos = torch.arange(mine.shape[0], device=full.device)
        block = table[r].to(torch.int64)[pos // BLOCK]
        cache.view(-1, ROW).index_copy_(0, block * BLOCK + pos % BLOCK, mine)
    return cache, table
