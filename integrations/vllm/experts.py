"""Routed experts from host memory in vLLM's MoE layers: the profile's ``experts`` section.

Note [Experts in vLLM]
    vLLM's MoE layer (``FusedMoE``, a runner) routes the tokens and hands ``topk_ids`` (global
    expert ids) to its ``RoutedExperts`` module's ``forward_modular``, which runs the quant
    method's kernel over all of the layer's experts. For each chosen layer ringflow:

    1. finds the layer's routed experts in host memory:
       * on a GPU, where ringflow put them as vLLM built the layer (Note [Ringflow places
         the chosen experts], ``expert_placement.py``; vLLM's UVA offloader, ``--cpu-offload-gb
         G --cpu-offload-params experts``, still may): vLLM loads them straight into pinned
         host memory and keeps a CUDA view of it as the parameter, so the experts do not
         stay in device memory (at most one layer's while vLLM builds the layers), and the
         fetch kernel reads that view as it is (Note [Device-indexed expert fetch]);
       * on vLLM's CPU build, as a copy taken while vLLM loads the model, just before the
         quant method processes them (``process_weights_after_loading``: vLLM-CPU repacks
         them there into its grouped-GEMM layout, which no cache slot could hold);
       a reload passes through ``process_weights_after_loading`` again: a CPU copy takes the
       new weights (a GPU's host store already holds them: vLLM wrote them there), and the
       cache forgets every slot;
    2. builds an :class:`~ringflow.integrations.torch.expert_cache.ExpertCache` over them: its
       slots are allocated while vLLM loads the model, so vLLM counts them as model memory
       before it sizes the KV cache;
    3. gives the layer's object its own ``forward_modular`` (``compat.shadow``; the model's one
       ``ExpertLane``, owned by ``PluginState.expert_lanes``, serves it): a step of fewer than
       ``layer_tokens`` tokens through the cache, which installs the experts the router chose
       that are not cached, each pass computing its experts from the slots (or, in place,
       from the host store: Note [Expert cache], step 5); a larger step through the layer
       ring (Note [Expert layer ring]). On a GPU each pass is vLLM's own fused-MoE kernel,
       called with the slots as the layer's weights and the pass's expert→slot map as its
       ``expert_map`` (as for expert parallelism: experts mapped to -1 contribute nothing),
       with the resident layer's tiles and one sum (Note [Same bits as resident]); only
       vLLM's Triton experts honour that map, so other MoE backends are refused with
       ``--moe-backend triton``. On the CPU it is ringflow's torch MoE
       (``kernels/moe.py``). The runner's routed scaling and reductions are untouched, and so
       are its shared experts (DeepSeek's): vLLM computes them in the runner, or, where the
       runner leaves them to its kernel (``SharedExpertsOrder.MK_INTERNAL_OVERLAPPED``, with
       expert or data parallelism), the lane calls them in that order as the kernel would.

    Everything ``forward_modular`` does is device work in stream order on vLLM's stream, with
    no host sync, so it runs inside the opaque ``moe_forward`` op vLLM captures in its CUDA
    graphs, and a replay fetches what its step's router chose. fp8 experts (on a GPU) move
    with their scales (Note [fp8 experts]). Layers whose experts need more than the SiLU-gated
    MoE this computes (biases, router weights applied on the input, other quantized formats,
    expert parallelism) are refused by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator, Mapping

import torch

from ringflow import envs
from ringflow.errors import EngineError, OutputError, ProfileError, UnsupportedModelError
from ringflow.graphs.streams import dedicated_streams
from ringflow.integrations.torch.expert_arena import ExpertArena, arena_rows
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
from ringflow.integrations.torch.expert_layers import ExpertLayerRing
from ringflow.integrations.torch.expert_lookahead import Lookahead
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.expert_host import host_shares
from ringflow.integrations.vllm.expert_kernel import ResidentKernel
from ringflow.integrations.vllm.state import PluginState, dump_rank
from ringflow.kernels import expert_plan
from ringflow.orchestrator import dumps
from ringflow.orchestrator.profile import Profile
from ringflow.orchestrator.sections import auto_slots, resolve_layers
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
    owner = next(((lane, i) for lane in list(state.expert_lanes.values())
                  for i, m in lane.modules.items() if m is layer), None)
    if owner is not None:  # a weight write (reload_weights): the host copies take it
        lane, i = owner
        for name, host in lane.store(i).items():
            weight = getattr(layer, f"{name}_weight").detach()
            if weight.data_ptr() != host.data_ptr():  # a GPU's host store is the weight
                host.copy_(weight)
        lane.forget()
        log.info("experts: %s's host copies hold the new weights; the lane's cached experts "
                 "and ring fills are dropped and fetched again as steps need them",
                 layer.layer_name)
    copies = _snapshots.get()
    if copies is not None and not layer.w13_weight.is_cuda:  # a GPU's store: Note, step 1
        copies[id(layer)] = {name: getattr(layer, f"{name}_weight").detach().clone()
                             for name in ("w13", "w2")}
    return original(method, layer, *args, **kwargs)


def explain_load_failure(vllm_config, exc: BaseException) -> None:
    """vLLM failed to load a model the profile serves experts of: one line where ringflow can
    tell why. vLLM 0.26's UVA offloader copies each parameter to host memory when the layer is
    built, and weights quantized at load (``--quantization fp8`` over a bf16 checkpoint) are
    then on the meta device, with no data yet."""
    quantization = getattr(getattr(vllm_config, "model_config", None), "quantization", None)
    if "meta tensor" in str(exc) and quantization:
        log.error("experts: vLLM's UVA offloader (--cpu-offload-gb) cannot take routed experts "
                  "quantized at load (--quantization %s: they are made on the meta device and "
                  "filled later); serve an fp8 checkpoint (per tensor, or in 128x128 blocks "
                  "like Qwen3-*-FP8 and DeepSeek-V3), whose experts the lane serves, or the "
                  "bf16 checkpoint without --quantization", quantization)


def refuse_quantized_reload(state: PluginState, runner) -> None:
    """Before vLLM's ``reload_weights``: refused with one line while the runner's model has an
    expert lane over fp8 layers. vLLM quantizes the new weights into new memory there (its fp8
    methods replace the parameters), which the lane's slots, ring and captured fetches, reading
    the old host store, would not follow."""
    get_model = getattr(runner, "get_model", None)
    lane = state.expert_lanes.get(get_model()) if get_model is not None else None
    names = sorted(i for i, m in (lane.modules.items() if lane is not None else ())
                   if quantized(m))
    if names:
        exc = EngineError(f"reload_weights is not supported while ringflow serves fp8 routed "
                          f"experts from host memory (layers {names}): vLLM writes the new "
                          f"weights to new memory the lane does not read; restart the engine "
                          f"with the new checkpoint, or drop the profile's experts section")
        log.error("%s", exc)
        raise exc


def moe_runners_of(decoder_layer) -> list:
    """The MoE runners of one decoder layer (vLLM's ``FusedMoE`` builds one per MoE layer,
    holding its ``RoutedExperts`` as ``routed_experts``)."""
    return [m for m in decoder_layer.modules()
            if type(getattr(m, "routed_experts", None)).__name__ == "RoutedExperts"]


def enable(state: PluginState, profile: Profile, decoder: list, copies: dict,
           vllm_config=None) -> ExpertLane:
    """Build the model's expert lane over each chosen layer's routed experts and attach it
    (Note [Experts in vLLM]): a cache per layer, one layer ring over them all (Note [Expert
    layer ring]), vLLM's kernel called as the resident layer calls it on a GPU (Note [Same
    bits as resident]).

    Raises:
        ProfileError: a chosen layer has no routed experts.
        UnsupportedModelError: a layer's experts this lane cannot compute, or, on a GPU,
            experts in device memory or a MoE kernel that ignores expert maps.
    """
    spec = profile.experts
    chosen = resolve_layers("experts.layers", spec.layers, len(decoder), profile.source)
    found = {i: moe_runners_of(decoder[i]) for i in chosen}
    if spec.layers == "all":
        found = {i: m for i, m in found.items() if m}
    empty = sorted(i for i, m in found.items() if not m)
    if not found:
        raise ProfileError("experts.layers", "is 'all', but this model has no MoE layer (no "
                           "routed experts): the experts section serves MoE models; drop it",
                           profile.source)
    if empty:
        moe = [i for i, layer in enumerate(decoder) if moe_runners_of(layer)]
        raise ProfileError("experts.layers", f"decoder layers {empty} have no routed experts "
                           f"(no MoE); list MoE layers (this model's: {moe}), or 'all'",
                           profile.source)
    on_gpu = any(r.routed_experts.w13_weight.is_cuda for (r,) in found.values())
    caches: dict[int, ExpertCache] = {}
    modules: dict[int, object] = {}
    computes: dict[int, object] = {}
    hosts: dict[int, dict] = {}
    for i, (runner,) in sorted(found.items()):
        experts = runner.routed_experts
        check_layer(i, runner, experts)
        host = copies.get(id(experts)) if not on_gpu else expert_tensors(experts)
        if host is None:
            raise UnsupportedModelError(f"experts: layer {i}'s routed experts were not seen "
                                        f"while vLLM loaded the model (their quant method is "
                                        f"{type(experts.quant_method).__name__}, not "
                                        f"vLLM's unquantized one)")
        hosts[i] = host
    held = held_layers(spec, sorted(found), profile.source)
    auto, auto_said = _auto_slots(spec, hosts, found, on_gpu, vllm_config, profile.source,
                                  cached=len(found) - len(held))
    arena = streams_through_slots(spec, profile.source)
    cached = [i for i in sorted(found) if i not in held]  # held: the ring holds them (Note
    spec.check_slot_layers(cached, profile.source)         # [Small steps read the held layers])
    slots = {}
    for i in sorted(found):
        (runner,) = found[i]
        experts, host = runner.routed_experts, hosts[i]
        modules[i] = experts
        computes[i] = (ResidentKernel(experts, (host["w13"].shape, host["w2"].shape))
                       if on_gpu else TorchCompute())
        if i in cached:
            slots[i] = auto or spec.slots_for(experts.global_num_experts, experts.top_k,
                                              held=len(held), chosen=len(found), layer=i)
    device = found[cached[0]][0].routed_experts.w13_weight.device
    rows, views = (arena_rows(hosts[cached[0]], [slots[i] for i in cached], device) if arena
                   else (None, [None] * len(cached)))  # None: each cache allocates its own
    for i, view in zip(cached, views):
        caches[i] = ExpertCache(hosts[i], slots[i], device,
                                in_place_tokens=spec.in_place_tokens,
                                whole_in_place=scales_across_rows(found[i][0].routed_experts),
                                rows=view)
    ring = None
    if spec.layer_buffers:
        stream = (dedicated_streams(caches[min(caches)], device, ["experts-copy"],
                                    priority=0)["experts-copy"]
                  if device.type == "cuda" else None)  # lives while the lane's caches do
        if arena:
            ring = ExpertArena([caches[i] for i in cached], rows, stream,
                               poison_reads=envs.flag("RINGFLOW_POISON"))
        else:
            ring = ExpertLayerRing([hosts[i] for i in sorted(found)], spec.layer_buffers,
                                   device, stream, poison_reads=envs.flag("RINGFLOW_POISON"),
                                   caches=([caches.get(i) for i in sorted(found)]
                                           if spec.ring_from_slots else None),
                                   lend_slots=spec.lend_slots, hold=bool(held))
    ahead = _lookaheads(decoder, caches, sorted(found)) if spec.lookahead else {}
    on_host, policy = host_shares(spec, caches, modules, vllm_config)
    lane = ExpertLane(caches, computes, ring, spec.layer_tokens, ahead, modules, on_host,
                      policy, early_start=spec.early_start)
    for i, experts in modules.items():
        if not compat.shadow(state, _FORWARD, experts, _forward(i, lane)):
            raise UnsupportedModelError(f"experts: layer {i}'s {type(experts).__qualname__}."
                                        f"forward_modular does not take what ringflow "
                                        f"replaces it with (the line above says why); drop "
                                        f"the experts section or use a vLLM ringflow supports")
    if on_gpu:
        _say_other_offloaded(decoder, modules)
    if envs.text("RINGFLOW_DUMP"):
        _dump(lane, envs.text("RINGFLOW_DUMP"))
    first = next(iter(caches.values()))
    if envs.flag("RINGFLOW_EXPERT_PLAN_KERNEL") and not first.plan_kernel:
        log.info("RINGFLOW_EXPERT_PLAN_KERNEL is set, but %s: the torch path plans each step "
                 "(Note [One kernel plans the step])",
                 expert_plan.why_not(first.device, first.experts))
    over = ({i: n for i, n in spec.slots.items() if i in caches and n > caches[i].experts}
            if isinstance(spec.slots, dict) else
            spec.slots if isinstance(spec.slots, int) and spec.slots > first.experts else None)
    cut = (f" (experts.slots: {over} asked, cut to the layer's {first.experts} experts)"
           if over else "")
    if spec.slots == "auto":
        cut = (f" (experts.slots: auto, {auto_said})" if auto_said
               else " (experts.slots: auto, the default on the CPU build: it has no device "
                    "memory budget to share)")
    counts = {i: c.slots for i, c in caches.items()}
    kept = (f"{first.slots} kept on the device per layer" if len(set(counts.values())) == 1
            else f"kept on the device per layer {counts}")
    log.info("experts: layers %s: %d routed experts each (%s), %s (%s)%s, host copies %s; "
             "a step of fewer than %d tokens brings in only the experts its router chose that "
             "are not kept%s", sorted(caches), first.experts,
             weight_format(modules[min(modules)]), kept,
             mib(sum(c.bytes for c in caches.values())), cut,
             mib(sum(t.numel() * t.element_size() for host in hosts.values()
                     for t in host.values())), spec.layer_tokens,
             ("; a step needing more experts than the slots reads them all from host memory "
              "in one pass (per-tensor fp8: one activation scale per step)"
              if first.whole_in_place else "") +
             (f"; a larger one computes each layer from the slots' own memory (experts."
              f"layer_buffers: slots, {ring.windows} layer(s)' worth of rows): the experts "
              f"they hold where they are, the rest copied "
              + ("ahead on a copy engine" if device.type == "cuda" else "in line")
              + " into spare rows (empty ones first, then other layers' once they ran)"
              if arena else
              f"; a larger one takes each layer whole from a ring of {ring.buffers} layer "
              f"buffers ({mib(ring.bytes)}), "
              + (("the experts its slots hold copied from them, the rest ahead on a copy "
                  "engine" + ("; each large step's tail lends the carried layers' slots to the "
                              "next layer's missing experts" if ring.lend_slots else "")
                  if spec.ring_from_slots else "copied ahead on a copy engine")
                 if device.type == "cuda" else
                 "copied in line (a CPU has no copy engine)")
              if ring is not None else "; larger ones too (experts.layer_buffers: 0, no ring)")
             + (f"; layers {held} stay whole in the ring's buffers between large steps and "
                f"small steps compute them there (experts.decode_from_ring)" if held else ""))
    if spec.early_start:
        hooked = [k for k in getattr(getattr(state, "surfaces", None), "hooked", ())
                  if k.endswith("GPUModelRunner.execute_model")]
        log.info("experts.early_start: %s", (
            f"each step of {spec.layer_tokens} or more scheduled tokens starts its fills at "
            f"vLLM's execute_model, before vLLM prepares its inputs (Note [Large steps start "
            f"early])" if hooked else
            "this vLLM's model runner has no execute_model ringflow could hook: each large "
            "step starts at its first chosen layer"))
    return lane


def streams_through_slots(spec, source: str | None) -> bool:
    """Whether large steps stream through the slots' memory (``layer_buffers: slots``, Note
    [Large steps stream through the slots]); refused beside ``lend_slots``, which lends slots
    to a ring of layer buffers; ``early_start`` without it is refused."""
    if spec.layer_buffers != "slots":
        if spec.early_start:
            raise ProfileError("experts.early_start", "starts a large step's fills of the "
                               "slots before its forward; it needs layer_buffers: slots (a "
                               "ring of layer buffers has nothing to start early)", source)
        return False
    if spec.lend_slots:
        raise ProfileError("experts.layer_buffers", "'slots' streams large steps through the "
                           "slots' memory; lend_slots lends slots to a ring of layer buffers: "
                           "set one of them", source)
    return True


def held_layers(spec, chosen: list[int], source: str | None) -> list[int]:
    """The chosen layers the layer ring holds for small steps (``decode_from_ring``, Note
    [Small steps read the held layers]): the first ``layer_buffers``; none when off."""
    if not spec.decode_from_ring:
        return []
    if spec.layer_buffers == "slots":
        raise ProfileError("experts.decode_from_ring", "holds layers in the ring's buffers; "
                           "layer_buffers: slots has none (it streams large steps through the "
                           "slots): set one of them", source)
    if not 0 < spec.layer_buffers < len(chosen):
        raise ProfileError("experts.decode_from_ring", f"holds the first layer_buffers chosen "
                           f"layers in the ring and serves the rest from slots: it needs "
                           f"1 <= layer_buffers < the {len(chosen)} chosen layers, got "
                           f"layer_buffers {spec.layer_buffers}", source)
    if spec.lend_slots:
        raise ProfileError("experts.decode_from_ring", "and lend_slots both use the carried "
                           "layers' memory (with decode_from_ring those layers have no slots "
                           "to lend): set one of them", source)
    return chosen[:spec.layer_buffers]


def _auto_slots(spec, hosts: dict, found: dict, on_gpu: bool, vllm_config,
                source: str | None, cached: int) -> tuple[int | None, str]:
    """``slots: auto`` on a GPU: the slots per layer that the profile's share of what vLLM's
    memory budget leaves holds (``sections.auto_slots``), and how the log says it; (None, "")
    where slots are not auto or the device is the CPU (vLLM's CPU build sizes its KV cache from
    host memory: the default serves)."""
    if spec.slots != "auto" or not on_gpu:
        return None, ""
    first = hosts[min(hosts)]
    (runner,) = found[min(found)]
    experts = runner.routed_experts
    slot_bytes = sum(t[0].numel() * t.element_size() for t in first.values())
    layer_bytes = slot_bytes * experts.global_num_experts
    ring = (0 if spec.layer_buffers == "slots"  # the arena is the slots' own memory
            else min(spec.layer_buffers, len(hosts)) * layer_bytes)
    device = experts.w13_weight.device
    free, total = torch.cuda.mem_get_info(device)
    util = getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", 0.9)
    left = int(free - (1 - util) * total) - ring
    slots = auto_slots(left, spec.auto_percent, cached, slot_bytes,
                       experts.global_num_experts, experts.top_k, source)
    return slots, (f"{spec.auto_percent}% of the {mib(max(left, 0))} that vLLM's budget "
                   f"(--gpu-memory-utilization {util}) leaves after the weights and the layer "
                   f"ring; the KV cache gets the rest")


def _lookaheads(decoder: list, caches: dict[int, ExpertCache],
                chosen: list[int]) -> dict[int, Lookahead]:
    """Chosen layer -> its guess of the next chosen layer's experts (Note [Expert lookahead]),
    for every chosen layer but the last whose next layer has a cache (the ring holds none of
    its layers) and a router that is found."""
    order = sorted(caches)
    stream = None
    device = caches[order[0]].device
    if device.type == "cuda":  # ringflow's own, never one of torch's pool (Note [Dedicated streams])
        stream = dedicated_streams(caches[order[0]], device, ["experts-lookahead"],
                                   priority=0)["experts-lookahead"]
    out, lost = {}, []
    for i, j in zip(chosen, chosen[1:]):
        if j not in caches:
            continue
        target = caches[j]
        (runner,) = moe_runners_of(decoder[j])
        router = _router_of(decoder[j], target.experts)
        if router is None:
            lost.append(j)
            continue
        out[i] = Lookahead(router, target, runner.routed_experts.top_k, stream)
    if lost:
        log.warning("experts.lookahead: no router (a module named 'gate' with one output per "
                    "expert) in layers %s; the layers before them do not look ahead", lost)
    log.info("experts.lookahead: layers %s guess the next chosen layer's experts with its "
             "router and fetch them on a side stream (eager steps and FULL graphs; not in "
             "piecewise graphs nor in steps of several passes)", sorted(out))
    return out


def _router_of(decoder_layer, experts: int):
    """The router of a decoder layer as a function of hidden states to logits [tokens,
    experts], or None: vLLM's MoE blocks call it ``gate``, a linear layer with one output per
    expert. Called as vLLM calls it (its own GEMM: vLLM-CPU packs the weight away, and a
    GPU's may be a dedicated router kernel)."""
    for name, module in decoder_layer.named_modules():
        if name.rsplit(".", 1)[-1] == "gate" and getattr(module, "output_size", None) == experts:
            def logits(x: torch.Tensor, gate=module) -> torch.Tensor:
                out = gate(x)
                return out[0] if isinstance(out, tuple) else out
            return logits
    return None


_said_modes: set[str] = set()


def _may_fork() -> bool:
    """Whether this step may fork a side stream and join it a layer later: not while vLLM
    runs or captures it as piecewise CUDA graphs (Note [Expert lookahead]). Says once per
    graph mode what the lookahead does under it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    mode = "NONE"
    if is_forward_context_available():
        runtime = get_forward_context().cudagraph_runtime_mode
        mode = getattr(runtime, "name", str(runtime))
    may = mode != "PIECEWISE"
    if mode not in _said_modes:
        _said_modes.add(mode)
        log.info("experts.lookahead: steps vLLM runs with CUDA graph mode %s %s", mode,
                 "are guessed (unless they need several passes)" if may else
                 "are not guessed: a piecewise graph would end between the fork and its join")
    return may


def expert_tensors(experts) -> dict[str, torch.Tensor]:
    """A GPU layer's per-expert tensors, as the lane moves them (Note [fp8 experts]): its
    weights ``w13``/``w2`` and, for fp8, their scales ``w13_scale``/``w2_scale`` (a scale per
    expert [experts] is kept as [experts, 1]: a cache slot is a row of at least two
    dimensions; ``ResidentKernel`` hands the kernel the layer's own shape)."""
    out = {name: getattr(experts, f"{name}_weight").detach() for name in ("w13", "w2")}
    config = _quant_config(experts)
    if config is not None and config.w1_scale is not None:
        for name, scale in (("w13_scale", config.w1_scale), ("w2_scale", config.w2_scale)):
            scale = scale.detach()
            out[name] = scale.unsqueeze(-1) if scale.dim() == 1 else scale
    return out


def _quant_config(experts):
    """The quantization config vLLM's kernel of this layer computes with (None: none)."""
    kernel = getattr(experts.quant_method, "moe_kernel", None)
    return getattr(getattr(kernel, "fused_experts", None), "quant_config", None)


def _in_host_memory(t: torch.Tensor) -> bool:
    from ringflow.cudart import in_host_memory
    return in_host_memory(t.data_ptr())


def _kernel_name(experts) -> str:
    """The class of vLLM's experts kernel behind this layer's quant method."""
    kernel = getattr(experts.quant_method, "moe_kernel", None)
    return type(getattr(kernel, "fused_experts", None)).__name__


#: vLLM's experts classes whose kernels honour ``expert_map`` (blocks of experts mapped to -1
#: write zeros); FlashInfer's and others' do not, and would compute the wrong experts
MAPPED_KERNELS = ("TritonExperts",)


def on_execute_model(state: PluginState, original, runner, scheduler_output, *args, **kwargs):
    """The hook on a model runner's ``execute_model``, before vLLM prepares the step: a parked
    host-share worker is woken (Note [An idle worker parks]); a large step of a lane with
    ``early_start`` starts its fills now (Note [Large steps start early]), from the step's
    scheduled token count, and after it a prepare its forward did not use (a replayed graph)
    is dropped; vLLM's dummy runs are left alone."""
    lane, tokens = None, 0
    if state.expert_lanes and not kwargs.get("dummy_run"):
        get_model = getattr(runner, "get_model", None)
        lane = state.expert_lanes.get(get_model()) if get_model is not None else None
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    if lane is not None and lane.host is not None and tokens > 0:
        lane.host.wake()  # a parked host worker enters its loop before the step's doorbells
    prepared = (lane is not None and lane.early_start and tokens > 0
                and lane.prepare_step(tokens))
    try:
        return original(runner, scheduler_output, *args, **kwargs)
    finally:
        if prepared:  # the forward was issued in there: a prepare it did not use is dropped
            lane.finish_step(tokens)


def worker_report(worker=None) -> list[dict]:
    """Per chosen layer of every model loaded in this process, its cache's and the ring's
    layout and counters (``ExpertLane.report``): what ``llm.collective_rpc(worker_report)``
    returns from each worker."""
    from ringflow.integrations.vllm.state import STATE
    return [row for lane in list(STATE.expert_lanes.values()) for row in lane.report()]


def _dump(lane: ExpertLane, base: str) -> None:
    """``RINGFLOW_DUMP``: the lane's layout as ``<stem>.experts.json`` (``<stem>.rankR.experts
    .json`` under tensor parallelism, one file per rank; Note [Experts in vLLM]): per layer,
    the cache, where its host store lives, what computes its passes, and the ring."""
    stem = dumps.dump_stem(base, dump_rank())
    layers = []
    for row in lane.report():
        experts = lane.modules[row["layer"]]
        layers.append({**row, "name": experts.layer_name,
                       "weights": weight_format(experts),
                       "compute": (f"vLLM {_kernel_name(experts)} with the resident layer's "
                                   f"tiles, summed once (Note [Same bits as resident])"
                                   if experts.w13_weight.is_cuda
                                   else "ringflow's torch MoE per pass (kernels/moe.py)"),
                       "passes": ("every step: one, over its ring buffer (held: Note "
                                  "[Small steps read the held layers])"
                                  if "held_in_ring_buffer" in row else
                                  f"steps of fewer than {lane.layer_tokens} tokens: "
                                  f"ceil(min(experts, tokens * top_k) / slots); a step of "
                                  f"at most {row['in_place_tokens']} tokens needing more than "
                                  f"one: 2, the second over the host store in place; larger "
                                  f"steps: one pass, over "
                                  + ("rows of the slots' memory (Note [Large steps stream "
                                     "through the slots])" if (row["ring"] or {}).get("arena")
                                     else "a buffer of the layer ring")),
                       "top_k": experts.top_k})
    doc = {"schema": "ringflow.experts", "version": 2,
           "stream": "vLLM's: each pass's fetch (device-indexed, Note [Device-indexed expert "
                     "fetch]) then its MoE, in stream order (Note [Expert cache]); the layer "
                     "ring's fills on ringflow's copy stream (Note [Expert layer ring])",
           "layers": layers}
    if lane.host is not None:  # Note [Host experts]: the host nodes of each decode step
        policy = lane.host_policy
        doc["host_share"] = {
            "shares": {t: round(share, 4) for t, share in policy.shares.items()},
            "why": policy.why,
            "nodes": ["stage: the step's rows, choices and the host's experts to pinned memory "
                      "(device-to-host, vLLM's stream)",
                      "doorbell: cuStreamWriteValue32 wakes the lane's worker (a TorchScript "
                      "loop on a thread of its own, no Python), before the step's other "
                      "misses are installed",
                      "the installs and the GPU's pass over the slots; meanwhile the worker "
                      "computes its experts from host memory into pinned float32 rows",
                      "join: cuStreamWaitValue32: the stream waits for the worker's done "
                      "flag, then resets it",
                      "sum: the host's rows to the device and into the layer's sum"]}
    try:
        path = dumps.write_json(f"{stem}.experts.json", doc)
    except OutputError as exc:
        log.warning("RINGFLOW_DUMP: %s; the expert lane is not dumped", exc)
        return
    log.info("wrote the expert lane's layout to %s", path)


#: vLLM's MoE quant methods by a part of their class name -> the format a user knows
_FORMATS = (("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("fp4", "fp4"), ("fp8", "fp8"),
            ("marlin", "int4 (Marlin)"), ("gptq", "int4 (GPTQ)"), ("awq", "int4 (AWQ)"),
            ("wna16", "int4/int8 weight-only"), ("int8", "int8"), ("int4", "int4"),
            ("compressedtensors", "compressed-tensors"))


def quant_format(method: str) -> str:
    """The quantization format a MoE quant method class (by name) serves, as users name it."""
    low = method.lower()
    return next((name for part, name in _FORMATS if part in low), "quantized")


#: why a GPU layer's experts can be in device memory (Note [Ringflow places the chosen experts])
NOT_PLACED = ("ringflow puts the chosen layers' experts in pinned host memory as vLLM builds the "
              "decoder stack it hands its offloader (make_layers), and did not see this one "
              "built there; drop the layer from experts.layers")


def check_layer(index: int, runner, experts) -> None:
    """Raise ``UnsupportedModelError`` naming every reason this lane cannot compute layer
    ``index``'s routed experts exactly (Note [Experts in vLLM])."""
    why = []
    if experts.w13_weight.is_cuda:
        if not all(_in_host_memory(w) for w in (experts.w13_weight, experts.w2_weight)):
            why.append(f"its routed experts are in device memory: {NOT_PLACED}")
        name = _kernel_name(experts)
        if name not in MAPPED_KERNELS:
            why.append(f"its MoE kernel is {name}, which ignores an expert map: start vLLM "
                       f"with --moe-backend triton")
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
    method = type(experts.quant_method).__name__
    if method in FP8_METHODS and not experts.w13_weight.is_cuda:
        why.append(f"its experts are fp8 ({method}) and the lane computes fp8 experts with "
                   f"vLLM's Triton kernel on a GPU only: on the CPU serve the unquantized "
                   f"checkpoint (without --quantization)")
    elif method in FP8_METHODS:
        why.extend(_fp8_gaps(experts))
    elif method != "UnquantizedFusedMoEMethod":
        why.append(f"its experts are quantized: {quant_format(method)} ({method}); the lane "
                   f"serves unquantized and fp8 experts only: serve the unquantized or an fp8 "
                   f"checkpoint, or drop the experts section")
    if why:
        raise UnsupportedModelError(f"experts: layer {index} ({experts.layer_name}) cannot take "
                                    f"its routed experts from host memory: {'; '.join(why)}. "
                                    f"Drop it from experts.layers")


#: vLLM's fp8 MoE methods whose experts the lane serves (Note [fp8 experts]): checkpoints
#: in fp8 (per tensor, or in blocks such as DeepSeek's 128x128) and bf16 ones quantized at load
FP8_METHODS = ("Fp8MoEMethod", "Fp8PerTensorOnlineMoEMethod", "Fp8PerBlockOnlineMoEMethod")


def _fp8_gaps(experts) -> list[str]:
    """Why the lane cannot serve this fp8 layer through its slots (none: it can): the kernel
    must read one scale row per expert and nothing else per expert (zero points, biases)."""
    config = _quant_config(experts)
    if config is None or config.w1_scale is None or config.w2_scale is None:
        return ["its fp8 kernel has no weight scales ringflow can read"]
    e = experts.w13_weight.shape[0]
    shapes = (tuple(config.w1_scale.shape), tuple(config.w2_scale.shape))
    if any(not s or s[0] != e for s in shapes):
        return [f"its fp8 weight scales {shapes} are not one row per expert ({e})"]
    if any(getattr(config, k, None) is not None for k in ("w1_zp", "w2_zp", "w1_bias",
                                                            "w2_bias")):
        return ["its fp8 experts have zero points or biases"]
    return []


def weight_format(experts) -> str:
    """How a layer's experts are stored, as the start-up line and the dump say it."""
    config = _quant_config(experts) if quantized(experts) else None
    if config is None:
        return str(experts.w13_weight.dtype).removeprefix("torch.")
    blocks = config.block_shape
    return (f"fp8, scales per {blocks[0]}x{blocks[1]} block" if blocks else
            "fp8, one scale per expert and weight")


def scales_across_rows(experts) -> bool:
    """Whether vLLM's kernel quantizes this layer's activations with one scale per step
    (per-tensor fp8, dynamic): a row's result then depends on every row of the step, so a
    step is never split into passes (Note [fp8 experts])."""
    config = _quant_config(experts) if quantized(experts) else None
    return (config is not None and config.block_shape is None and config.a1_scale is None
            and not config.per_act_token_quant)


def quantized(experts) -> bool:
    """Whether vLLM computes this layer's experts from quantized weights."""
    return type(experts.quant_method).__name__ != "UnquantizedFusedMoEMethod"


def _say_other_offloaded(decoder: list, chosen: Mapping[int, object]) -> None:
    """One line naming MoE layers vLLM's UVA offloader put in host memory that the profile did
    not choose: vLLM's kernel reads all of their experts across the host link every step."""
    others = [i for i, layer in enumerate(decoder) if i not in chosen
              for r in moe_runners_of(layer) if r.routed_experts.w13_weight.is_cuda
              and _in_host_memory(r.routed_experts.w13_weight)]
    if others:
        log.warning("experts: layers %s are not in experts.layers but vLLM's UVA offloader put "
                    "their experts in host memory: vLLM reads them across the host link at "
                    "every step; lower --cpu-offload-gb or add them", others)


@functools.cache
def _kernel_order():
    """vLLM's order for shared experts that its MoE kernel computes: called with it, the runner's
    ``SharedExperts`` computes them only when the runner left them to the kernel (with expert
    or data parallelism), and is a no-op otherwise (the runner computes them itself)."""
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
    return SharedExpertsOrder.MK_INTERNAL_OVERLAPPED


_FORWARD = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.forward_modular"


def _forward(index: int, lane: ExpertLane):
    """Layer ``index``'s ``forward_modular`` through the lane (Note [Experts in vLLM]), set on
    that layer's ``RoutedExperts`` only (``compat.shadow``): each pass's fetch and MoE in NVTX
    ranges ``ringflow/experts/{fetch,moe}/L<i>`` and a ring layer's wait in
    ``ringflow/experts/layer/L<i>`` (at capture time under a CUDA graph, like every range)."""

    @torch.compiler.disable  # state tensors change in place each step: run it as Python
    def forward_modular(x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        if shared_experts is not None:  # what vLLM's kernel does with them (Note, step 3)
            shared_experts(shared_experts_input, _kernel_order())
        return lane.forward(index, x, topk_weights, topk_ids, _may_fork)

    return forward_modular
