"""The host's share of a MoE layer: the chosen experts it was handed, computed on the CPU from the
host store where they lie (Note [Host split] in orchestrator/host_split.py).

Runs on a host node's worker thread (graphs/host_node.py), never on a CUDA stream: plain torch
CPU ops, which release the GIL while they compute. Each expert's rows are gathered and computed
once for all the tokens that chose it (a decode step: one or a few rows), in the weights' dtype
as the GPU kernel does (bf16 products summed in float32 by the CPU's GEMM, the activation
rounded to the dtype between the two), and the tokens' weighted rows are summed in float32.
"""

from __future__ import annotations

import torch


def expert_weight(w: torch.Tensor, e: int, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of ``w`` in ``dtype``; fp8 weights times their scale (``scale`` [experts]
    per tensor, or [experts, n/128, k/128] per 128x128 block, Note [fp8 experts])."""
    if scale is None:
        return w[e].to(dtype)
    s = scale[e].float()
    if s.dim() == 2:  # one scale per block: spread it over the block's rows and columns
        n, k = w.shape[1:]
        s = s.repeat_interleave(-(-n // s.shape[0]), 0)[:n].repeat_interleave(
            -(-k // s.shape[1]), 1)[:, :k]
    return (w[e].float() * s).to(dtype)


def moe_on_host(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, mine: torch.Tensor,
                out: torch.Tensor, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> int:
    """Write into ``out`` [tokens, hidden] (float32) the sum over each token's choices whose
    expert ``mine`` [experts] (bool) marks of ``weight * w2[e] @ (silu(gate) * up)(w13[e] @
    x)``, zeros where a token has none; ``w13`` [experts, 2I, H] and ``w2`` [experts, H, I] as
    vLLM lays them out, fp8 ones with their scales (dequantized to bf16 here; the GPU kernel
    also quantizes the activations, so fp8 agrees within its own rounding). All on the CPU.
    Returns how many experts it computed."""
    out.zero_()
    inter = w2.shape[2]
    dtype = w13.dtype if w13_scale is None else hidden.dtype
    mine_list = mine.tolist()
    rows: dict[int, list[tuple[int, int]]] = {}  # expert -> its (token, choice) pairs
    for t, choices in enumerate(topk_ids.tolist()):
        for j, e in enumerate(choices):
            if e >= 0 and mine_list[e]:
                rows.setdefault(e, []).append((t, j))
    if not rows:
        return 0
    weights = topk_weights.tolist()
    linear, silu = torch.nn.functional.linear, torch.nn.functional.silu
    for e, pairs in rows.items():
        if len(pairs) == 1:  # a decode step's usual case: one token, a view of its row
            (t, j), = pairs
            x = hidden[t:t + 1]
        else:
            x = hidden.index_select(0, torch.tensor([t for t, _ in pairs]))
        h = linear(x.to(dtype), expert_weight(w13, e, w13_scale, dtype)).float()
        y = linear((silu(h[:, :inter]) * h[:, inter:]).to(dtype),
                   expert_weight(w2, e, w2_scale, dtype)).float()
        for row, (t, j) in zip(y, pairs):
            out[t].add_(row, alpha=weights[t][j])
    return len(rows)
