"""A routed-expert MoE computed from expert slots through an expert→slot map, in torch.

The expert lane's own compute where vLLM's fused-MoE kernels are not in play (CPU, tests, the
float64 reference's peer): the same contract as vLLM's ``fused_experts`` with an
``expert_map``, where a token's choice of an expert mapped to -1 contributes nothing.
"""

from __future__ import annotations

import torch


def moe_from_slots(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_map: torch.Tensor) -> torch.Tensor:
    """``sum_j weight_j * w2[s_j] @ (silu(gate) * up)(w13[s_j] @ x)`` over the choices whose
    expert maps to a slot ``s_j = expert_map[id_j] >= 0``; ``w13`` [slots, 2I, H] and ``w2``
    [slots, H, I] as vLLM lays them out. No host sync: every choice is computed, masked ones
    against slot 0 and then dropped (a poisoned slot 0 cannot leak into them)."""
    slot = expert_map[topk_ids.long()]  # [tokens, top_k]
    keep = slot >= 0
    slot = slot.clamp(min=0)
    inter = w2.shape[2]
    h = torch.einsum("tkoh,th->tko", w13[slot].to(hidden.dtype), hidden)
    a = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("tkhi,tki->tkh", w2[slot].to(hidden.dtype), a)
    y = torch.where(keep[..., None], y * topk_weights.to(hidden.dtype)[..., None], 0)
    return y.sum(1)
