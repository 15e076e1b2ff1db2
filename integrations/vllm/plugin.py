"""The vLLM plugin (entry point group ``vllm.general_plugins``, name ``ringflow``).

vLLM calls :func:`register` in every process it starts (the front end, the engine core, each
worker; multiprocessing on or off). It installs three class-level hooks and nothing else; they
do nothing unless a profile is given, by ``RINGFLOW_PROFILE`` (a path or built-in name) or by
``additional_config={"ringflow": {...}}`` (a profile mapping, or ``{"profile": "path"}``):

* ``Worker.load_model``: after the model is loaded, and before vLLM profiles memory and sizes
  the KV cache, builds a :class:`WeightStreamer` for the profile's ``offload`` layers: their
  weights move to pinned host memory, the ring of layer-slots is allocated, and the log says
  what it reserved and how many KV tokens that costs.
* ``Worker.initialize_from_config``: records that the KV cache is being allocated (the order
  of these events is what makes the KV budget honest; tests assert it).
* ``UnquantizedLinearMethod.process_weights_after_loading``: on a CPU, vLLM repacks linear
  weights into oneDNN handles that cannot be streamed; while ringflow is enabled the linear
  layers keep plain weights (``F.linear``). ``RINGFLOW_CPU_PLAIN_GEMM=1`` does the same
  without ringflow, for A/B comparisons with identical kernels.

``VllmConfig.compute_hash`` also carries the profile and the switches that change the traced
model, so vLLM's compile cache never serves a graph traced under another setting (Note
[Compile-cache key] in ``cache_key.py``).

Errors in a profile stop vLLM at start-up with one ``ringflow: ...`` line in the log.
"""

from __future__ import annotations

import logging
import sys

import torch

from ringflow import envs
from ringflow.errors import BudgetError, EngineError, OutputError, ProfileError, RingflowError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.torch import layer_ops
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.integrations.vllm import attention, cache_key, compat, frontend, layers, memory
from ringflow.integrations.vllm.config import profile_from
from ringflow.integrations.vllm.hooks import wrap
from ringflow.integrations.vllm.state import STATE, PluginState
from ringflow.orchestrator import dumps
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB, mib

log = logging.getLogger("ringflow")


def register() -> None:
    """Install ringflow's hooks into vLLM. Safe to call more than once; inert until enabled."""
    try:
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers import linear
        from vllm.v1.worker import gpu_worker
    except ImportError as exc:  # a vLLM this plugin does not know: say so, change nothing
        log.warning("ringflow: vLLM's worker or linear layers are not importable (%s); the "
                    "plugin stays off", exc)
        return
    _ensure_log_handler()
    compat.check_version()
    wrap(VllmConfig, "compute_hash", cache_key.on_compute_hash, STATE)  # first: a correctness key
    wrap(EngineArgs, "create_engine_config", frontend.on_create_engine_config, STATE)
    try:
        attention.install(STATE)
    except (ImportError, AttributeError) as exc:
        log.warning("ringflow: vLLM's attention layers are not where this plugin looks (%s); "
                    "full-KV prefetch stays off", exc)
    layers.install(STATE)
    wrap(gpu_worker.Worker, "load_model", on_load_model, STATE)
    for runner in compat.model_runner_classes():
        if hasattr(runner, "reload_weights"):
            wrap(runner, "reload_weights", on_reload_weights, STATE)
    for verb in REFUSED_WHILE_STREAMING:
        if hasattr(gpu_worker.Worker, verb):
            wrap(gpu_worker.Worker, verb, refused_while_streaming(verb), STATE)
    engine_core = compat.engine_core_class()
    if engine_core is not None and hasattr(engine_core, "sleep"):
        wrap(engine_core, "sleep", on_engine_sleep, STATE)
    wrap(gpu_worker.Worker, "initialize_from_config", on_initialize_from_config, STATE)
    wrap(linear.UnquantizedLinearMethod, "process_weights_after_loading", _keep_plain_weights,
         STATE)


class _VllmLogHandler(logging.Handler):
    """ringflow's records through vLLM's own handlers (its format: process, time, file; its
    level and stream), each message marked ``ringflow:``; ``LEVEL ringflow: message`` on stderr
    where vLLM has configured none."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._plain = logging.StreamHandler(sys.stderr)
        self._plain.setFormatter(logging.Formatter("%(levelname)s ringflow: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers
        if not handlers:
            self._plain.handle(record)
            return
        marked = logging.makeLogRecord(record.__dict__)
        marked.msg, marked.args = f"ringflow: {record.getMessage()}", None
        for handler in handlers:
            if marked.levelno >= handler.level:
                handler.handle(marked)


def _ensure_log_handler() -> None:
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, _VllmLogHandler) for h in log.handlers) and \
            not logging.getLogger().handlers:
        log.addHandler(_VllmLogHandler())
        log.propagate = False


def on_load_model(state: PluginState, original, worker, *args, **kwargs):
    """The hook on ``Worker.load_model``: vLLM loads the model (recording its decoder stacks,
    linear layers kept plain where streaming needs it), then streaming is enabled, before vLLM
    profiles memory and sizes the KV cache."""
    try:
        profile = profile_from(worker.vllm_config)
        layer_ops_only = envs.flag("RINGFLOW_LAYER_OPS_ONLY")
        plain = envs.flag("RINGFLOW_CPU_PLAIN_GEMM")
        streaming = frontend.streams_weights(profile)
        if getattr(worker.vllm_config, "lora_config", None) is not None:
            frontend.refuse_lora(profile)  # the front end refuses it first, where it runs
    except RingflowError as exc:
        log.error("%s", exc)
        raise
    state.new_model_load()
    if layer_ops_only and profile is not None and profile.offload is not None:
        log.info("RINGFLOW_LAYER_OPS_ONLY=1: profile '%s''s offload section is not streamed "
                 "(the layer ops run with nothing moved, as the switch says)", profile.name)
    with state.loading_with_plain_weights(streaming or plain), layers.recording() as stacks:
        result = original(worker, *args, **kwargs)
    try:
        if streaming:
            _enable(state, worker, profile, stacks)
        elif layer_ops_only:
            _layer_ops_only(worker, stacks, profile)
    except RingflowError as exc:
        log.error("%s", exc)  # one clear line before vLLM's own start-up failure
        raise
    return result


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


def _layer_ops_only(worker, stacks, profile: Profile | None) -> None:
    """Wrap decoder layers in ringflow's layer ops (splitting vLLM's pieces there, as
    streaming does) with nothing streamed: the same compiled partition, for A/B baselines."""
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    worker._ringflow_boundaries = stub = _NothingStreamed()  # the worker keeps it alive
    handle = layer_ops.register_stepper(stub)
    wrapped = ops_only_layers(profile, decoder, worker.vllm_config)
    for index in wrapped:
        layer_ops.wrap_layer(decoder[index], handle, index)
    if any(p.is_cuda for p in decoder[0].parameters()):  # as streaming does (see _enable)
        _split_pieces_at_layer_ops(worker.vllm_config)
    log.info("RINGFLOW_LAYER_OPS_ONLY=1: %d of %d decoder layers run between ringflow's layer "
             "ops (%s); nothing is streamed", len(wrapped), len(decoder),
             "every layer: the profile has no offload section"
             if profile is None or profile.offload is None
             else "the first, the last and the offloaded ones, as streaming would")


def _keep_plain_weights(state: PluginState, original, method, layer, *args, **kwargs):
    if state.plain_weights:
        # vLLM's CPU path honours this flag: plain F.linear over layer.weight, no repacking
        layer._cpu_skip_gemm_dispatch = True
    return original(method, layer, *args, **kwargs)


def on_initialize_from_config(state: PluginState, original, worker, *args, **kwargs):
    """The hook on ``Worker.initialize_from_config`` (vLLM allocates the KV cache): from here on
    no ring may be allocated (the KV budget would lie); the log says what the rings took."""
    streamer = getattr(worker, "_ringflow_streamer", None)
    reserved = (streamer.reserved_bytes if streamer is not None else 0) + \
        sum(model.reserved_bytes for model in attention.models(state)) + \
        sum(model.reserved_bytes for model in state.context_models.values())
    if reserved:
        state.record("kv-cache-initialized")
        log.info("KV cache allocated after ringflow's rings (%s reserved before sizing)",
                 mib(reserved))
        memory.log_kv_size(worker, streamer, *args, **kwargs)
    state.kv_sized = True
    result = original(worker, *args, **kwargs)
    wrapped = streamer is not None or getattr(worker, "_ringflow_boundaries", None) is not None
    if reserved or wrapped:
        _log_graph_mode(worker.vllm_config, wrapped)
    return result


def _log_graph_mode(vllm_config, has_layer_ops: bool) -> None:
    """The CUDA graph mode vLLM settled on (it may downgrade the one asked for when the
    attention backend cannot capture it)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    split = [op for op in layer_ops.OP_NAMES
             if op in (getattr(compilation, "splitting_ops", None) or [])]
    level = getattr(getattr(compilation, "mode", None), "name", "?")
    if not has_layer_ops:
        where = ""
    elif level == "NONE":
        where = "; nothing is compiled, ringflow's layer ops run eagerly between the layers"
    else:
        where = ("; ringflow's layer ops split its graph into pieces" if split else
                 "; ringflow's layer ops stay inside its compiled graph")
    log.info("vLLM runs cudagraph_mode=%s, compilation mode %s%s", getattr(mode, "name", mode),
             level, where)


def _enable(state: PluginState, worker, profile: Profile, stacks) -> WeightStreamer:
    _refuse_vllm_offloader()
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    offload = _resolve_layers(profile, decoder, worker.vllm_config)
    on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in decoder[0].parameters())
    before = torch.cuda.memory_allocated() if on_gpu else 0
    try:
        streamer = WeightStreamer(
            decoder, offload, depth=profile.offload.depth,
            workspace_bytes=int(profile.offload.workspace_mib * MIB), capture=profile.capture,
            gather_priority=profile.gather_priority, poison=poison_default(), name=profile.name,
            cross_forward=profile.offload.cross_forward, synchronous=profile.offload.synchronous)
    except BudgetError as exc:  # the profile's budget: name its field
        raise ProfileError("offload.workspace_mib", str(exc), profile.source) from exc
    worker._ringflow_streamer = streamer  # the worker owns it: it lives and dies with the model
    worker.model_runner._ringflow_streamer = streamer  # reload_weights is the runner's
    _follow_load_weights(streamer, worker.model_runner.get_model())
    state.add_streamer(streamer)
    state.record("ring-allocated")
    per_token = memory.kv_bytes_per_token(worker)
    tokens = (lambda nbytes: f"{int(nbytes // per_token):,} KV tokens ({per_token:,.0f} B/token)"
              ) if per_token else (lambda nbytes: "an unknown number of KV tokens")
    if on_gpu:
        streamer.saved_bytes = before - torch.cuda.memory_allocated()  # measured, not estimated
        credited = memory.credit_weights_memory(worker, streamer.saved_bytes)
        runner = type(worker.model_runner)
        log.info("profile '%s': %s; allocated before the KV cache is sized; device memory "
                 "%s by %s (offloaded weights freed minus the ring)%s, worth %s",
                 profile.name, streamer.describe(),
                 "fell" if streamer.saved_bytes >= 0 else "grew", mib(abs(streamer.saved_bytes)),
                 f", credited to {runner.__module__}.{runner.__qualname__}'s weights memory "
                 f"before it sizes the KV cache" if credited
                 else " (vLLM's weights memory figure not found: not credited)",
                 tokens(abs(streamer.saved_bytes)))
    else:
        log.info("profile '%s': %s; allocated before the KV cache is sized, it costs %s",
                 profile.name, streamer.describe(), tokens(streamer.reserved_bytes))
    if streamer.device.type == "cpu":
        log.info("on a CPU, linear layers run plain F.linear (vLLM's packed CPU GEMMs cannot "
                 "read streamed weights)")
    else:
        _split_pieces_at_layer_ops(worker.vllm_config)
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


#: worker calls that move or replace weights in ways streaming does not follow (yet): refused
#: with one line while the worker streams (Note [Weights that change] in weight_stream.py)
REFUSED_WHILE_STREAMING = ("sleep", "wake_up", "init_weight_transfer_engine",
                           "start_weight_update", "start_draft_weight_update", "update_weights")


def on_engine_sleep(state: PluginState, original, core, level: int = 1, *args, **kwargs):
    """The hook on ``EngineCore.sleep``: vLLM pauses its scheduler before it asks the workers
    to sleep, so a refusal in the worker alone would leave the engine paused. Levels 1 and 2
    are refused here first, from the engine's config; level 0 (pause scheduling) moves no
    memory and runs."""
    if level >= 1:
        try:
            profile = profile_from(core.vllm_config)
        except RingflowError:  # the worker already refused this profile at load
            profile = None
        if frontend.streams_weights(profile):
            exc = EngineError(f"sleep(level={level}) is not supported while ringflow streams "
                              f"weights (profile '{profile.name}'): the ring and the pinned "
                              f"host copies would not follow it; sleep(level=0) pauses "
                              f"scheduling, reload_weights changes weights")
            log.error("%s", exc)
            raise exc
    return original(core, level, *args, **kwargs)


def on_reload_weights(state: PluginState, original, runner, *args, **kwargs):
    """The hook on a model runner's ``reload_weights`` (``LLM.collective_rpc("reload_weights",
    ...)``): the streamed layers' host copies take the new weights and every slot is
    re-gathered by the next forward."""
    streamer = getattr(runner, "_ringflow_streamer", None)
    if streamer is None:
        return original(runner, *args, **kwargs)
    with streamer.writing_weights("vLLM's reload_weights"):
        result = original(runner, *args, **kwargs)
    log.info("reload_weights: the %d streamed layers' host copies hold the new weights; the "
             "next forward gathers every slot again", len(streamer.offloaded))
    return result


def _follow_load_weights(streamer: WeightStreamer, model) -> None:
    """An in-place ``model.load_weights(iterator)`` (vLLM's reload calls it too) writes where
    the streamed layers' gathers read (an instance-level wrapper; the class is untouched)."""
    original = model.load_weights

    def load_weights(*args, **kwargs):
        with streamer.writing_weights("the model's load_weights"):
            return original(*args, **kwargs)

    model.load_weights = load_weights


def refused_while_streaming(verb: str):
    def hook(state: PluginState, original, worker, *args, **kwargs):
        if getattr(worker, "_ringflow_streamer", None) is not None:
            exc = EngineError(f"{verb} is not supported while ringflow streams weights (the "
                              f"ring and the pinned host copies would not follow it); use "
                              f"reload_weights to change weights, or drop the profile's "
                              f"offload section")
            log.error("%s", exc)
            raise exc
        return original(worker, *args, **kwargs)

    return hook


def _refuse_vllm_offloader() -> None:
    from vllm.model_executor.offloader import get_offloader
    name = type(get_offloader()).__name__
    if name != "NoopOffloader":
        raise EngineError(f"vLLM's own weight offloader ({name}) is on: it and ringflow's "
                            f"offload section would both move the same layers' weights; turn "
                            f"one off (drop --offload-backend/--cpu-offload-gb, or the profile's "
                            f"offload section)")


def _split_pieces_at_layer_ops(vllm_config) -> None:
    """Where vLLM splits its compiled graph into pieces (piecewise CUDA graphs), ringflow's
    layer ops split it too, so they run eagerly between pieces and no piece captures a side
    stream it does not join. Where vLLM does not split (full graphs only, or no compilation),
    the ops stay inside its graph: the partition is vLLM's own."""
    compilation = getattr(vllm_config, "compilation_config", None)
    ops_list = getattr(compilation, "splitting_ops", None)
    if isinstance(ops_list, list) and ops_list:
        for name in layer_ops.OP_NAMES:
            if name not in ops_list:
                ops_list.append(name)
        log.info("ringflow layer ops added to vLLM's splitting_ops (it splits its graph into "
                 "pieces at %d ops)", len(ops_list))


def _dump_once(streamer: WeightStreamer, base: str, worker):
    def write() -> None:
        streamer.stepper.on_forward_done = None
        rank = getattr(worker, "rank", 0) or 0
        stem = base[:-5] if base.endswith(".json") else base
        stem = f"{stem}.rank{rank}" if rank else stem
        try:
            dumps.write_files(streamer.dag, stem)
        except OutputError as exc:
            log.warning("RINGFLOW_DUMP: %s; the plan is not dumped", exc)
            return
        log.info("wrote the plan that ran to %s.json and %s.dot", stem, stem)

    return write
