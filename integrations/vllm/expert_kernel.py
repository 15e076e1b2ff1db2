"""The expert lane's MoE through vLLM's own fused-MoE kernel, bit for bit the resident layer's.

Note [Same bits as resident]
    The lane computes a layer's routed experts with vLLM's Triton MoE (``FusedMoEKernel.apply``,
    the call the resident layer makes), but over other weights: the cache's slots (a few
    experts, an ``expert_map`` naming the step's), the host store read in place, or one of the
    layer ring's buffers (every expert, Note [Expert layer ring]). Two things would make its
    output differ from the resident layer's by rounding:

    1. **Tiles.** The kernel picks its tile configuration from the shape of the weights it is
       given (``try_get_optimal_moe_config``: the expert count and the intermediate size name a
       tuned file; the token count picks a row of it). Slots of 32 experts pick another
       configuration than the layer's 128, and a different ``BLOCK_SIZE_K`` sums the dot
       products in another order. The lane looks the configuration up for the layer's own
       shape and runs every call under vLLM's ``override_config``, so each (token, choice)
       row is computed with the resident layer's tiles.
    2. **One sum.** The kernel ends by summing each token's ``top_k`` rows (``moe_sum``, in the
       hidden dtype). A step of several passes computes each row in exactly one pass; summing
       per pass and adding the passes would round twice. The lane runs the kernel through a
       shallow copy of vLLM's experts object whose ``moe_sum`` keeps each pass's rows (a
       select by the pass's mask: exact) and sums them once, after the last pass, with vLLM's
       own ``moe_sum``. vLLM's objects are not changed.

    3. **Rows.** Without an ``expert_map`` and with few tokens (``tokens * top_k * 4 <=
       experts``, a decode step) the kernel gives each (token, choice) a block of its own (a
       "naive" assignment); with a map it sorts them into blocks per expert. A step served in
       one pass (every choice in a slot) therefore names the slots as its choices and passes
       no map, with the layer's expert count as ``global_num_experts``: the kernel takes the
       resident layer's path. Steps of several passes need the map; their rows are computed
       with the same tiles and the same K order, which is all a row's value depends on.

    A ring buffer holds the whole layer in its layout, so that call is the resident call on
    other memory. tests/vllm_engine/test_cuda_vllm_experts.py compares tokens and logprobs
    with all-resident vLLM for equality on the H200, decode steps and passes included.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from ringflow.errors import KernelError


class ResidentKernel:
    """vLLM's MoE kernel of one layer (``experts``: its ``RoutedExperts``), called as the
    resident layer would be, over the weights the lane hands it (Note [Same bits as
    resident]). ``shapes`` are the layer's own ``w13`` and ``w2`` shapes (every expert)."""

    def __init__(self, experts, shapes: tuple[torch.Size, torch.Size]) -> None:
        self.experts = experts
        self.w13_shape, self.w2_shape = shapes
        self._kernel = None  # the vLLM kernel the copies below were made from
        self._summing = None  # a copy of its modular impl whose experts keep rows (moe_sum)
        self._acc: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._last = False

    def _impl(self):
        kernel = self.experts.quant_method.moe_kernel
        if kernel is not self._kernel:  # first call, or vLLM made a new kernel (a reload)
            impl = copy.copy(kernel.impl)
            experts = copy.copy(impl.fused_experts)
            original = type(experts).moe_sum
            experts.moe_sum = lambda rows, output, *args, **kwargs: self._keep(
                original, experts, rows, output)
            impl.fused_experts = experts
            self._kernel, self._summing = kernel, impl
        return self._summing

    def config(self, tokens: int, dtype: torch.dtype) -> dict:
        """The tiles vLLM gives the resident layer for a step of ``tokens`` tokens."""
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
        fused = self._impl().fused_experts
        return try_get_optimal_moe_config(self.w13_shape, self.w2_shape, self.experts.top_k,
                                          fused.quant_config.config_name(dtype), tokens,
                                          block_shape=fused.block_shape)

    def __call__(self, x: torch.Tensor, weights: Mapping[str, torch.Tensor],
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None, last: bool = True) -> torch.Tensor | None:
        """One pass (the lane's ``Compute``, Note [Expert lane modes]): the rows of the choices
        ``expert_map`` names, with ``weights["w13"]``/``["w2"]`` (None: every expert at its own
        index, the resident layout); the tokens' sums when ``last`` (every earlier pass of the
        step applied), else None."""
        from vllm.model_executor.layers.fused_moe import override_config
        w13, w2 = weights["w13"], weights["w2"]
        if w13.shape[1:] != self.w13_shape[1:] or w2.shape[1:] != self.w2_shape[1:]:
            raise KernelError(f"expert weights {tuple(w13.shape)}/{tuple(w2.shape)} do not "
                              f"match the layer's {tuple(self.w13_shape)}/{tuple(self.w2_shape)}")
        impl = self._impl()
        if last and self._acc is None and expert_map is not None:
            # the step's only pass: every choice is in a slot. Name the slots as the choices
            # and pass no map, so the kernel assigns rows as it does for the resident layer
            topk_ids = expert_map[topk_ids.long()].to(topk_ids.dtype)
            expert_map = None
        self._last = last
        self._mask = (None if expert_map is None else
                      expert_map[topk_ids.long().clamp(min=0)] >= 0)
        try:
            with override_config(self.config(x.shape[0], x.dtype)):
                out = impl.apply(hidden_states=x, w1=w13, w2=w2, topk_weights=topk_weights,
                                 topk_ids=topk_ids, activation=self.experts.activation,
                                 global_num_experts=self.experts.global_num_experts,
                                 expert_map=(None if expert_map is None
                                             else expert_map.to(torch.int32)),
                                 apply_router_weight_on_input=False)
        finally:
            self._mask = None
        if not last:
            return None
        self._acc = None
        return out

    def _keep(self, original, experts, rows: torch.Tensor, output: torch.Tensor) -> None:
        """In place of the kernel's ``moe_sum``: keep this pass's rows [tokens, top_k, hidden]
        (those its map names; the others are zeros or never written), sum after the last."""
        if self._mask is None:
            kept = rows
        elif self._acc is None:
            kept = torch.where(self._mask.unsqueeze(-1), rows, 0)
        else:
            kept = torch.where(self._mask.unsqueeze(-1), rows, self._acc)
        if not self._last:
            self._acc = kept if kept is not rows else rows.clone()  # rows live in a workspace
            return
        original(experts, kept, output)
