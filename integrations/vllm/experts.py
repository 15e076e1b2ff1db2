"""Routed experts from host memory in vLLM's MoE layers: the profile's ``experts`` section.

Note [Experts in vLLM]
    vLLM's MoE layer (``FusedMoE``, a runner) routes the tokens and hands ``topk_ids`` (global
    expert ids) to its ``RoutedExperts`` module's ``forward_modular``, which runs the quant
    method's kernel over all of the layer's experts. For each chosen layer ringflow:

    1. keeps a host copy of the layer's routed experts, taken while vLLM loads the model, just
       before the quant method processes them (``process_weights_after_loading``: vLLM-CPU
       repacks them there into its grouped-GEMM layout, which no cache slot could hold); a
       reload passes there again, and the host copy takes the new weights and the cache
       forgets every slot;
    2. builds an :class:`~ringflow.integrations.torch.expert_cache.ExpertCache` over that copy;
    3. replaces the layer's ``forward_modular`` (on that object only): the cache installs the
       experts the router chose that are not cached, and the experts are computed from the
       slots, pass by pass (Note [Expert cache]), summed into the layer's routed output. The
       runner's shared experts, routed scaling and reductions are untouched.

    Today the compute is ringflow's torch MoE (``kernels/moe.py``), and the lane runs on vLLM's
    CPU build. On a GPU it stops at start-up with one line: there the experts must stay out
    of device memory while vLLM loads (its UVA offloader's place) and be computed by vLLM's
    fused-MoE kernel with an ``expert_map`` over the slots, which is issue #39's next step.
    Layers whose experts need more than the SiLU-gated MoE this computes (biases, shared
    experts handed to the kernel, router weights applied on the input, quantized experts,
    expert parallelism) are refused by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

import torch

from ringflow.errors import ProfileError, UnsupportedModelError
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.vllm.state import PluginState
from ringflow.kernels.moe import moe_from_slots
from ringflow.orchestrator.profile import Profile
from ringflow.orchestrator.sections import resolve_layers
from ringflow.units import mib

log = logging.getLogger("ringflow")

# host copies of the routed experts taken during the current model load (None: not taking)
_snapshots: contextvars.ContextVar[dict[int, dict[str, torch.Tensor]] | None] = \
    contextvars.ContextVar("ringflow_expert_snapshots", default=None)


@contextlib.contextmanager
def taking_host_copies(on: bool) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """While vLLM loads the model: every MoE layer's raw routed experts, by ``id(layer)``."""
    copies: dict[int, dict[str, torch.Tensor]] = {}
    token = _snapshots.set(copies if on else None)
    try:
        yield copies
    finally:
        _snapshots.reset(token)


def before_processing(state: PluginState, original, method, layer, *args, **kwargs):
    """The hook on the unquantized MoE method's ``process_weights_after_loading``: copy the
    layer's routed experts to host memory as loaded, then let vLLM process them."""
    cache = getattr(layer, "_ringflow_expert_cache", None)
    if cache is not None:  # a weight write (reload_weights): the host copies take it
        for name, host in cache.host.items():
            host.copy_(getattr(layer, f"{name}_weight").detach())
        cache.forget()
        log.info("experts: %s's host copies hold the new weights; its cached experts are "
                 "dropped and fetched again as steps need them", layer.layer_name)
    copies = _snapshots.get()
    if copies is not None:
        pin = torch.cuda.is_available()
        copies[id(layer)] = {name: _host(getattr(layer, f"{name}_weight"), pin)
                             for name in ("w13", "w2")}
    return original(method, layer, *args, **kwargs)


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = t.detach().to("cpu", copy=True).contiguous()
    return host.pin_memory() if pin else host


def moe_runners_of(decoder_layer) -> list:
    """The MoE runners of one decoder layer (vLLM's ``FusedMoE`` builds one per MoE layer,
    holding its ``RoutedExperts`` as ``routed_experts``)."""
    return [m for m in decoder_layer.modules()
            if type(getattr(m, "routed_experts", None)).__name__ == "RoutedExperts"]


def enable(state: PluginState, profile: Profile, decoder: list, copies: dict) -> dict[int, ExpertCache]:
    """Attach a cache to each chosen layer's routed experts (Note [Experts in vLLM]).

    Raises:
        ProfileError: a chosen layer has no routed experts.
        UnsupportedModelError: this device, or a layer's experts this lane cannot compute.
    """
    spec = profile.experts
    chosen = resolve_layers("experts.layers", spec.layers, len(decoder), profile.source)
    found = {i: moe_runners_of(decoder[i]) for i in chosen}
    if spec.layers == "all":
        found = {i: m for i, m in found.items() if m}
    empty = sorted(i for i, m in found.items() if not m)
    if empty or not found:
        raise ProfileError("experts.layers", f"decoder layers {empty or chosen} have no routed "
                           f"experts (no MoE); list MoE layers, or 'all'", profile.source)
    caches: dict[int, ExpertCache] = {}
    for i, (runner,) in sorted(found.items()):
        experts = runner.routed_experts
        check_layer(i, runner, experts)
        host = copies.get(id(experts))
        if host is None:
            raise UnsupportedModelError(f"experts: layer {i}'s routed experts were not seen "
                                        f"while vLLM loaded the model (their quant method is "
                                        f"{type(experts.quant_method).__name__}, not "
                                        f"vLLM's unquantized one)")
        cache = ExpertCache(host, spec.slots_for(experts.global_num_experts, experts.top_k),
                            experts.w13_weight.device)
        _attach(experts, cache)
        caches[i] = cache
    first = next(iter(caches.values()))
    log.info("experts: layers %s: %d routed experts each, %d kept on the device per layer "
             "(%s), host copies %s; each step brings in only the experts its router chose "
             "that are not kept", sorted(caches), first.experts, first.slots,
             mib(sum(c.bytes for c in caches.values())),
             mib(sum(t.numel() * t.element_size() for c in caches.values()
                     for t in c.host.values())))
    return caches


def check_layer(index: int, runner, experts) -> None:
    """Raise ``UnsupportedModelError`` naming every reason this lane cannot compute layer
    ``index``'s routed experts exactly (Note [Experts in vLLM])."""
    why = []
    if getattr(runner, "shared_experts", None) is not None:
        why.append("it has shared experts, which vLLM's MoE kernel computes beside the routed "
                   "ones")
    if torch.cuda.is_available() and experts.w13_weight.is_cuda:
        why.append("it runs on vLLM-CPU only so far: on a GPU the experts must stay out of "
                   "device memory while vLLM loads, and vLLM's fused-MoE kernel must compute "
                   "from the slots (issue #39)")
    activation = getattr(experts, "activation", None)
    name = str(getattr(activation, "name", activation)).lower()
    if name != "silu":  # SiLU-gated (gate * up); not silu_no_mul, gelu, swigluoai...
        why.append(f"its activation is {name}, not SiLU-gated")
    config = getattr(experts, "moe_config", None)
    clamps = {k: getattr(config, k, None) for k in ("swiglu_limit", "swiglu_alpha",
                                                      "swiglu_beta")}
    clamps.update({k: getattr(experts, k, None) for k in clamps if getattr(experts, k, None)
                   is not None})
    if any(v is not None for v in clamps.values()):
        why.append(f"its SwiGLU is clamped or scaled ({clamps})")
    if getattr(experts.quant_method, "is_monolithic", False):
        why.append("its MoE kernel routes by itself (monolithic): forward_modular never runs")
    if getattr(experts, "w13_bias", None) is not None or getattr(experts, "w2_bias", None) is not None:
        why.append("its experts have biases")
    if getattr(experts, "apply_router_weight_on_input", False):
        why.append("it applies router weights on the input")
    if experts.global_num_experts != experts.local_num_experts:
        why.append("its experts are split over ranks (expert parallelism)")
    if type(experts.quant_method).__name__ != "UnquantizedFusedMoEMethod":
        why.append(f"its experts are quantized ({type(experts.quant_method).__name__})")
    if why:
        raise UnsupportedModelError(f"experts: layer {index} ({experts.layer_name}) cannot take "
                                    f"its routed experts from host memory: {'; '.join(why)}. "
                                    f"Drop it from experts.layers")


def _attach(experts, cache: ExpertCache) -> None:
    """Replace this object's ``forward_modular`` by the cache's passes (Note [Experts in
    vLLM])."""

    @torch.compiler.disable  # state tensors change in place each step: run it as Python
    def forward_modular(x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        if shared_experts is not None:  # enable() refused such layers: vLLM changed
            raise UnsupportedModelError(f"experts: {experts.layer_name} hands shared experts to "
                                        f"its MoE kernel; drop this layer from experts.layers")
        out = None
        for expert_map in cache.serve(topk_ids):
            part = moe_from_slots(x, cache.weights["w13"], cache.weights["w2"], topk_weights,
                                  topk_ids, expert_map)
            out = part if out is None else out.add_(part)
        return out.to(x.dtype)

    experts.forward_modular = forward_modular
    experts._ringflow_expert_cache = cache

