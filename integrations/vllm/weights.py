"""Weight streaming in vLLM: the hooks on vLLM's worker and model runners (``surfaces.py``
names each one and the versions that have it).

* ``Worker.load_model``: after the model is loaded, and before vLLM profiles memory and sizes
  the KV cache, builds a :class:`WeightStreamer` for the profile's ``offload`` layers: their
  weights move to pinned host memory, the ring of layer-slots is allocated, what streaming
  freed is credited to vLLM's weights memory, and the log says what it reserved.
* ``Worker.initialize_from_config``: the KV cache is being allocated; from here on no ring may
  be allocated (the order is what keeps the KV budget honest; tests assert it).
* the model runners' ``reload_weights`` and the model's own ``load_weights``: followed
  (Note [Weights that change] in ``integrations/torch/weight_stream.py``); the worker calls that
  move memory or weights some other way are refused with one line (:func:`refusal`).
* ``UnquantizedLinearMethod.process_weights_after_loading``: on a CPU, vLLM repacks linear
  weights into oneDNN handles that cannot be streamed; while ringflow streams, the linear
  layers keep plain weights (``F.linear``). ``RINGFLOW_CPU_PLAIN_GEMM=1`` does the same without
  ringflow, for A/B comparisons with identical kernels.

Each streamer has one owner: the plugin state, keyed by the model runner whose model it streams
(``PluginState.streamers``); nothing is parked on vLLM's objects.
"""

from __future__ import annotations

import logging

import torch

from ringflow import envs
from ringflow.errors import BudgetError, EngineError, OutputError, ProfileError, RingflowError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.torch import layer_ops
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.integrations.vllm import (compat, experts, frontend, graph_mode, layers, memory,
                                        startup_errors, surfaces)
from ringflow.integrations.vllm.expert_placement import HostPlacement, check_placed
from ringflow.integrations.vllm.state import PluginState, dump_rank
from ringflow.orchestrator import dumps
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB, mib

log = logging.getLogger("ringflow")


def on_load_model(state: PluginState, original, worker, *args, **kwargs):
    """The hook on ``Worker.load_model``: vLLM loads the model (recording its decoder stacks,
    linear layers kept plain where streaming needs it), then streaming is enabled, before vLLM
    profiles memory and sizes the KV cache."""
    try:
        profile = state.profile(worker.vllm_config)
        if profile is not None:
            compat.require(state, surfaces.needed(profile),
                           f"profile '{profile.name}' ({profile.source})")
        layer_ops_only = envs.flag("RINGFLOW_LAYER_OPS_ONLY")
        plain = envs.flag("RINGFLOW_CPU_PLAIN_GEMM")
        streaming = frontend.streams_weights(profile)
        frontend.refuse_streaming_beside_experts(profile)  # (the front end refused it first)
        if getattr(worker.vllm_config, "lora_config", None) is not None:
            frontend.refuse_lora(profile)  # the front end refuses it first, where it runs
    except RingflowError as exc:
        startup_errors.fail(exc)  # one line, last (Note [One line at start-up])
    state.new_model_load()
    if layer_ops_only and profile is not None and profile.offload is not None:
        log.info("RINGFLOW_LAYER_OPS_ONLY=1: profile '%s''s offload section is not streamed "
                 "(the layer ops run with nothing moved, as the switch says)", profile.name)
    wants_experts = profile is not None and profile.experts is not None
    placement = HostPlacement(state, profile) if wants_experts else None
    with state.loading_with_plain_weights(streaming or plain), \
            layers.recording(*([placement] if placement else [])) as stacks, \
            experts.taking_host_copies(wants_experts) as expert_copies:
        try:
            result = original(worker, *args, **kwargs)
        except NotImplementedError as exc:
            if wants_experts:
                experts.explain_load_failure(worker.vllm_config, exc)
            raise
    try:
        if wants_experts:
            model = worker.model_runner.get_model()
            decoder = layers.decoder_layers(model, stacks)
            check_placed(placement, decoder)
            state.expert_lanes[model] = experts.enable(
                state, profile, decoder, expert_copies, worker.vllm_config)
        if streaming:
            _enable(state, worker, profile, stacks)
        elif layer_ops_only:
            _layer_ops_only(state, worker, stacks, profile)
        if profile is not None and profile.kv_prefetch is not None:
            own_context_layers(state, worker.model_runner.get_model())
    except RingflowError as exc:
        startup_errors.fail(exc)  # one line, last (Note [One line at start-up])
    return result


def own_context_layers(state: PluginState, model) -> list[str]:
    """MLA layers that compute their context themselves (vLLM's Kimi-K3 layer is its own
    ``AttentionLayerBase``, not an ``MLAAttention``): ringflow's context hook never sees them
    and reserves nothing for them; said once, by class."""
    from ringflow.integrations.vllm.attention import attached
    found = sorted({type(m).__qualname__ for m in model.modules()
                    if hasattr(m, "kv_lora_rank") and "_compute_prefill_context" in vars(type(m))
                    and not attached(state, m)})
    for name in found:
        state.log_once(f"own-context:{name}", "kv_prefetch: %s computes its MLA context itself "
                       "(not through vLLM's MLAAttention); ringflow reserved no ring for its "
                       "layers and gathers nothing for them", name)
    return found


class _NothingStreamed:
    """Stands in for a stepper under ``RINGFLOW_LAYER_OPS_ONLY``: the ops run, nothing moves."""

    def before(self, layer: int) -> None:
        pass

    def after(self, layer: int) -> None:
        pass


def ops_only_layers(profile: Profile | None, decoder, vllm_config) -> list[int]:
    """The layers ``RINGFLOW_LAYER_OPS_ONLY`` wraps: those the profile's streaming would (the
    first, the last and the offloaded ones, Note [Boundary layers]: the same compiled
    partition), or every layer without an offload section (the boundary's worst case)."""
    if profile is None or profile.offload is None:
        return list(range(len(decoder)))
    return sorted({0, len(decoder) - 1, *_resolve_layers(profile, decoder, vllm_config)})


def _layer_ops_only(state: PluginState, worker, stacks, profile: Profile | None) -> None:
    """Wrap decoder layers in ringflow's layer ops (splitting vLLM's pieces there, as
    streaming does) with nothing streamed: the same compiled partition, for A/B baselines."""
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    stub = _NothingStreamed()
    state.boundaries[worker.model_runner] = stub  # lives as long as the runner
    breaker, _ = graph_mode.capture_breaker(state, worker.vllm_config, "join")
    handle = layer_ops.register_stepper(stub, breaker=breaker)  # the same breaks as streaming
    wrapped = ops_only_layers(profile, decoder, worker.vllm_config)
    for index in wrapped:
        layer_ops.wrap_layer(decoder[index], handle, index)
    if any(p.is_cuda for p in decoder[0].parameters()):  # as streaming does (see _enable)
        graph_mode.split_pieces_at_layer_ops(worker.vllm_config)
    log.info("RINGFLOW_LAYER_OPS_ONLY=1: %d of %d decoder layers run between ringflow's layer "
             "ops (%s); nothing is streamed", len(wrapped), len(decoder),
             "every layer: the profile has no offload section"
             if profile is None or profile.offload is None
             else "the first, the last and the offloaded ones, as streaming would")


def keep_plain_weights(state: PluginState, original, method, layer, *args, **kwargs):
    if state.plain_weights:
        # vLLM's CPU path honours this flag: plain F.linear over layer.weight, no repacking
        layer._cpu_skip_gemm_dispatch = True
    return original(method, layer, *args, **kwargs)


def on_initialize_from_config(state: PluginState, original, worker, *args, **kwargs):
    """The hook on ``Worker.initialize_from_config`` (vLLM allocates the KV cache): from here on
    no ring may be allocated (the KV budget would lie); the log says what the rings took."""
    streamer = state.streamers.get(worker.model_runner)
    rings = (streamer.reserved_bytes if streamer is not None else 0) + state.ring_bytes()
    experts = state.expert_bytes()
    reserved = rings + experts
    if reserved:
        state.record("kv-cache-initialized")
        what = " and ".join(name for name, n in (("rings", rings), ("expert lane", experts)) if n)
        log.info("KV cache allocated after ringflow's %s (%s reserved before sizing)", what,
                 mib(reserved))
        memory.log_kv_size(worker, streamer, *args, **kwargs)
    state.kv_sized = True
    result = original(worker, *args, **kwargs)
    wrapped = streamer is not None or worker.model_runner in state.boundaries
    if reserved or wrapped:
        profile = state.profile(worker.vllm_config)
        graph_mode.log_graph_mode(
            state, worker.vllm_config, layer_ops_in=wrapped,
            context=profile is not None and profile.kv_prefetch is not None
            and profile.kv_prefetch.consumer == "context")
    return result


def _enable(state: PluginState, worker, profile: Profile, stacks) -> WeightStreamer:
    _refuse_vllm_offloader(state)
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    offload = _resolve_layers(profile, decoder, worker.vllm_config)
    on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in decoder[0].parameters())
    before = torch.cuda.memory_allocated() if on_gpu else 0
    breaker, capture = graph_mode.capture_breaker(state, worker.vllm_config, profile.capture)
    try:
        streamer = WeightStreamer(
            decoder, offload, depth=profile.offload.depth, breaker=breaker,
            workspace_bytes=int(profile.offload.workspace_mib * MIB), capture=capture,
            gather_priority=profile.gather_priority, poison=poison_default(), name=profile.name,
            cross_forward=profile.offload.cross_forward, synchronous=profile.offload.synchronous)
    except BudgetError as exc:  # the profile's budget: name its field
        raise ProfileError("offload.workspace_mib", str(exc), profile.source) from exc
    state.add_streamer(worker.model_runner, streamer)  # lives and dies with the runner's model
    _follow_load_weights(streamer, worker.model_runner.get_model())
    state.record("ring-allocated")
    per_token = memory.kv_bytes_per_token(worker)
    tokens = (lambda nbytes: f"{int(nbytes // per_token):,} KV tokens ({per_token:,.0f} B/token)"
              ) if per_token else (lambda nbytes: "an unknown number of KV tokens")
    fixed = getattr(getattr(worker.vllm_config, "cache_config", None),
                    "kv_cache_memory_bytes", None)
    if on_gpu:
        streamer.saved_bytes = before - torch.cuda.memory_allocated()  # measured, not estimated
        credited = memory.credit_weights_memory(worker, streamer.saved_bytes)
        runner = type(worker.model_runner)
        log.info("profile '%s': %s; allocated before the KV cache is sized; device memory "
                 "%s by %s (offloaded weights freed minus the ring)%s, %s",
                 profile.name, streamer.describe(),
                 "fell" if streamer.saved_bytes >= 0 else "grew", mib(abs(streamer.saved_bytes)),
                 f", credited to {runner.__module__}.{runner.__qualname__}'s weights memory "
                 f"before it sizes the KV cache" if credited
                 else " (vLLM's weights memory figure not found: not credited)",
                 f"worth {tokens(abs(streamer.saved_bytes))}" if not fixed else
                 "which does not move the KV cache: kv_cache_memory_bytes fixes its size")
    else:  # vLLM-CPU sizes its KV cache from its own setting, never from what is left
        log.info("profile '%s': %s; allocated before the KV cache is sized; on a CPU vLLM sizes "
                 "its KV cache from its own setting (kv_cache_memory_bytes or "
                 "VLLM_CPU_KVCACHE_SPACE), so the ring does not shrink it", profile.name,
                 streamer.describe())
    if streamer.device.type == "cpu":
        log.info("on a CPU, linear layers run plain F.linear (vLLM's packed CPU GEMMs cannot "
                 "read streamed weights)")
    else:
        graph_mode.split_pieces_at_layer_ops(worker.vllm_config)
    dump = envs.text("RINGFLOW_DUMP")
    if dump:
        streamer.stepper.on_forward_done = _dump_once(streamer, dump, worker)
    return streamer


def _resolve_layers(profile: Profile, decoder, vllm_config) -> list[int]:
    """The offloaded layers; ``{count: N}`` is placed by the planner from per-layer times
    estimated from each layer's weights: copy = bytes at 55 GB/s, compute = 2 x parameters x
    ``max_num_batched_tokens`` at 775 TFLOP/s (an estimate of a full prefill step, not a
    measurement; logged as such)."""
    from ringflow.orchestrator.placement import H2D_BYTES_PER_S, MATMUL_FLOP_PER_S, forward_ms
    from ringflow.orchestrator.sections import Placed

    spec = profile.offload
    if not isinstance(spec.layers, Placed):
        return spec.resolve(len(decoder), profile.source)
    tokens = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 2048
    sizes = [[(p.numel(), p.numel() * p.element_size()) for p in layer.parameters()]
             for layer in decoder]
    copy = [sum(b for _, b in layer) / H2D_BYTES_PER_S * 1e3 for layer in sizes]
    compute = [2 * sum(n for n, _ in layer) * tokens / MATMUL_FLOP_PER_S * 1e3 for layer in sizes]
    largest = max(sum(b for _, b in layer) for layer in sizes) or 1
    slots = max(1, min(spec.depth + 1, int(spec.workspace_mib * MIB // largest)))
    chosen = spec.resolve(len(decoder), profile.source, costs=(compute, copy), slots=slots)
    predicted = forward_ms(compute, copy, chosen, slots, spec.cross_forward)
    log.info("offload.layers {count: %d}: the planner placed layers %s (%d slot(s)); predicted "
             "forward %.2f ms vs %.2f ms all resident, from times estimated from the weights "
             "(copy at 55 GB/s, compute of %d tokens at 775 TFLOP/s), not measured",
             spec.layers.count, chosen, slots, predicted, sum(compute), tokens)
    return chosen


#: worker calls (0.34's) that change the KV cache's memory after it was sized: refused while a
#: ring of ringflow's is held too, not only while weights stream
RING_VERBS = ("discard", "extend_kv_cache", "set_kv_cache_reclaimable")


def on_engine_sleep(state: PluginState, original, core, level: int = 1, *args, **kwargs):
    """The hook on ``EngineCore.sleep``: vLLM pauses its scheduler before it asks the workers
    to sleep, so a refusal in the worker alone would leave the engine paused. Levels 1 and 2
    are refused here first, from the engine's config; level 0 (pause scheduling) moves no
    memory and runs."""
    if level >= 1:
        try:
            profile = state.profile(core.vllm_config)
        except RingflowError:  # the worker already refused this profile at load
            profile = None
        lane = profile is not None and getattr(profile, "experts", None) is not None
        if frontend.streams_weights(profile) or lane:
            what = "streams weights" if frontend.streams_weights(profile) else \
                "serves routed experts from host memory (experts)"
            exc = EngineError(f"sleep(level={level}) is not supported while ringflow {what} "
                              f"(profile '{profile.name}'): the ring and the pinned "
                              f"host copies would not follow it; sleep(level=0) pauses "
                              f"scheduling, reload_weights changes weights")
            log.error("%s", exc)
            raise exc
    return original(core, level, *args, **kwargs)


def on_reload_weights(state: PluginState, original, runner, *args, **kwargs):
    """The hook on a model runner's ``reload_weights`` (``LLM.collective_rpc("reload_weights",
    ...)``): the streamed layers' host copies take the new weights; the carried slots are
    re-filled from them before it returns (the next step may be a replay), the others are
    gathered by the step that reads them. Refused while an expert lane serves fp8 experts
    (``experts.refuse_quantized_reload``)."""
    experts.refuse_quantized_reload(state, runner)
    streamer = state.streamers.get(runner)
    if streamer is None:
        return original(runner, *args, **kwargs)
    with streamer.writing_weights("vLLM's reload_weights"):
        result = original(runner, *args, **kwargs)
    log.info("reload_weights: the %d streamed layers' host copies hold the new weights; the "
             "slots the next step reads first were re-filled from them before it runs (a "
             "captured graph's replay included), the others are gathered as it goes",
             len(streamer.offloaded))
    return result


def _follow_load_weights(streamer: WeightStreamer, model) -> None:
    """An in-place ``model.load_weights(iterator)`` (vLLM's reload calls it too) writes where
    the streamed layers' gathers read (an instance-level wrapper; the class is untouched)."""
    original = model.load_weights

    def load_weights(*args, **kwargs):
        with streamer.writing_weights("the model's load_weights"):
            return original(*args, **kwargs)

    model.load_weights = load_weights


def refusal(surface: surfaces.Surface):
    """The hook of a worker call that moves weights or memory where streaming (or a ring)
    does not follow: refused with one line while the worker streams weights (and, for
    :data:`RING_VERBS`, while it holds a ring), passed through otherwise."""
    verb = surface.path.rpartition(".")[2]

    def hook(state: PluginState, original, worker, *args, **kwargs):
        runner = getattr(worker, "model_runner", None)  # vLLM's workers may have none yet
        streams = runner is not None and state.streamers.get(runner) is not None
        lane = len(state.expert_lanes) > 0  # its slots and ring would keep the old experts
        rings = verb in RING_VERBS and state.ring_bytes() > 0
        if streams or lane or rings:
            what, section = (("ringflow streams weights", "offload") if streams else
                             ("ringflow serves routed experts from host memory", "experts")
                             if lane else ("ringflow holds a KV ring", "kv_prefetch"))
            exc = EngineError(f"{verb} is not supported while {what} (the ring and what it "
                              f"gathers from would not follow it); use reload_weights to "
                              f"change weights, or drop the profile's {section} section")
            log.error("%s", exc)
            raise exc
        return original(worker, *args, **kwargs)

    return hook


def _refuse_vllm_offloader(state: PluginState) -> None:
    get_offloader = compat.get(state, "vllm.model_executor.offloader.get_offloader")
    name = type(get_offloader()).__name__
    if name != "NoopOffloader":
        raise EngineError(f"vLLM's own weight offloader ({name}) is on: it and ringflow's "
                            f"offload section would both move the same layers' weights; turn "
                            f"one off (drop --offload-backend/--cpu-offload-gb, or the profile's "
                            f"offload section)")


def _dump_once(streamer: WeightStreamer, base: str, worker):
    def write() -> None:
        streamer.stepper.on_forward_done = None
        rank = getattr(worker, "rank", 0) or 0
        stem = dumps.dump_stem(base, dump_rank())
        stem = f"{stem}.rank{rank}" if rank else stem
        executor = streamer.executor
        ran = ("sync: every node on vLLM's stream, in plan order (the CPU has no streams)"
               if executor.kind == "sync" else None)
        try:
            dumps.write_files(streamer.dag, stem, executor=ran)
        except OutputError as exc:
            log.warning("RINGFLOW_DUMP: %s; the plan is not dumped", exc)
            return
        log.info("wrote the plan that ran to %s.json and %s.dot", stem, stem)

    return write
