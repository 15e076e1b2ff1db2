"""CPU references of the gather kernels: plain loops that tests compare the kernels against.

For tests (and ``SyntheticWorkload.reference_float64``, which tests call): the runtime never
imports it; verification mode computes what a slot must hold in its own form
(``integrations/torch/verification.py``).
"""

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


def page_gather_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int, capacity: int) -> torch.Tensor:
    cache, block_table = cache.cpu(), block_table.cpu()
    out = torch.zeros((capacity, *cache.shape[1:]), dtype=cache.dtype)
    row = 0
    for r, n in enumerate(seq_lens.tolist()):
        for j in range(-(-n // block_size)):
            out[row] = cache[block_table[r, j]]
            row += 1
    return out


def dcp_owner(t: int, size: int, interleave: int) -> tuple[int, int]:
    """(rank, local position) of token ``t`` under DCP (Note [DCP layout] in kv_gathers)."""
    return (t // interleave) % size, (t // (interleave * size)) * interleave + t % interleave


def dcp_shard_ref(full: list[torch.Tensor], size: int, interleave: int, block_size: int,
                  blocks_per_request: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split per-request full KV rows into each rank's (paged cache, block table).

    Each rank's block table is a different permutation, so a kernel that ignores it fails.
    """
    requests = len(full)
    shards = []
    for rank in range(size):
        blocks = requests * blocks_per_request + 1
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(rank))
        table = perm[: requests * blocks_per_request].view(requests, blocks_per_request)
        cache = torch.full((blocks, block_size, *full[0].shape[1:]), float("nan"),
                           dtype=full[0].dtype)
        for r, rows in enumerate(full):
            for t in range(rows.shape[0]):
                owner, p = dcp_owner(t, size, interleave)
                if owner == rank:
                    cache[table[r, p // block_size], p % block_size] = rows[t]
        shards.append((cache, table))
    return shards


def dcp_all_gather_ref(shards, seq_lens: list[int], size: int, interleave: int,
                       capacity: int) -> torch.Tensor:
    """A DCP slot from the ranks' caches, by plain loops: each request's tokens in order from
    the next multiple of ``size * interleave`` rows, zeros elsewhere."""
    first = shards[0][0]
    out = torch.zeros((capacity, *first.shape[2:]), dtype=first.dtype)
    start, align = 0, size * interleave
    for r, n in enumerate(seq_lens):
        for t in range(n):
            owner, p = dcp_owner(t, size, interleave)
            cache, table = shards[owner]
            block_size = cache.shape[1]
            out[start + t] = cache[table[r, p // block_size], p % block_size]
        start += -(-n // align) * align
    return out


def moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """A routed-expert MoE in float64, one token and expert at a time: ``w13`` [experts, 2I, H]
    (gate rows, then up rows, as vLLM lays them out), ``w2`` [experts, H, I], SiLU-gated."""
    x, w13, w2 = hidden.cpu().double(), w13.cpu().double(), w2.cpu().double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            h = w13[e] @ x[t]
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def moe_rows_as_kernel(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w13_scale: torch.Tensor | None = None,
                       w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each (token, choice) row of a MoE [tokens, top_k, H], rounded where vLLM's kernels
    round (Note [Host rows round as the kernel] in kernels/host_moe.py), with every GEMM's
    sum taken in float64 (so exactly rounded, where a GPU's float32 sums may land on the
    other side of a boundary). bf16 weights: in their dtype. fp8 weights with 128x128 block
    scales ([experts, n/b, k/b]): in ``hidden``'s dtype, each GEMM's input quantized per
    row and group of ``b`` columns as ``per_token_group_quant_fp8`` does (float32 scale: the
    group's largest magnitude, at least 1e-10, over 448), and each block's products of fp8
    values summed, then times both scales, as the Triton kernel does; with 128x128 blocks the
    activation is float32 into its quantization (``silu_and_mul_per_block_quant``, smallest
    scale 1 / (448 * 512)), as vLLM's fused kernel computes it."""
    blocks = w13_scale is not None
    dtype, inter = (hidden.dtype if blocks else w13.dtype), w2.shape[2]
    out = torch.empty(*topk_ids.shape, hidden.shape[1], dtype=dtype)
    fused = blocks and (-(-w13.shape[2] // w13_scale.shape[2]) == 128  # block_shape [128, 128]
                        == -(-inter // w2_scale.shape[2])
                        == -(-w13.shape[1] // w13_scale.shape[1]))

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
             fused: bool = False) -> torch.Tensor:
        if scale is None:
            return w.double() @ x.double()
        n, k = w.shape
        bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
        acc = torch.zeros(n, dtype=torch.float64)
        for kb in range(scale.shape[1]):
            cols = slice(kb * bk, (kb + 1) * bk)
            part = x[cols].float()
            if fused:  # silu_and_mul_per_block_quant's smallest scale
                s_a = torch.clamp(part.abs().max() / 448.0, min=1.0 / (448.0 * 512.0))
            else:
                s_a = torch.clamp(part.abs().max(), min=1e-10) / 448.0
            q_a = torch.clamp(part / s_a, -448.0, 448.0).to(torch.float8_e4m3fn).double()
            dots = w[:, cols].double() @ q_a  # fp8 values: exact products
            s_w = scale[:, kb].double().repeat_interleave(bn)[:n]
            acc += dots * s_a.double() * s_w
        return acc

    for t in range(hidden.shape[0]):
        for j, (w, e) in enumerate(zip(topk_weights[t].tolist(), topk_ids[t].tolist())):
            x = hidden[t].to(dtype)
            h = gemm(x, w13[e], w13_scale[e] if blocks else None).to(dtype)
            if fused:  # SiLU, product and quantization in one float32 kernel
                gate = h[:inter].float()
                act = gate * (1.0 / (1.0 + torch.exp(-gate))) * h[inter:].float()
            else:
                act = torch.nn.functional.silu(h[:inter].float()).to(dtype) * h[inter:]
            acc = gemm(act, w2[e], w2_scale[e] if blocks else None, fused).float()
            out[t, j] = acc * torch.tensor(w, dtype=torch.float32)
    return out
