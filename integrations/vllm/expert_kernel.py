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

    3. **Rows.** A choice of -1 stays -1 and is skipped, as the resident kernel skips it.
       Without an ``expert_map`` and with few tokens (``tokens * top_k * 4 <= experts``, a
       decode step) the kernel gives each (token, choice) a block of its own (a
       "naive" assignment); with a map it sorts them into blocks per expert. A step served in
       one pass (every choice in a slot) therefore names the slots as its choices and passes
       no map, with the layer's expert count as ``global_num_experts``: the kernel takes the
       resident layer's path. Steps of several passes need the map; their rows are computed
       with the same tiles and the same K order, which is all a row's value depends on.

    4. **More rows than experts.** An expert arena's large step (Note [Large steps stream
       through the slots]) maps a layer's experts onto rows of an arena of up to several
       layers' worth. Named as choices, rows past the layer's expert count break vLLM
       0.26's sort of the choices into blocks, which counts ``global_num_experts`` buckets
       (later vLLMs count the weights' rows): on the H100, every long prompt of an arena of
       256 or 384 rows diverged at its first or second token, while arenas of 128 rows were
       bit for bit. Such a pass keeps the map: the kernel sorts the choices by expert as the
       resident call does and reads each block's expert at the row the map names.

    5. **Rows the map leaves out.** With a map the kernel gives each block of choices of an
       expert the map leaves out (-1) a row of zeros (vLLM's ``write_zeros_to_output``, the
       path expert parallelism takes for other ranks' experts). A pass of several keeps only
       its map's rows (a select by mask), as the zeros are not the other passes' rows; a
       step's only pass keeps the kernel's rows as they are, the select would change no bit.
       A choice of -1 under a map is vLLM's kernel's as well (vLLM's routers give none).

    A ring buffer holds the whole layer in its layout, so that call is the resident call on
    other memory. tests/vllm_engine/test_cuda_vllm_experts.py compares tokens and logprobs
    with all-resident vLLM for equality on the H200, decode steps and passes included.

Note [fp8 experts]
    vLLM's fp8 MoE (``Fp8MoEMethod`` for fp8 checkpoints, per tensor or in 128x128 blocks as
    DeepSeek-V3's and Qwen3's FP8 releases; ``Fp8PerTensorOnlineMoEMethod`` and its block
    sibling for a bf16 checkpoint quantized at load) keeps, beside each expert's fp8 weights,
    its weight scales: one per expert (``[experts]``, per tensor) or one per 128x128 block
    (``[experts, n/128, k/128]``). vLLM's Triton kernel reads an expert's scales at the index it
    reads its weights, from the ``w1_scale``/``w2_scale`` of its quantization config. So the
    lane moves the scales with the weights (``w13_scale``/``w2_scale`` beside ``w13``/``w2``
    in the host store, the slots and the ring's buffers: a few KiB per expert) and each pass
    runs the kernel through a copy of its quantization config whose scales are that pass's.
    The activations are quantized by the kernel as for the resident layer (dynamically, or by
    the layer's static scales). Two cases are bit for bit the resident layer's and one is not:

    * blocks (weights 128x128, activations per token and 128 columns): every quantity a row
      depends on is the row's own, so passes change nothing;
    * per tensor, a step of one pass (decode steps whose experts fit the slots, ring steps):
      the same call on other memory;
    * per tensor with dynamic activation scales: vLLM scales the intermediate activations of
      all of a step's rows by one scale (their largest value), so a pass that saw only its
      rows would round them otherwise (a top-5 logprob gap of 0.5 on the H200 test model).
      A step whose experts do not fit the slots is therefore computed in one pass straight
      from the host store (Note [Expert cache], step 6: the resident call on host memory).
      That is bit for bit in eager steps. Under vLLM's CUDA graphs (FULL_AND_PIECEWISE) the
      per-tensor lane gave a top-5 logprob gap of 0.47-0.59 on the H200 test model, even
      where every step is that one resident call. The cause is vLLM's, not the lane's: a
      replayed graph pads the step to a captured size, the padded rows hold whatever the
      graph's memory held, and that one scale is their largest value too. So all-resident
      vLLM's own bits there depend on what ran before: the same engine with the prompts in
      the other order gives a gap of 0.32 (2 of 4 sequences diverged) under its graphs and
      none in eager mode; and with graphs captured at batch 1 only (a batch-1 decode step
      pads no row) the lane is bit for bit all-resident under graphs (H200, at 72829bc,
      ``test_per_tensor_fp8_differs_under_graphs_only_through_padded_rows``). The lane's own
      memory moves what the padded rows hold; the block format scales each row by its own
      values, so padding changes nothing there, and it is exact.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

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
        self._configs: dict[tuple, object] = {}  # per set of scale tensors: a config over them
        self._acc: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._last = False
        self._host_rows: Callable[[], torch.Tensor] | None = None

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
            self._configs.clear()
        return self._summing

    def _scaled(self, weights: Mapping[str, torch.Tensor]):
        """vLLM's quantization config of this layer with the scales ``weights`` holds (Note
        [fp8 experts]); the layer's own for unquantized experts."""
        base = self._kernel.impl.fused_experts.quant_config
        if "w13_scale" not in weights:
            return base
        w1, w2 = weights["w13_scale"], weights["w2_scale"]
        key = (w1.data_ptr(), w2.data_ptr(), w1.shape[0])
        config = self._configs.get(key)
        if config is None:  # one per scale store: the host's, the slots', each ring buffer's
            config = copy.copy(base)
            for field, scale, layer in (("_w1", w1, base.w1_scale), ("_w2", w2, base.w2_scale)):
                desc = copy.copy(getattr(base, field))
                desc.scale = scale.view(scale.shape[0], *layer.shape[1:])
                setattr(config, field, desc)
            self._configs[key] = config
        return config

    def config(self, tokens: int, dtype: torch.dtype) -> dict:
        """The tiles vLLM gives the resident layer for a step of ``tokens`` tokens."""
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
        fused = self._impl().fused_experts
        return try_get_optimal_moe_config(self.w13_shape, self.w2_shape, self.experts.top_k,
                                          fused.quant_config.config_name(dtype), tokens,
                                          block_shape=fused.block_shape)

    def __call__(self, x: torch.Tensor, weights: Mapping[str, torch.Tensor],
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None, last: bool = True,
                 host_rows: Callable[[], torch.Tensor] | None = None
                 ) -> torch.Tensor | None:
        """One pass (the lane's ``Compute``, Note [Expert lane modes]): the rows of the choices
        ``expert_map`` names, with ``weights["w13"]``/``["w2"]`` (None: every expert at its own
        index, the resident layout); the tokens' sums when ``last`` (every earlier pass of the
        step applied), else None. ``host_rows``: some chosen experts are the host's (Note [Host
        experts], a step of one pass): the map stays, so the kernel skips their choices
        through it (without a map a choice of -1 is skipped only in the kernel's small-step
        row assignment), and at the sum the host's rows take their choices' places among the
        kernel's, summed once with them by vLLM's ``moe_sum``."""
        from vllm.model_executor.layers.fused_moe import override_config
        w13, w2 = weights["w13"], weights["w2"]
        if w13.shape[1:] != self.w13_shape[1:] or w2.shape[1:] != self.w2_shape[1:]:
            raise KernelError(f"expert weights {tuple(w13.shape)}/{tuple(w2.shape)} do not "
                              f"match the layer's {tuple(self.w13_shape)}/{tuple(self.w2_shape)}")
        if host_rows is not None and (expert_map is None or not last or self._acc is not None):
            raise KernelError("the host's rows join a step of one pass over the slots (Note "
                              "[Host experts]); this step has no map or more passes")
        impl = self._impl()
        impl.fused_experts.quant_config = self._scaled(weights)
        if (last and self._acc is None and expert_map is not None and host_rows is None
                and w13.shape[0] <= self.w13_shape[0]):
            # the step's only pass: every choice is in a slot. Name the slots as the choices
            # and pass no map, so the kernel assigns rows as it does for the resident layer
            # (not over more rows than the layer has experts: rule 4 of the Note)
            # a choice of -1 stays -1, as the resident kernel skips it: indexing the map with
            # -1 would read the last expert's slot
            chosen = topk_ids.long()
            topk_ids = torch.where(chosen >= 0, expert_map[chosen.clamp(min=0)], -1).to(
                topk_ids.dtype)
            expert_map = None
        self._last, self._host_rows = last, host_rows
        # a step's only pass keeps every row the kernel gives: a choice the map leaves out
        # (an expert of no row) is a row of zeros the kernel writes (rule 5 of the Note); a
        # select over [tokens, top_k, hidden] cost an arena's 8k-token layer 0.35 ms
        only = last and self._acc is None and host_rows is None
        self._mask = (None if expert_map is None or only else
                      (topk_ids >= 0) & (expert_map[topk_ids.long().clamp(min=0)] >= 0))
        try:
            with override_config(self.config(x.shape[0], x.dtype)):
                out = impl.apply(hidden_states=x, w1=w13, w2=w2, topk_weights=topk_weights,
                                 topk_ids=topk_ids, activation=self.experts.activation,
                                 global_num_experts=self.experts.global_num_experts,
                                 expert_map=(None if expert_map is None
                                             else expert_map.to(torch.int32)),
                                 apply_router_weight_on_input=False)
        finally:
            self._mask = self._host_rows = None
        if not last:
            return None
        self._acc = None
        return out

    def _keep(self, original, experts, rows: torch.Tensor, output: torch.Tensor) -> None:
        """In place of the kernel's ``moe_sum``: keep this pass's rows [tokens, top_k, hidden]
        (those its map names; the others are zeros or never written), sum after the last."""
        if self._mask is None:
            kept = rows
        elif self._acc is None:  # the host's rows, where it has them, are the other choices'
            kept = torch.where(self._mask.unsqueeze(-1), rows,
                               0 if self._host_rows is None else self._host_rows())
        else:
            kept = torch.where(self._mask.unsqueeze(-1), rows, self._acc)
        if not self._last:
            self._acc = kept if kept is not rows else rows.clone()  # rows live in a workspace
            return
        original(experts, kept, output)
