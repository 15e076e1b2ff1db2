"""A routed-expert MoE computed from expert slots through an expert→slot map, in torch.

The expert lane's own compute where vLLM's fused-MoE kernels are not in play (vLLM's CPU build,
tests): the same contract as vLLM's ``fused_experts`` with an ``expert_map``, where a token's
choice of an expert mapped to -1 (or a choice of -1) contributes nothing.
"""

from __future__ import annotations

import torch


def moe_from_slots(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_map: torch.Tensor) -> torch.Tensor:
    """``sum_j weight_j * w2[s_j] @ (silu(gate) * up)(w13[s_j] @ x)`` over the choices whose
    expert maps to a slot ``s_j = expert_map[id_j] >= 0``; ``w13`` [slots, 2I, H] and ``w2``
    [slots, H, I] as vLLM lays them out. Returned in float32 (the router's weights and the sum
    over choices and passes keep it; the caller casts once).

    One slot at a time over every token, each token's weight for that slot zero where it did
    not choose it: no expert is copied per token, nothing host-syncs (a captured step replays
    any routing), and a poisoned slot no token chose cannot leak (its rows are dropped)."""
    ids = topk_ids.long()
    slot = torch.where(ids >= 0, expert_map[ids.clamp(min=0)], -1)  # [tokens, top_k]
    weights = topk_weights.float()
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for s in range(w13.shape[0]):
        chose = slot == s
        weight = torch.where(chose, weights, 0).sum(1, keepdim=True)  # [tokens, 1]
        h = hidden @ w13[s].to(hidden.dtype).T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[s].to(hidden.dtype).T
        out += torch.where(chose.any(1, keepdim=True), y.float() * weight, 0)
    return out
