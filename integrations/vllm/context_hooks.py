"""MLA context gathers that vLLM's own attention reads, issued one (layer, chunk) ahead: the
hooks vLLM's classes and functions get.

vLLM's MLA prefill over existing context (a prefix-cache hit, a chunked prefill's earlier
chunks) runs per layer and per context chunk, on the compute stream: gather the chunk's KV
from the paged cache into the chunked-context workspace, up-project it (``kv_b_proj``), attend,
merge. The gather is on the critical path of every layer. With a ``kv_prefetch`` profile whose
``consumer`` is ``context`` (the default), ringflow takes it off:

* the first MLA layer of a step gathers for itself, and each gather call it makes
  (``vllm._custom_ops``' context gathers, whichever the platform and dtype pick) is recorded:
  the op and every argument but the source cache, the destination and the scale
  (``context_recording.py``);
* the step's other layers are planned as ``(layers - 1) x chunks`` units
  (:class:`~ringflow.integrations.torch.chunk_prefetch.ChunkPrefetcher`, owned by the model's
  ``context_ring.ContextModel``); each unit's gather is that recorded call replayed with its
  own layer's cache, into a ring slot shaped like the workspace, on the gather stream,
  ``depth`` units ahead (Note [Why replay vLLM's own gather]);
* when a layer's attention then calls the gather for a chunk, the call is checked against the
  recording (same op, same metadata tensors, same cache and scale the fill used): on a match
  the compute stream waits for the unit's slot, the call is skipped, and the workspace tensor
  vLLM holds is pointed at the slot (``Tensor.set_``, restored when the layer is done), so the
  up-projection and attention read the prefetched rows; on any difference the step is given
  up (one log line) and vLLM gathers for itself: a wrong read is never the fallback
  (``context_session.py``).

Under DCP each chunk's local gather is followed by an exchange across the group, prefetched
with it (Note [DCP context exchange], ``dcp.py``). Steps with little context are left to vLLM
(Note [Short context], ``context_ring.py``). Layers join their model's ring as they are built
(``context_attach.py``).

The hooks here are inert outside a layer's context session: they only route vLLM's calls to
the session that one layer's context attention opened, and close it when the layer is done.
"""

from __future__ import annotations

import inspect

import torch

from ringflow.integrations.vllm.context_session import SESSION, Session
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.state import STATE, PluginState


def gather_hook(surface):
    """The hook on one of vLLM's context gathers (``surface``: its entry in the table, or the
    op's name; one of ``GATHER_OPS``, in ``vllm._custom_ops`` or, from 0.34, ``vllm._cpu_ops``):
    inside a layer's context session the call, its arguments bound to the op's parameter
    names, goes to the session; outside one (or unbindable) vLLM's op runs as it is."""
    name = surface if isinstance(surface, str) else surface.path
    signature = []  # the op's, looked up at its first call in a session

    def hook(state: PluginState, original, *args, **kwargs):
        session = SESSION.get()
        if session is None:
            return original(*args, **kwargs)
        if not signature:
            signature.append(inspect.signature(original))
        try:
            bound = signature[0].bind(*args, **kwargs) if args else None
        except TypeError:
            return original(*args, **kwargs)
        session.gather(name, original, kwargs if bound is None else dict(bound.arguments))
        return None

    return hook


def on_prefill_context(state: PluginState, original, impl, q, kv_c_and_k_pe_cache,
                       attn_metadata, *args, **kwargs):
    """The hook on ``MLACommonBaseImpl._compute_prefill_context`` (one layer's context
    attention over all its chunks)."""
    return _in_session(state, original, impl, (q, kv_c_and_k_pe_cache, attn_metadata, *args),
                       kwargs, dcp=False)


def on_dcp_prefill_context(state: PluginState, original, impl, q, kv_c_and_k_pe_cache,
                           attn_metadata, *args, **kwargs):
    """The hook on ``MLACommonBaseImpl._context_parallel_compute_prefill_context`` (the same,
    under DCP: each chunk's local gather is followed by an exchange across the group)."""
    return _in_session(state, original, impl, (q, kv_c_and_k_pe_cache, attn_metadata, *args),
                       kwargs, dcp=True)


def _in_session(state: PluginState, original, impl, args: tuple, kwargs: dict, dcp: bool):
    q, attn_metadata = args[0], args[2]
    owner = state.context_impls.get(impl)
    if (owner is None or SESSION.get() is not None or state.steps.ubatch() != 0
            or q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return original(impl, *args, **kwargs)
    model, index = owner
    session = Session(model, index, attn_metadata, dcp=dcp)
    token = SESSION.set(session)
    patched: list[tuple[object, str]] = []
    failed = True
    try:
        if dcp:
            _route_exchanges(impl, attn_metadata, session, patched)
        result = original(impl, *args, **kwargs)
        failed = False
        return result
    finally:
        for owner_object, name in patched:
            vars(owner_object).pop(name, None)
        SESSION.reset(token)
        session.close(failed)


def _route_exchanges(impl, attn_metadata, session: Session,
                     patched: list[tuple[object, str]]) -> None:
    """For one layer's DCP context session: vLLM's exchange calls go through ``session``
    (instance attributes shadowing the methods, listed in ``patched`` as they are set and
    removed when the session ends; Note [DCP context exchange])."""
    chunked = getattr(getattr(attn_metadata, "prefill", None), "chunked_context", None)
    manager = getattr(chunked, "dcp_manager", None)  # vLLM 0.32: the metadata's manager
    if manager is not None and hasattr(type(manager), "kv_gather"):
        kv_gather = type(manager).kv_gather

        def routed_kv_gather(gathered_kv, local_kv, _m=manager):
            return session.exchange("kv_gather", lambda out: kv_gather(_m, out, local_kv),
                                    local_kv, gathered_kv)

        manager.kv_gather = routed_kv_gather
        patched.append((manager, "kv_gather"))
    group = dcp_coordinator()
    if group is not None:  # vLLM 0.26: get_dcp_group().all_gather(local, dim=0)
        all_gather = type(group).all_gather

        def routed_all_gather(input_, dim=-1, _g=group):
            if dim != 0:
                return all_gather(_g, input_, dim)
            return session.exchange("all_gather", lambda out: all_gather(_g, input_, dim),
                                    input_, None)

        group.all_gather = routed_all_gather
        patched.append((group, "all_gather"))


def dcp_coordinator():
    """vLLM's DCP group coordinator (None where there is none)."""
    get_dcp_group = compat.get(STATE, "vllm.distributed.parallel_state.get_dcp_group")
    try:
        return None if get_dcp_group is None else get_dcp_group()
    except AssertionError:  # vLLM made no DCP group in this process
        return None
