"""MLA layers joining their model's context ring as vLLM builds them.

Attaching happens once per layer at model construction, before vLLM sizes the KV cache, and
decides whether a layer has a consumer of prefetched context at all; kept apart from the
per-step code (``context_hooks.py``, ``context_session.py``) that runs inside every forward.
"""

from __future__ import annotations

import logging

import torch

from ringflow.integrations.torch.kv_prefetch import check_not_after_kv
from ringflow.integrations.vllm.context_ring import ONE_RANK, ContextModel, one_rank_left_to_vllm
from ringflow.integrations.vllm.dcp import dcp_exchange, dcp_size
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.state import STATE, PluginState
from ringflow.orchestrator.profile import Profile
from ringflow.units import mib

log = logging.getLogger("ringflow")


def workspace_shape(layer, config) -> tuple[int, int]:
    """The chunked-context workspace vLLM's MLA metadata builder allocates for ``config``
    (under DCP, ``1 / size`` larger: the local gather's rows before the exchanged ones)."""
    rows = compat.get(STATE, "vllm.model_executor.layers.attention.mla_attention."
                      "MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size")(config)
    size = dcp_size(config)
    return rows + (rows // size if size > 1 else 0), layer.kv_lora_rank + layer.qk_rope_head_dim


def attach(state: PluginState, layer, profile: Profile, config) -> bool:
    """Give MLA ``layer`` (just built) its model's context ring (the model's first MLA layer
    allocates it, before the KV cache is sized). False: the layer has no consumer here (said
    once at start-up; nothing is gathered for it)."""
    why = no_consumer(layer, config)
    if why is not None:
        state.log_once(f"ctx-none:{why}", "kv_prefetch: %s; nothing is gathered for it (the "
                       "full-KV check mode, consumer: full_kv_check, gathers for verification "
                       "only)", why)
        return False
    if one_rank_left_to_vllm(profile.kv_prefetch, dcp_size(config)):
        state.log_once("ctx-one-rank", "%s", ONE_RANK, level=logging.INFO)
        return False
    key = state.model_group.get()
    model = state.context_models.get(key)
    if model is None:
        check_not_after_kv(state.kv_sized, f"model group {key}")
        shape = workspace_shape(layer, config)
        dtype = config.model_config.dtype
        device = (torch.device("cuda", torch.cuda.current_device())
                  if getattr(config.device_config, "device_type", "cpu") == "cuda"
                  else torch.device("cpu"))
        size, exchange, transport, storage = dcp_size(config), None, None, None
        if size > 1:
            exchange, transport, storage = dcp_exchange(profile, config, shape, dtype, device)
        model = ContextModel(state, key, profile, shape, dtype, device,
                             name=f"{profile.name}/model{key}/context", dcp_size=size,
                             exchange=exchange, transport=transport, storage=storage)
        state.context_models[key] = model
        state.record("context-ring-allocated")
        log.info("%s; MLA's context gathers (prefix hits, chunked prefill) are read from it "
                 "one chunk ahead; allocated before the KV cache is sized (%s)",
                 model.ring.describe(), mib(model.reserved_bytes))
    model.add_layer(layer)
    return True


def no_consumer(layer, config) -> str | None:
    """Why ``layer`` has no context consumer (None: it has one)."""
    if not hasattr(layer, "kv_lora_rank"):
        return (f"{type(layer).__name__} layers have no consumer of prefetched KV in vLLM "
                f"(only MLA's context chunks do)")
    if getattr(layer, "kv_cache_dtype", "auto") != "auto":
        return "MLA context prefetch supports caches in the model dtype only (kv_cache_dtype=auto)"
    parallel = config.parallel_config
    if getattr(parallel, "enable_dbo", False):
        return "MLA context prefetch runs one micro-batch; dual-batch overlap is on"
    method = ("_context_parallel_compute_prefill_context" if dcp_size(config) > 1
              else "_compute_prefill_context")
    if not hasattr(getattr(layer, "impl", None), method):
        return f"{type(getattr(layer, 'impl', None)).__name__} has no MLA context chunk loop"
    return None


def models(state: PluginState) -> list[ContextModel]:
    return list(state.context_models.values())
