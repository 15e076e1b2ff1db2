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

Errors in a profile stop vLLM at start-up with one ``ringflow: ...`` line in the log.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from pathlib import Path

import torch

from ringflow.errors import RingflowError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.vllm import attention, compat, layers, ops
from ringflow.integrations.vllm.config import ENV_PROFILE, profile_from  # noqa: F401 (re-export)
from ringflow.integrations.vllm.hooks import wrap
from ringflow.integrations.vllm.weight_stream import WeightStreamer
from ringflow.orchestrator import dumps
from ringflow.orchestrator.budget import MIB
from ringflow.orchestrator.profile import Profile

ENV_DUMP = "RINGFLOW_DUMP"
ENV_PLAIN_GEMM = "RINGFLOW_CPU_PLAIN_GEMM"
ENV_LAYER_OPS_ONLY = "RINGFLOW_LAYER_OPS_ONLY"

log = logging.getLogger("ringflow")

#: what happened in this process, in order ("kv-ring-allocated", "ring-allocated",
#: "kv-cache-initialized"): the order is what keeps the KV budget honest; tests assert it
lifecycle: list[str] = []
#: the live streamers of this process; each is owned by its vLLM worker and dies with it
streamers: weakref.WeakSet[WeightStreamer] = weakref.WeakSet()
_latest: weakref.ref | None = None
_plain_gemm = False


def _record(event: str) -> None:
    lifecycle.append(event)  # the module's list at call time: tests swap in their own


attention.record_lifecycle = _record  # the attention hooks report here without importing us


def register() -> None:
    """Install ringflow's hooks into vLLM. Safe to call more than once; inert until enabled."""
    try:
        from vllm.model_executor.layers import linear
        from vllm.v1.worker import gpu_worker
    except ImportError as exc:  # a vLLM this plugin does not know: say so, change nothing
        log.warning("ringflow: vLLM's worker or linear layers are not importable (%s); the "
                    "plugin stays off", exc)
        return
    _ensure_log_handler()
    compat.check_version()
    try:
        attention.install()
    except (ImportError, AttributeError) as exc:
        log.warning("ringflow: vLLM's attention layers are not where this plugin looks (%s); "
                    "full-KV prefetch stays off", exc)
    layers.install()
    wrap(gpu_worker.Worker, "load_model", _load_model)
    wrap(gpu_worker.Worker, "initialize_from_config", _initialize_from_config)
    wrap(linear.UnquantizedLinearMethod, "process_weights_after_loading", _keep_plain_weights)


def _ensure_log_handler() -> None:
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s ringflow: %(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _load_model(original, worker, *args, **kwargs):
    global _plain_gemm
    try:
        profile = profile_from(worker.vllm_config)
    except RingflowError as exc:
        log.error("%s", exc)
        raise
    attention.new_model_load()
    streaming = profile is not None and profile.offload is not None
    _plain_gemm = streaming or os.environ.get(ENV_PLAIN_GEMM) == "1"
    try:
        with layers.recording() as stacks:
            result = original(worker, *args, **kwargs)
    finally:
        _plain_gemm = False
    try:
        if streaming:
            _enable(worker, profile, stacks)
        elif os.environ.get(ENV_LAYER_OPS_ONLY) == "1":
            _layer_ops_only(worker, stacks)
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


def _layer_ops_only(worker, stacks) -> None:
    """Wrap the decoder layers in ringflow's layer ops (splitting vLLM's pieces there, as
    streaming does) with nothing streamed: the same compiled partition, for A/B baselines."""
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    worker._ringflow_boundaries = stub = _NothingStreamed()  # the worker keeps it alive
    handle = ops.register_stepper(stub)
    for index, layer in enumerate(decoder):
        ops.wrap_layer(layer, handle, index)
    if any(p.is_cuda for p in decoder[0].parameters()):  # as streaming does (see _enable)
        _split_pieces_at_layer_ops(worker.vllm_config)
    log.info("%s=1: %d decoder layers run between ringflow's layer ops; nothing is streamed",
             ENV_LAYER_OPS_ONLY, len(decoder))


def _keep_plain_weights(original, method, layer, *args, **kwargs):
    if _plain_gemm:
        # vLLM's CPU path honours this flag: plain F.linear over layer.weight, no repacking
        layer._cpu_skip_gemm_dispatch = True
    return original(method, layer, *args, **kwargs)


def _initialize_from_config(original, worker, *args, **kwargs):
    streamer = getattr(worker, "_ringflow_streamer", None)
    reserved = (streamer.reserved_bytes if streamer is not None else 0) + \
        sum(model.reserved_bytes for model in attention.models())
    if reserved:
        _record("kv-cache-initialized")
        log.info("KV cache allocated after ringflow's rings (%.2f MiB reserved before sizing)",
                 reserved / MIB)
        _log_kv_size(worker, streamer, *args, **kwargs)
    attention.kv_cache_sized()
    result = original(worker, *args, **kwargs)
    layer_ops = streamer is not None or getattr(worker, "_ringflow_boundaries", None) is not None
    if reserved or layer_ops:
        _log_graph_mode(worker.vllm_config, layer_ops)
    return result


def _log_graph_mode(vllm_config, layer_ops: bool) -> None:
    """The CUDA graph mode vLLM settled on (it may downgrade the one asked for when the
    attention backend cannot capture it)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    split = [op for op in ops.OP_NAMES if op in (getattr(compilation, "splitting_ops", None)
                                                  or [])]
    where = ("; ringflow's layer ops split its graph into pieces" if split else
             "; ringflow's layer ops stay inside its compiled graph") if layer_ops else ""
    log.info("vLLM runs cudagraph_mode=%s, compilation mode %s%s", getattr(mode, "name", mode),
             getattr(getattr(compilation, "mode", None), "name", "?"), where)


def _log_kv_size(worker, streamer, kv_cache_config=None, *args, **kwargs) -> None:
    """What vLLM's own sizing gave the KV cache, and the part ringflow's saving bought."""
    config = kv_cache_config if kv_cache_config is not None else kwargs.get("kv_cache_config")
    try:
        block = config.kv_cache_groups[0].kv_cache_spec.block_size
        sized = config.num_blocks * block
    except (AttributeError, IndexError, TypeError):
        return
    saved = getattr(streamer, "saved_bytes", None)
    available = getattr(worker, "available_kv_cache_memory_bytes", None)
    bought = ""
    if saved is not None and isinstance(available, int) and available > 0:
        without = int(config.num_blocks * max(available - saved, 0) / available) * block
        bought = (f"; without ringflow's measured saving of {saved / MIB:.2f} MiB it would "
                  f"have been {without:,} ({sized - without:+,} tokens)")
    log.info("vLLM sized the KV cache at %d blocks x %d = %s tokens%s", config.num_blocks,
             block, f"{sized:,}", bought)


def latest() -> WeightStreamer | None:
    """The most recently built streamer of this process that is still alive."""
    return None if _latest is None else _latest()


def kv_bytes_per_token(worker) -> float | None:
    """Bytes one token takes in the KV cache across all attention layers (None if unknown)."""
    try:
        specs = worker.model_runner.get_kv_cache_spec()
        return sum(spec.page_size_bytes / spec.block_size for spec in specs.values()) or None
    except Exception as exc:  # an engine version without the spec API: report, do not fail
        log.info("KV bytes per token unknown (%s)", exc)
        return None


def _enable(worker, profile: Profile, stacks) -> WeightStreamer:
    _refuse_vllm_offloader()
    decoder = layers.decoder_layers(worker.model_runner.get_model(), stacks)
    offload = profile.offload.resolve(len(decoder), profile.source)
    on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in decoder[0].parameters())
    before = torch.cuda.memory_allocated() if on_gpu else 0
    streamer = WeightStreamer(
        decoder, offload, depth=profile.offload.depth,
        workspace_bytes=int(profile.offload.workspace_mib * MIB), capture=profile.capture,
        gather_priority=profile.gather_priority, poison=poison_default(), name=profile.name,
        cross_forward=profile.offload.cross_forward, synchronous=profile.offload.synchronous)
    global _latest
    worker._ringflow_streamer = streamer  # the worker owns it: it lives and dies with the model
    streamers.add(streamer)
    _latest = weakref.ref(streamer)
    _record("ring-allocated")
    per_token = kv_bytes_per_token(worker)
    tokens = (lambda nbytes: f"{int(nbytes // per_token):,} KV tokens ({per_token:,.0f} B/token)"
              ) if per_token else (lambda nbytes: "an unknown number of KV tokens")
    if on_gpu:
        streamer.saved_bytes = before - torch.cuda.memory_allocated()  # measured, not estimated
        credited = _credit_weights_memory(worker, streamer.saved_bytes)
        runner = type(worker.model_runner)
        log.info("profile '%s': %s; allocated before the KV cache is sized; device memory "
                 "%s by %.2f MiB (offloaded weights freed minus the ring)%s, worth %s",
                 profile.name, streamer.describe(),
                 "fell" if streamer.saved_bytes >= 0 else "grew", abs(streamer.saved_bytes) / MIB,
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
    dump = os.environ.get(ENV_DUMP)
    if dump:
        streamer.stepper.on_forward_done = _dump_once(streamer, dump, worker)
    return streamer


def _credit_weights_memory(worker, saved: int) -> bool:
    """vLLM measured the model's weights when loading returned, before streaming freed some:
    subtract what streaming saved, so the KV budget it computes next includes it."""
    runner = worker.model_runner
    if not isinstance(getattr(runner, "model_memory_usage", None), (int, float)):
        return False
    runner.model_memory_usage -= saved
    return True


def _refuse_vllm_offloader() -> None:
    from vllm.model_executor.offloader import get_offloader
    name = type(get_offloader()).__name__
    if name != "NoopOffloader":
        raise RingflowError(f"vLLM's own weight offloader ({name}) is on: it and ringflow's "
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
        for name in ops.OP_NAMES:
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
            Path(f"{stem}.json").write_text(dumps.to_json(streamer.dag))
            Path(f"{stem}.dot").write_text(dumps.to_dot(streamer.dag))
        except OSError as exc:
            log.warning("RINGFLOW_DUMP: cannot write %s.json/.dot (%s)", stem, exc)
            return
        log.info("wrote the plan that ran to %s.json and %s.dot", stem, stem)

    return write
