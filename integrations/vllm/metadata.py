"""The backend-neutral attention metadata, kept for ringflow on whatever each backend builds.

Every vLLM attention backend builds its own metadata from one backend-neutral record (block
table in kernel blocks, sequence and query lengths); full-KV prefetch needs that record for
any backend's layers. So the metadata builders of the backends in use are wrapped (where every
vLLM version ends up building, ``integrations/vllm/compat.py``), and the record rides on what
each ``build*`` returns, with the layers it was built for (vLLM copies metadata across KV-cache
groups and swaps the block table, ``update_block_table``). It is the one thing of ringflow's
kept on a vLLM object: a step's metadata lives for that step, and vLLM's metadata dataclasses
compare by value, so no table of ringflow's could key them.
"""

from __future__ import annotations

import dataclasses

import torch

from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.state import PluginState


#: the builder methods hooked on each backend's builder class (the table's instance surfaces)
BUILDER_SURFACES = tuple(f"vllm.v1.attention.backend.AttentionMetadataBuilder.{name}" for name in
                         ("__init__", "build", "build_for_cudagraph_capture",
                          "update_block_table"))


def hook_builder(state: PluginState, cls: type | None) -> None:
    """Listen where every vLLM version ends up building a backend's metadata: the builder
    class of a backend in use, hooked as the table says (``compat.hook_class``)."""
    if cls is None:
        return
    for key in BUILDER_SURFACES:
        compat.hook_class(state, key, cls)


def remember_layer_names(state: PluginState, original, builder, *args, **kwargs):
    """Builders are made with the layers they serve (``__init__(kv_cache_spec, layer_names,
    ...)``); not every one keeps them (vLLM 0.32's MLA builder does not)."""
    original(builder, *args, **kwargs)
    names = kwargs.get("layer_names", args[1] if len(args) > 1 else None)
    if names is not None:  # the live list: a drafter appends its other layers after building
        try:
            state.builder_layers[builder] = names
        except TypeError:  # a dataclass builder (vLLM 0.34's sparse MLA ones): unhashable
            builder._ringflow_layers = names


def keep_common_metadata(state: PluginState, original, builder, *args, **kwargs):
    """A metadata builder's ``build*``: keep the backend-neutral metadata it was given (block
    table in the kernel's block size) on what it returned, with the layers it serves."""
    result = original(builder, *args, **kwargs)
    if not state.models or result is None:
        return result
    common = kwargs.get("common_attn_metadata")
    if common is None:
        common = next((a for a in args if hasattr(a, "block_table_tensor")), None)
    if common is not None:
        _tag(state, result, common, builder)
    return result


def keep_swapped_block_table(state: PluginState, original, builder, metadata, blk_table,
                             slot_mapping, *args, **kwargs):
    """``update_block_table``: vLLM reuses one build for another KV-cache group with that
    group's block table; the kept metadata follows it."""
    result = original(builder, metadata, blk_table, slot_mapping, *args, **kwargs)
    kept = getattr(metadata, "_ringflow_common", None)
    if kept is not None and result is not None:
        _tag(state, result, dataclasses.replace(kept[0], block_table_tensor=blk_table,
                                                slot_mapping=slot_mapping), builder)
    return result


def _tag(state: PluginState, metadata, common, builder) -> None:
    names = getattr(builder, "layer_names", None)
    if names is None:  # a builder that does not keep them (vLLM 0.32's MLA builder)
        try:
            names = state.builder_layers.get(builder, ())
        except TypeError:  # unhashable: kept on the builder itself
            names = getattr(builder, "_ringflow_layers", ())
    try:  # with the layers it was built for: vLLM copies metadata across groups
        metadata._ringflow_common = (common, frozenset(names))
    except (AttributeError, TypeError) as exc:
        state.log_once(f"meta:{type(metadata).__name__}", "%s takes no extra attributes (%s); "
                       "its layers run without full-KV prefetch", type(metadata).__name__, exc)


def metadata_for(context, name: str):
    meta = context.attn_metadata
    if isinstance(meta, dict):
        return meta.get(name)
    if isinstance(meta, list):  # speculative decoding: [0] is the base model's
        return meta[0].get(name) if meta else None
    return meta


def common_for(state: PluginState, meta, name: str):
    """The backend-neutral metadata kept for layer ``name``, or None (logged once)."""
    if meta is None:
        return None
    kept = getattr(meta, "_ringflow_common", None)
    if kept is None:
        state.log_once("no-common", "attention metadata of type %s was not built by a "
                       "metadata builder ringflow listens to; full-KV prefetch is off for "
                       "these steps", type(meta).__name__)
        return None
    common, names = kept
    if name not in names:  # metadata vLLM copied from another KV-cache group's
        state.log_once(f"group:{name}", "layer %s reads attention metadata built for another "
                       "KV-cache group (vLLM reuses it and swaps the block table); it runs "
                       "without full-KV prefetch", name)
        return None
    return common


def context_lens(common, max_model_len: int) -> tuple[torch.Tensor, int | None]:
    """Tokens each request already has in the cache (device), and a host-side bound of the sum.

    Inside a CUDA graph capture the bound must hold for every replay, whose lengths are not
    known yet: it is the worst case, so a ring smaller than ``requests x max_model_len`` leaves
    captured steps without prefetch (and says so) rather than handing out a truncated slot.
    """
    n = common.num_reqs
    starts = common.query_start_loc
    context = common.seq_lens[:n] - (starts[1: n + 1] - starts[:n])
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return context, n * max_model_len
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    starts_cpu = getattr(common, "query_start_loc_cpu", None)
    if upper is not None and starts_cpu is not None:
        bound = int(upper[:n].sum()) - int(starts_cpu[n] - starts_cpu[0])
    else:
        bound = n * int(common.max_seq_len)
    return context, bound
