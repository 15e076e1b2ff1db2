"""One model's MLA layers and the ring their context chunks are prefetched into.

The ring outlives every step (allocated before vLLM sizes the KV cache) while sessions live
for one layer's call: what a model owns across steps (its layers, its ring, the recording of
the current step, its counters) is here, and so is the fill, the one piece of a step that runs
on the gather stream.

Note [Short context]
    Prefetching a unit costs host time inside vLLM's forward (about 0.5 ms per (layer, chunk)
    measured on the H200: event records, waits and the fill's launch on a second stream,
    profiles/results/mla-context.md), and on one GPU it hides only the local gather: vLLM's own
    gather is 1.5 to 1.7% of a prefill there, and with the consumer on from 64k context the
    prefill was 1.06x slower at 64k and 1.12x at 128k (H200, vLLM 0.26, 27 V2-Lite layers). So
    on one rank, with ``kv_prefetch.min_context_tokens`` omitted, ringflow leaves every step to
    vLLM: nothing is reserved, no layer attaches, and the log says so in one line
    (:func:`one_rank_left_to_vllm`). Under DCP the all-gather it hides is on the critical path,
    and every step is prefetched. A profile that sets ``min_context_tokens`` gets what it asks
    on any number of ranks: a step whose prefills have fewer context tokens (all chunks, all
    ranks) is not planned, the later layers gather for themselves, and the log says so once.
    The count comes from vLLM's host-side chunk metadata (``context_recording.context_tokens``),
    not from the gathers' destination, which on CUDA is the whole workspace; it is the same on
    every rank of a DCP group, so the choice is too.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from ringflow import envs
from ringflow.errors import BudgetError, ConfigError, OutputError, ProfileError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.torch.chunk_prefetch import ChunkPrefetcher
from ringflow.integrations.vllm.context_recording import Exchange, GatherCall, signature
from ringflow.integrations.vllm.state import PluginState, dump_rank
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB

log = logging.getLogger("ringflow")

ONE_RANK = ("kv_prefetch (consumer: context) without decode context parallelism (one rank): "
            "vLLM gathers every step's MLA context itself and ringflow reserves nothing (there "
            "the consumer's host cost, about 0.5 ms per layer and chunk, exceeds the local "
            "gather it would hide); under decode context parallelism it prefetches every step; "
            "set kv_prefetch.min_context_tokens to prefetch on one rank from that many context "
            "tokens")


def one_rank_left_to_vllm(spec, dcp_size: int) -> bool:
    """Whether ringflow leaves every step of this context profile to vLLM: one rank and
    ``min_context_tokens`` omitted (Note [Short context])."""
    return dcp_size == 1 and spec.min_context_tokens is None


def _dump_plan(base: str, dag) -> None:
    """RINGFLOW_DUMP: each (layers x chunks) plan, once, as PATH.context-LxC.json and .dot."""
    from ringflow.orchestrator import dumps
    stem = dumps.dump_stem(base, dump_rank())
    stem = f"{stem}.context-{dag.meta['layers']}x{dag.meta['chunks']}"
    try:
        dumps.write_files(dag, stem)
    except OutputError as exc:
        log.warning("RINGFLOW_DUMP: %s; the plan is not dumped", exc)
        return
    log.info("wrote the context plan of %d layers x %d chunks to %s.json and %s.dot",
             dag.meta["layers"], dag.meta["chunks"], stem, stem)


class ContextModel:
    """One model's MLA layers (construction = execution order) and its context-chunk ring.

    Under DCP (``dcp_size`` > 1) ``exchange`` all-gathers a unit's local rows across the group
    (Note [DCP context exchange] in ``dcp.py``); ``storage``, if given, is the ring (the peer
    transport's, in memory every rank maps).

    Raises:
        ProfileError: the ring does not fit ``kv_prefetch.workspace_mib``.
        ConfigError: an exchange without DCP, or DCP without one.
    """

    def __init__(self, state: PluginState, key: int, profile: Profile, shape: tuple[int, int],
                 dtype: torch.dtype, device: torch.device, name: str, *, dcp_size: int = 1,
                 exchange: Exchange | None = None, transport: str | None = None,
                 storage: torch.Tensor | None = None) -> None:
        spec = profile.kv_prefetch
        if (dcp_size > 1) != (exchange is not None):
            raise ConfigError(f"'{name}': a context model under DCP (dcp_size {dcp_size}) needs "
                              f"an exchange, and only one under DCP takes it")
        self.state, self.key, self.name = state, key, name
        self.dcp_size, self.exchange = dcp_size, exchange
        self.transport = transport  # the DCP exchange's: "nccl" or "peer" (None: no DCP)
        self.layers: list[weakref.ref] = []
        self.verify = spec.verify
        #: steps with less context run vLLM's own gathers (Note [Short context])
        self.min_context = spec.min_context_tokens or 0
        self.short_steps = 0  # steps left to vLLM for that
        #: False: vLLM gathers for itself, the ring stays reserved (a benchmark's A/B switch,
        #: flipped between requests)
        self.enabled = True
        try:
            self.ring = ChunkPrefetcher(shape, dtype, depth=spec.depth,
                                        workspace_bytes=int(spec.workspace_mib * MIB),
                                        device=device, capture=profile.capture,
                                        gather_priority=profile.gather_priority,
                                        poison=poison_default(), name=name,
                                        storage=storage)
        except BudgetError as exc:
            raise ProfileError("kv_prefetch.workspace_mib", str(exc), profile.source) from exc
        dump = envs.text("RINGFLOW_DUMP")
        if dump:
            self.ring.on_plan = functools.partial(_dump_plan, dump)
        self.calls: list[GatherCall] = []
        self.step = None  # the metadata object of the step the calls were recorded in
        #: layer -> signatures of the cache and scale its fill read (not the tensors: a model
        #: left in the process's state must not keep a finished engine's KV cache alive)
        self.filled: dict[int, tuple] = {}
        self.checked = 0
        self.mismatches: list[str] = []

    @property
    def reserved_bytes(self) -> int:
        return self.ring.reserved_bytes

    def add_layer(self, layer) -> int:
        """MLA ``layer`` (just built) joins the model as its next layer: the plugin state maps
        its ``impl`` to the model and the layer's index (what the context hooks look up), the
        model holds the layer weakly. Returns the index."""
        index = len(self.layers)
        self.state.context_impls[layer.impl] = (self, index)
        self.layers.append(weakref.ref(layer))
        return index

    def layer(self, index: int):
        return self.layers[index]()

    # -- the fill (gather stream) -------------------------------------------------------------

    def fill(self, unit_layer: int, chunk: int, slot: torch.Tensor) -> None:
        """Unit (``unit_layer``, ``chunk``): the step's recorded call ``chunk`` replayed with
        layer ``unit_layer + 1``'s cache and scale into ``slot`` (Note [Why replay vLLM's own
        gather] in ``context_recording.py``)."""
        index = unit_layer + 1
        layer = self.layer(index)
        cache, scale = _cache_of(layer), getattr(layer, "_k_scale", None)
        call = self.calls[chunk]
        args = dict(call.args, src_cache=cache, dst=slot[call.offset: call.offset + call.rows])
        if call.scaled:
            args["scale"] = scale
        self.filled[index] = (signature(cache), None if scale is None else signature(scale))
        call.op(**args)
        if call.exchange is not None:
            (source, rows), (target, gathered) = call.exchange.source, call.exchange.target
            self.exchange(slot[target: target + gathered], slot[source: source + rows])


def _cache_of(layer) -> torch.Tensor:
    cache = layer.kv_cache
    return cache[0] if isinstance(cache, list) else cache  # older vLLM: one per virtual engine
