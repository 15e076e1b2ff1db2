"""Attention hooks: full-KV prefetch for whichever attention backend vLLM picked, unforked.

Enabled by a profile with a ``kv_prefetch`` section. What the hooks do, in vLLM's order:

* model construction (``Attention.__init__`` / ``MLAAttention.__init__``, when the backend's
  implementation is built): the first decoder attention layer of a model allocates that
  model's rings, one per micro-batch (two under DBO), before vLLM sizes the KV cache. Each
  model load (``BaseModelLoader.load_model``) is its own group, so a speculative-decoding draft
  model never shares a lane with its target.
* metadata (every backend's metadata builder, ``build*`` and ``update_block_table``): the
  backend-neutral metadata each backend's own was built from is kept on the result, so any
  backend's layers can be gathered (``metadata.py``).
* each step: before a layer's KV update or attention (whichever comes first) the lane waits for
  that layer's gather and issues the gathers its plan puts there (layer ``l + depth`` and any
  slot that retired); after the attention the slot retires. The layer reads the cache as
  before; the slot is offered to consumers through :func:`gathered_kv` and, in verification
  mode, checked against the cache (and, for MLA, the backend's output against a reference
  attention over the slot).
* ``initialize_kv_cache`` (vLLM binds, re-binds or resizes its caches): every lane retires its
  per-step state (``KVPrefetcher.retire``).

Layouts: MLA caches (``[blocks, block_size, latent + rope]``) are gathered token by token. Other
attention caches are block-major with a page interior private to the backend (vLLM 0.32's
logical ``[blocks, heads, tokens, content]``, which CPU_ATTN packs for its kernels): they are
gathered page by page, sized from the layer's own KV spec. A cache whose pages are not
contiguous blocks is left alone with one log line.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable

import torch

from ringflow.errors import BudgetError, ConfigError, ProfileError, RingflowError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.torch.kv_prefetch import (KVLayout, KVPrefetcher, KVSource,
                                                    check_not_after_kv)
from ringflow.integrations.vllm import compat, context_attach, mla_check, startup_errors, surfaces
from ringflow.integrations.vllm.dcp import dcp_group
from ringflow.integrations.vllm.metadata import (common_for, context_lens, hook_builder,
                                                 metadata_for)
from ringflow.integrations.vllm.state import STATE, PluginState
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB, mib

log = logging.getLogger("ringflow")


class ModelLanes:
    """One model's attention layers, in construction (= execution) order, and its lanes.

    Raises:
        ProfileError: the profile's ``kv_prefetch`` section asks for a ring its budget cannot
            hold (the lane's own error is the cause).
    """

    def __init__(self, state: PluginState, key: int, profile: Profile, layout: KVLayout, view,
                 vllm_config, name: str) -> None:
        spec = profile.kv_prefetch
        scheduler, model = vllm_config.scheduler_config, vllm_config.model_config
        self.state = state
        self.key, self.layout, self.view, self.name = key, layout, view, name
        self.max_model_len = model.max_model_len
        self.names: list[str] = []
        self.layers: list[weakref.ref] = []
        capacity = spec.capacity_tokens or scheduler.max_num_seqs * model.max_model_len
        ubatches = 2 if getattr(vllm_config.parallel_config, "enable_dbo", False) else 1
        device = _device(vllm_config)
        self.connector: bool | None = None  # a KV connector in use (known at the first step)
        try:
            self.lanes = [  # each lane gathers over a DCP communicator of its own
                KVPrefetcher(layout, capacity, max_requests=scheduler.max_num_seqs,
                             depth=spec.depth, workspace_bytes=int(spec.workspace_mib * MIB),
                             device=device, dcp=dcp_group(vllm_config, spec.dcp_transport),
                             verify=spec.verify, capture=profile.capture,
                             gather_priority=profile.gather_priority, poison=poison_default(),
                             name=f"{name}/ubatch{u}", lane=f"kv{u}")
                for u in range(ubatches)]
        except BudgetError as exc:
            raise ProfileError("kv_prefetch.workspace_mib", str(exc), profile.source) from exc
        except ConfigError as exc:  # a slot of no token
            raise ProfileError("kv_prefetch.capacity_tokens", str(exc), profile.source) from exc
        self.attention_checked = 0
        self.attention_max_error = 0.0

    @property
    def reserved_bytes(self) -> int:
        return sum(lane.reserved_bytes for lane in self.lanes)

    def lane(self) -> KVPrefetcher | None:
        ubatch = self.state.steps.ubatch()
        if ubatch < len(self.lanes):
            return self.lanes[ubatch]
        self.state.log_once(f"ubatch{ubatch}", "micro-batch %d has no full-KV lane (DBO was off "
                            "when the model was built); it runs without prefetch", ubatch)
        return None


def attached(state: PluginState, layer) -> bool:
    """Whether ``layer`` joined a model's full-KV lanes or context ring."""
    return layer in state.kv_layers or any(
        layer is ref() for model in state.context_models.values() for ref in model.layers)


def models(state: PluginState = STATE) -> list[ModelLanes]:
    """The models of this process that have full-KV lanes (``consumer: full_kv_check``)."""
    return list(state.models.values())


def gathered_kv(layer, state: PluginState = STATE) -> torch.Tensor | None:
    """The prefetched full context KV of attention ``layer`` while its attention runs.

    Rows: ``[capacity, *row]``, requests packed in batch order, each with its context tokens
    (sequence length minus the step's new tokens); the rest zero. Under DCP each request starts
    at a multiple of ``dcp_size * interleave`` rows (``KVPrefetcher.request_starts``). None
    when this step has no prefetched KV for the layer (not enabled, step too large, or inside
    a retired step).
    """
    owner = state.kv_layers.get(layer)
    if owner is None:
        return None
    lanes, index = owner
    lane = lanes.lane()
    return None if lane is None else lane.gathered(index)


# -- hooks (installed from the table of surfaces, surfaces.py) ----------------------------------

def load_model_group(state: PluginState, original, loader, *args, **kwargs):
    with state.model_load():
        return original(loader, *args, **kwargs)


def on_initialize_kv_cache(state: PluginState, original, runner, *args, **kwargs):
    """The hook on a model runner's ``initialize_kv_cache`` (vLLM binds, re-binds or resizes
    its caches): every lane of every model retires its step first, while the old caches are
    still there (a step in flight may have gathers reading them)."""
    for model in state.models.values():
        for lane in model.lanes:
            lane.retire("the KV cache is (re)bound")
    for context in state.context_models.values():
        if context.ring.in_step:
            context.ring.abandon("the KV cache is (re)bound")
    return original(runner, *args, **kwargs)


# -- attaching layers ---------------------------------------------------------------------------

def after_attention_init(state: PluginState, original, layer, *args, **kwargs):
    """The hook on ``Attention.__init__`` and ``MLAAttention.__init__``: vLLM built a layer;
    with a ``kv_prefetch`` profile it joins its model's lanes or context ring."""
    original(layer, *args, **kwargs)
    if layer in state.kv_layers:
        return
    current = compat.get(state, "vllm.config.get_current_vllm_config_or_none")
    config = current() if current is not None else None
    if config is None:
        return
    try:
        profile = state.profile(config)
    except RingflowError:  # the worker's load_model hook reports it, once
        return
    if profile is None or profile.kv_prefetch is None:
        return
    try:
        compat.require(state, surfaces.needed(profile),
                       f"profile '{profile.name}' ({profile.source})")
        resolve_step_functions(state)
        if profile.kv_prefetch.consumer == "context":
            context_attach.attach(state, layer, profile, config)
        else:
            attach(state, layer, profile, config)
    except RingflowError as exc:
        startup_errors.fail(exc)  # one line, last (Note [One line at start-up])


def attach(state: PluginState, layer, profile: Profile, config) -> None:
    """Give attention ``layer`` (just built) its model's lanes: the model's first layer
    allocates them (before the KV cache is sized, or a LifecycleError), later ones join.

    Raises:
        LifecycleError: the model's first layer comes after the KV cache was sized.
        ProfileError: the profile's ring does not fit its budget.
    """
    found = _layout_of(state, layer, config)
    if found is None:
        return
    layout, view = found
    key = state.model_group.get()
    model = state.models.get(key)
    if model is None:
        check_not_after_kv(state.kv_sized, f"model group {key}")
        model = ModelLanes(state, key, profile, layout, view, config,
                           name=f"{profile.name}/model{key}")
        state.models[key] = model
        state.record("kv-ring-allocated")
        log.info("%s; allocated when the attention implementation was built, before the KV "
                 "cache is sized (%s)", "; ".join(lane.describe() for lane in model.lanes),
                 mib(model.reserved_bytes))
    elif model.layout != layout:
        state.log_once(f"layout:{layer.layer_name}", "attention layer %s has a KV layout unlike "
                       "its model's first layer; it runs without full-KV prefetch",
                       layer.layer_name)
        return
    hook_builder(state, compat.metadata_builder_class(layer))
    index = len(model.names)
    model.names.append(layer.layer_name)
    model.layers.append(weakref.ref(layer))
    state.kv_layers[layer] = (model, index)
    _hook_layer(layer, model, index)


def _layout_of(state: PluginState, layer, config) -> tuple[KVLayout, Callable] | None:
    """MLA: token rows of ``kv_lora_rank + qk_rope_head_dim``. Any other decoder attention:
    whole pages of the size its own KV spec states (the interior is the backend's business)."""
    block_size = config.cache_config.block_size
    if hasattr(layer, "kv_lora_rank"):
        if getattr(layer, "kv_cache_dtype", "auto") != "auto":
            state.log_once("mla-dtype", "full-KV prefetch supports MLA caches in the model "
                           "dtype only (kv_cache_dtype=auto); it stays off")
            return None
        row = layer.kv_lora_rank + layer.qk_rope_head_dim
        return KVLayout("rows", (row,), config.model_config.dtype, block_size), _identity
    kinds = compat.get(state, "vllm.v1.attention.backend.AttentionType")
    if kinds is None or getattr(layer, "attn_type", kinds.DECODER) != kinds.DECODER:
        return None
    dtype = getattr(layer, "kv_cache_torch_dtype", config.model_config.dtype)
    try:
        spec = layer.get_kv_cache_spec(config)
        page_bytes, block_size = spec.page_size_bytes, spec.block_size
    except Exception as exc:  # a layer without a KV spec: say so once, change nothing
        state.log_once(f"spec:{type(layer).__name__}", "cannot read the KV spec of %s (%s); "
                       "full-KV prefetch stays off for it", type(layer).__name__, exc)
        return None
    if page_bytes % dtype.itemsize:
        return None
    return (KVLayout("pages", (page_bytes // dtype.itemsize,), dtype, block_size),
            _pages_view(state, layer, block_size))


def _identity(cache: torch.Tensor) -> torch.Tensor:
    return cache


def _pages_view(state: PluginState, layer, block_size: int
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``cache -> [blocks, *page]``, a view. Backends put the block axis where they like
    (FLASH_ATTN: ``[2, blocks, ...]``, K and V planes first); the backend's own
    ``get_kv_cache_shape`` for an odd block count says which axis it is."""
    probe = 7919
    try:
        shape = layer.attn_backend.get_kv_cache_shape(probe, block_size, layer.num_kv_heads,
                                                      layer.head_size)
        axis = list(shape).index(probe)
    except Exception as exc:  # a backend that cannot say: blocks first, as most are (logged)
        backend = getattr(layer, "attn_backend", None)
        state.log_once(f"axis:{backend!r}", "attention backend %s cannot say where the block "
                       "axis of its KV cache is (%s); full-KV prefetch assumes blocks first",
                       getattr(backend, "__name__", backend), exc)
        axis = 0
    return (lambda cache: cache) if axis == 0 else (lambda cache: cache.movedim(axis, 0))


_MLA_LAYER = "vllm.model_executor.layers.attention.mla_attention.MLAAttention"
_IMPL = "vllm.v1.attention.backend.AttentionImpl"


def _hook_layer(layer, model: ModelLanes, index: int) -> None:
    """Instance-level wrappers: the backend class and every other layer stay untouched. Each
    is a surface of the table: where its parameters changed, the layer runs without
    prefetch (``compat.instance_ok`` says so once)."""
    if hasattr(layer, "kv_lora_rank"):
        targets = [(layer, "update_kv_cache", False, f"{_MLA_LAYER}.update_kv_cache"),
                   (layer, "forward_impl", True, f"{_MLA_LAYER}.forward_impl")]
    else:
        targets = [(layer.impl, "do_kv_cache_update", False, None),
                   (layer.impl, "forward", True, f"{_IMPL}.forward")]
    if not all(key is None or not hasattr(owner, name)
               or compat.instance_ok(model.state, key, type(owner))
               for owner, name, _, key in targets):
        return
    for owner, name, is_attention, _ in targets:
        original = getattr(owner, name, None)
        if original is not None:
            setattr(owner, name, _layer_hook(original, model, index, is_attention))


def _layer_hook(original, model: ModelLanes, index: int, is_attention: bool):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        lane = _begin(model, index)
        if lane is None or not is_attention:
            return original(*args, **kwargs)
        try:
            result = original(*args, **kwargs)
            if lane.verify and lane.dcp is None and hasattr(model.layers[index](), "kv_lora_rank"):
                _check_output(model, lane, index, args, kwargs)
        finally:
            lane.end(index)
        return result

    return hooked


def _begin(model: ModelLanes, index: int) -> KVPrefetcher | None:
    steps = model.state.steps
    if not steps.context_available():
        return None
    context = steps.context()
    if context.attn_metadata is None:  # profiling and dummy runs: nothing to gather
        return None
    if model.connector is None:
        model.connector = _has_kv_connector(model.state)
        if model.connector:
            model.state.log_once("connector", "a KV connector loads KV layer by layer inside the "
                            "attention op, after the gather was issued; full-KV prefetch "
                            "stays off")
    if model.connector:
        return None
    lane = model.lane()
    if lane is None:
        return None
    lane.plan(len(model.names))
    # sources matter only where a step starts: no per-layer closure on the hot path
    lane.begin(index, _step_sources(model, context) if index == 0 else _no_sources)
    return lane


def _no_sources(j: int) -> None:
    return None


def _step_sources(model: ModelLanes, context) -> Callable[[int], KVSource | None]:
    """Sources read lazily from this step's forward context (one context-lengths tensor)."""
    lens: dict[int, tuple[torch.Tensor, int | None]] = {}

    def source(j: int) -> KVSource | None:
        layer = model.layers[j]()
        common = common_for(model.state, metadata_for(context, model.names[j]), model.names[j])
        if layer is None or common is None:
            return None
        cache = layer.kv_cache
        if isinstance(cache, list):  # older vLLM kept one cache per virtual engine
            cache = cache[0]
        if cache.numel() == 0:
            return None
        try:
            cache = model.view(cache)
        except RuntimeError:
            model.state.log_once(f"view:{model.key}", "the KV cache has no block axis ringflow "
                                 "can view; full-KV prefetch stays off")
            return None
        unit = (math.prod(cache.shape[1:]),) if model.layout.kind == "pages" \
            else tuple(cache.shape[2:])
        if unit != model.layout.unit:
            model.state.log_once(f"unit:{model.key}", "a KV cache of shape %s does not match "
                                 "the layout the rings were sized for (%s); no prefetch",
                                 tuple(cache.shape), model.layout.unit)
            return None
        found = lens.get(id(common))
        if found is None:
            found = lens[id(common)] = context_lens(common, model.max_model_len)
        lens_now, bound = found
        return KVSource(cache, common.block_table_tensor[: lens_now.shape[0]], lens_now, bound)

    return source


# -- verification of the backend's output (MLA) ------------------------------------------------

def _check_output(model: ModelLanes, lane: KVPrefetcher, index: int, args, kwargs) -> None:
    """Verification mode, MLA: the backend's output (``forward_impl(q, kv_c_normed, k_pe,
    kv_cache, attn_metadata, output=...)``) against a reference attention over the slot
    (:func:`mla_check.check_mla_output`); eager steps only."""
    slot = lane.gathered(index)
    if slot is None or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    output = kwargs.get("output")
    common = common_for(model.state, metadata_for(model.state.steps.context(),
                                                  model.names[index]),
                     model.names[index])
    if output is None or common is None:
        return
    worst = mla_check.check_mla_output(lane, index, model.layers[index](), slot, common,
                                          q=args[0], kv_cache=args[3], output=output)
    model.attention_checked += 1
    model.attention_max_error = max(model.attention_max_error, worst)


# -- environment --------------------------------------------------------------------------------

def _device(config) -> torch.device:
    kind = getattr(config.device_config, "device_type", None) or "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _has_kv_connector(state: PluginState) -> bool:
    has_group = compat.get(state, "vllm.distributed.kv_transfer.has_kv_transfer_group")
    return bool(has_group is not None and has_group())


def resolve_step_functions(state: PluginState) -> None:
    """Take vLLM's per-step functions from the table once, when the first layer attaches
    (never per layer call); without them no step is seen (the feature is off, logged)."""
    if state.steps.resolved:
        return
    steps, found = state.steps, {key: compat.get(state, f"vllm.forward_context.{key}")
                                 for key in ("get_forward_context", "is_forward_context_available")}
    if None in found.values():
        return
    steps.context_available = found["is_forward_context_available"]
    steps.context = found["get_forward_context"]
    steps.resolved = True
    ubatch = compat.get(state, "vllm.v1.worker.ubatching.dbo_current_ubatch_id")
    if ubatch is not None:  # a vLLM without dual-batch overlap: one micro-batch
        steps.ubatch = ubatch


__all__ = ["ModelLanes", "after_attention_init", "attach", "gathered_kv", "load_model_group",
           "models", "on_initialize_kv_cache"]
