"""MLA context gathers that vLLM's own attention reads, issued one (layer, chunk) ahead.

vLLM's MLA prefill over existing context (a prefix-cache hit, a chunked prefill's earlier
chunks) runs per layer and per context chunk, on the compute stream: gather the chunk's KV
from the paged cache into the chunked-context workspace, up-project it (``kv_b_proj``), attend,
merge. The gather is on the critical path of every layer. With a ``kv_prefetch`` profile whose
``consumer`` is ``context`` (the default), ringflow takes it off:

* the first MLA layer of a step gathers for itself, and each gather call it makes
  (``vllm._custom_ops``' context gathers, whichever the platform and dtype pick) is recorded:
  the op and every argument but the source cache, the destination and the scale;
* the step's other layers are planned as ``(layers - 1) x chunks`` units
  (:class:`~ringflow.integrations.torch.chunk_prefetch.ChunkPrefetcher`); each unit's gather
  is that recorded call replayed with its own layer's cache, into a ring slot shaped like the
  workspace, on the gather stream, ``depth`` units ahead;
* when a layer's attention then calls the gather for a chunk, the call is checked against the
  recording (same op, same metadata tensors, same cache and scale the fill used): on a match
  the compute stream waits for the unit's slot, the call is skipped, and the workspace tensor
  vLLM holds is pointed at the slot (``Tensor.set_``, restored when the layer is done), so the
  up-projection and attention read the prefetched rows; on any difference the step is given
  up (one log line) and vLLM gathers for itself: a wrong read is never the fallback.

Note [Why replay vLLM's own gather]
    The chunk loop differs between vLLM releases (0.26 indexes per-chunk arrays, 0.32 iterates
    chunk objects with request slices). Its gather calls and its reads of ``workspace[:toks]``
    do not. Replaying the call vLLM made, with the next layer's cache, gives the slot exactly
    the rows, order and padding vLLM's read expects, whatever the release computes them from.

Under decode context parallelism each rank holds part of every request's context, and
vLLM's context path (``_context_parallel_compute_prefill_context``) follows each chunk's local
gather with an all-gather across the DCP group into the rest of the workspace, then reorders
the rows on the compute stream. That all-gather is the seed's full-CKV DCP gather; ringflow
takes it off the critical path as well (Note [DCP context exchange]).

Note [DCP context exchange]
    The step's first layer records, after each chunk's local gather, vLLM's exchange of it:
    which call (0.26: ``GroupCoordinator.all_gather(local, dim=0)``, whose result vLLM copies
    into the workspace; 0.32: ``MLADCPManager.kv_gather(gathered, local)``, into it) and which
    workspace rows it reads and fills. A unit's fill then replays the local gather into the
    slot and all-gathers those rows into the slot's gathered rows, rank after rank as vLLM's
    all-gather lays them out: over a communicator of ringflow's own (``attention.dcp_group``:
    NCCL, never the one vLLM's compute stream uses, so the two streams never share one), or,
    with ``dcp_transport`` peer or auto, by copy engines: the ring lies in symmetric memory,
    every rank's local rows of a unit sit at the same place in its own slot, and each fill
    copies them from every rank's slot into its own, between two barriers
    (``PeerExchange.gather_parts``, Note [Peer exchange]). A
    consuming layer's exchange is checked against the recording and skipped: 0.32's call
    returns at once, 0.26's returns the slot's gathered rows, which vLLM then "copies" onto
    themselves (``Tensor.copy_`` of a view onto the same view moves nothing). vLLM's reorder
    still runs, on the compute stream, from the slot.

    The fills are collectives: every rank must issue them in the same order. The plan is the
    same on every rank, and every reason to give a step up (another chunking, another cache,
    a recording vLLM's calls did not match) comes from metadata and configuration that are the
    same on every rank of the group (vLLM's all-gather needs equal ``toks`` everywhere too).
    The exchange is hooked by instance attributes on vLLM's DCP coordinator and manager only
    while a layer's context session runs (eager code): a class hook on
    ``GroupCoordinator.all_gather`` would be traced by ``torch.compile`` wherever vLLM
    all-gathers. NCCL does not promise progress to two communicators whose kernels run
    concurrently in different orders on different ranks (ringflow's on the gather stream,
    vLLM's on the compute stream); the full-KV lane has run that way on two H200s, and the
    consumer's fills are issued at the same plan points on every rank.

Note [Short context]
    Prefetching a unit costs host time inside vLLM's forward (about 0.5 ms per (layer, chunk)
    measured on the H200: event records, waits and the fill's launch on a second stream,
    profiles/results/README.md), and on one GPU it hides only the local gather (0.04 ms per
    layer at a 32k context). With a cached 32k prefix and a 2k suffix that made the prefill
    1.15 to 1.21x slower in three of four runs (1.03x in the fourth); at 64k it was 0.94 to
    1.03x, at 128k 1.00 to 1.01x. A step whose prefills have fewer than
    ``kv_prefetch.min_context_tokens`` context tokens (all chunks, all ranks) is therefore not
    planned: the later layers gather for themselves, as without ringflow, and the log says so
    once. Omitted, it is ``MIN_CONTEXT_AUTO`` on one rank and 0 under DCP, where the exchange
    it hides is on the critical path. The count comes from vLLM's host-side chunk metadata
    (``context_tokens``), not from the gathers' destination, which on CUDA is the whole
    workspace; it is the same on every rank of a DCP group, so the choice is too.
"""

from __future__ import annotations

import contextvars
import math
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringflow import envs
from ringflow.errors import BudgetError, ConfigError, OutputError, ProfileError
from ringflow.graphs.executor import poison_default
from ringflow.integrations.torch.chunk_prefetch import ChunkPrefetcher
from ringflow.integrations.vllm.hooks import wrap, wrap_function
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB, mib

log = logging.getLogger("ringflow")

#: kv_prefetch.min_context_tokens when omitted, on one rank (Note [Short context])
MIN_CONTEXT_AUTO = 65536

#: vLLM's MLA context gathers (whichever exist in the installed release)
GATHER_OPS = ("gather_and_maybe_dequant_cache", "cp_gather_cache",
              "gather_mla_context_cache_cpu", "cp_gather_and_upconvert_fp8_kv_cache")
#: arguments a replay replaces: the layer's cache, the slot, the layer's scale
_PER_LAYER = ("src_cache", "dst", "scale")
_SESSION: contextvars.ContextVar = contextvars.ContextVar("ringflow_context_session",
                                                          default=None)


def _dump_plan(base: str, dag) -> None:
    """RINGFLOW_DUMP: each (layers x chunks) plan, once, as PATH.context-LxC.json and .dot."""
    from ringflow.orchestrator import dumps
    stem = base[:-5] if base.endswith(".json") else base
    stem = f"{stem}.context-{dag.meta['layers']}x{dag.meta['chunks']}"
    try:
        dumps.write_files(dag, stem)
    except OutputError as exc:
        log.warning("RINGFLOW_DUMP: %s; the plan is not dumped", exc)
        return
    log.info("wrote the context plan of %d layers x %d chunks to %s.json and %s.dot",
             dag.meta["layers"], dag.meta["chunks"], stem, stem)


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _same(a, b) -> bool:
    """The same argument: one tensor object (vLLM passes a step's metadata tensors to every
    layer), or tensors over the same memory with one shape, stride and dtype; else equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and _signature(a) == _signature(b))
    return a == b


#: an exchange's rows in the workspace: (first row, rows)
Rows = tuple[int, int]
#: exchange(gathered, local): every DCP rank's ``local`` rows into ``gathered``, rank after rank
Exchange = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class ExchangeCall:
    """The DCP all-gather that followed a chunk's local gather (Note [DCP context exchange]):
    vLLM's kind of call, the workspace rows it read (``source``) and those it filled
    (``target``)."""

    kind: str
    source: Rows
    target: Rows


@dataclass
class GatherCall:
    """One gather the step's first layer made: the op, its per-step arguments, and where in
    the workspace it wrote (``rows`` rows from row ``offset``); under DCP, the exchange that
    followed it."""

    name: str
    op: object
    args: dict
    offset: int
    rows: int
    scaled: bool  # the call passes the layer's KV scale
    exchange: ExchangeCall | None = None

    def matches(self, name: str, args: dict) -> bool:
        return (name == self.name and set(args) - set(_PER_LAYER) == set(self.args)
                and all(_same(args[k], v) for k, v in self.args.items()))


class ContextModel:
    """One model's MLA layers (construction = execution order) and its context-chunk ring.

    Under DCP (``dcp_size`` > 1) ``exchange`` all-gathers a unit's local rows across the group
    (Note [DCP context exchange]); ``storage``, if given, is the ring (the peer transport's,
    in memory every rank maps).

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
        self.min_context = (spec.min_context_tokens if spec.min_context_tokens is not None
                            else 0 if dcp_size > 1 else MIN_CONTEXT_AUTO)
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

    def layer(self, index: int):
        return self.layers[index]()

    # -- the fill (gather stream) -------------------------------------------------------------

    def fill(self, unit_layer: int, chunk: int, slot: torch.Tensor) -> None:
        """Unit (``unit_layer``, ``chunk``): the step's recorded call ``chunk`` replayed with
        layer ``unit_layer + 1``'s cache and scale into ``slot``."""
        index = unit_layer + 1
        layer = self.layer(index)
        cache, scale = _cache_of(layer), getattr(layer, "_k_scale", None)
        call = self.calls[chunk]
        args = dict(call.args, src_cache=cache, dst=slot[call.offset: call.offset + call.rows])
        if call.scaled:
            args["scale"] = scale
        self.filled[index] = (_signature(cache), None if scale is None else _signature(scale))
        call.op(**args)
        if call.exchange is not None:
            (source, rows), (target, gathered) = call.exchange.source, call.exchange.target
            self.exchange(slot[target: target + gathered], slot[source: source + rows])


def context_tokens(chunked, dcp_size: int = 1) -> int | None:
    """The context tokens of a step's prefills, all ranks together, from the host-side counts
    in vLLM's chunked-context metadata (0.26: ``seq_tot`` per chunk, the rank's padded share
    under DCP; 0.32: each chunk's ``num_context_tokens``), the same on every rank. Not from the
    gathers' ``dst``: vLLM's CUDA gathers are handed the whole workspace. None: neither is
    there."""
    per_chunk = getattr(chunked, "seq_tot", None)
    if per_chunk is not None:
        return int(sum(per_chunk)) * dcp_size
    chunks = getattr(chunked, "chunks", None)
    if chunks is not None and all(hasattr(c, "num_context_tokens") for c in chunks):
        return int(sum(c.num_context_tokens for c in chunks))
    return None


def _cache_of(layer) -> torch.Tensor:
    cache = layer.kv_cache
    return cache[0] if isinstance(cache, list) else cache  # older vLLM: one per virtual engine


class Session:
    """One layer's ``_compute_prefill_context`` call (``dcp``: its
    ``_context_parallel_compute_prefill_context``): records (the step's first layer), consumes
    slots (the others) or passes through (no step planned). Each gather call names its cache
    and scale (``src_cache``, ``scale``): those are checked against the fill's."""

    def __init__(self, model: ContextModel, index: int, attn_metadata, dcp: bool = False) -> None:
        self.model, self.index = model, index
        self.chunked = attn_metadata.prefill.chunked_context
        self.workspace = self.chunked.workspace
        self.saved = None  # the workspace's own storage, kept where it may be re-pointed
        self.calls = 0
        #: why the step is given up once this layer is done (its reads still use the slot)
        self.give_up: str | None = None
        ring = model.ring
        if not model.enabled:
            self.mode = "pass"
        elif dcp != (model.dcp_size > 1):
            self.mode = "pass"
            model.state.log_once("ctx-dcp-path", "vLLM ran its %s context path for a model "
                                 "ringflow planned %s DCP; context prefetch stays off for it",
                                 "DCP" if dcp else "non-DCP", "with" if not dcp else "without")
        elif index == 0:
            if ring.in_step:
                ring.abandon("a step began before the last one's layers had all run")
            model.step, model.calls, model.filled = attn_metadata, [], {}
            self.mode = "record"
        elif ring.in_step and model.step is attn_metadata:
            self.mode = "consume"
            ws = self.workspace
            self.saved = (ws.untyped_storage(), ws.storage_offset(), tuple(ws.shape),
                          ws.stride())
        else:
            self.mode = "pass"

    def gather(self, name: str, op, args: dict) -> None:
        """vLLM's gather call ``name`` with ``args``."""
        if self.mode == "record":
            op(**args)
            self._record(name, op, args)
        elif self.mode == "consume":
            self._consume(name, op, args)
        else:
            op(**args)
        self.calls += 1

    def _record(self, name: str, op, args: dict) -> None:
        where = self._where(args["dst"])
        if where is None:
            self._stop_recording("ctx-dst", "vLLM's context gather writes outside its workspace")
            return
        self.model.calls.append(GatherCall(name, op, {k: v for k, v in args.items()
                                                      if k not in _PER_LAYER}, *where,
                                           scaled="scale" in args))

    def _stop_recording(self, key: str, why: str) -> None:
        """The step's first layer did something the recording cannot replay: no plan."""
        self.mode = "pass"
        self.model.calls = []
        self.model.state.log_once(key, "%s; context prefetch stays off", why)

    def _where(self, dst: torch.Tensor) -> Rows | None:
        """Row offset and rows of ``dst`` inside the workspace (None: not a row range of it)."""
        ws = self.workspace
        if (dst.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr()
                or dst.dtype != ws.dtype or dst.shape[1:] != ws.shape[1:]
                or dst.stride() != ws.stride()):
            return None
        offset, rem = divmod(dst.storage_offset() - ws.storage_offset(), ws.stride(0))
        if rem or offset < 0 or offset + dst.shape[0] > ws.shape[0]:
            return None
        return offset, dst.shape[0]

    def _consume(self, name: str, op, args: dict) -> None:
        model, ring, chunk = self.model, self.model.ring, self.calls
        where = self._where(args["dst"])  # vLLM sliced dst from the workspace as it is now
        why = self._mismatch(name, args, chunk, where)
        if why is not None:
            self._restore()
            ring.abandon(why)
            self.mode = "pass"
            op(**self._into_workspace(args, where))
            return
        slot = ring.begin(self.index - 1, chunk)
        if model.verify:
            self._restore()
            op(**self._into_workspace(args, where))  # vLLM's own gather, to compare with
            self._check(model.calls[chunk], slot, args)
        ws = self.workspace
        ws.set_(slot.untyped_storage(), slot.storage_offset(), ws.shape, ws.stride())

    # -- the DCP exchange (Note [DCP context exchange]) ---------------------------------------

    def exchange(self, kind: str, run: Callable, local: torch.Tensor,
                 gathered: torch.Tensor | None):
        """vLLM's DCP exchange of ``local`` (``kind``: 0.26's ``all_gather``, whose result is
        returned; 0.32's ``kv_gather`` into ``gathered``); ``run(out)`` runs vLLM's own (into
        ``out`` for ``kv_gather``). Returns what vLLM's call returns."""
        if self.mode == "pass" or self._where(local) is None:  # not the chunk's exchange
            return run(gathered)
        if self.mode == "record":
            result = run(gathered)
            self._record_exchange(kind, local, gathered)
            return result
        return self._consume_exchange(kind, run, local, gathered)

    def _target(self, kind: str, source: Rows, gathered: torch.Tensor | None) -> Rows | None:
        """The workspace rows the exchange fills: 0.32 names them; 0.26 copies its result
        into the rows after the first ``1 / (size + 1)`` of the workspace (vLLM's layout)."""
        if kind == "kv_gather":
            return self._where(gathered)
        return self.workspace.shape[0] // (self.model.dcp_size + 1), source[1] * self.model.dcp_size

    def _record_exchange(self, kind: str, local: torch.Tensor,
                         gathered: torch.Tensor | None) -> None:
        calls, source = self.model.calls, self._where(local)
        target = self._target(kind, source, gathered)
        last = calls[-1] if calls else None
        if (last is None or last.exchange is not None or source[0] < last.offset
                or source[0] + source[1] > last.offset + last.rows or target is None
                or target[1] != source[1] * self.model.dcp_size
                or target[0] + target[1] > self.workspace.shape[0]
                or source[0] < target[0] + target[1] and target[0] < source[0] + source[1]):
            self._stop_recording("ctx-dcp-layout", f"vLLM's DCP context exchange ({kind}, rows "
                                 f"{source} into {target}) is not laid out as ringflow expects")
            return
        last.exchange = ExchangeCall(kind, source, target)

    def _consume_exchange(self, kind: str, run: Callable, local: torch.Tensor,
                          gathered: torch.Tensor | None):
        model, chunk = self.model, self.calls - 1
        want = model.calls[chunk].exchange if 0 <= chunk < len(model.calls) else None
        source = self._where(local)
        if (want is None or kind != want.kind or source != want.source
                or self._target(kind, source, gathered) != want.target):
            # the chunk's local rows are in the slot (its gather matched the recording), so
            # vLLM's own exchange of them is right, and its views of this chunk read the slot:
            # the step is given up when the layer is done, its later chunks are vLLM's
            result = run(gathered)
            self._restore()
            self.give_up = (f"layer {self.index}'s DCP exchange {chunk} differs from the step's "
                            f"first layer's")
            self.mode = "pass"
            return result
        offset, rows = want.target
        ours = self.workspace[offset: offset + rows]  # the slot's gathered rows
        if model.verify:
            if kind == "kv_gather":
                theirs = torch.empty_like(ours)
                run(theirs)
            else:
                theirs = run(None)
            self._compare(f"layer {self.index} chunk {chunk} (DCP exchange)", ours, theirs)
        return ours if kind == "all_gather" else None  # 0.26 copies it onto itself: no copy

    def _into_workspace(self, args: dict, where: tuple[int, int] | None) -> dict:
        """``args`` with ``dst`` re-sliced from the restored workspace (vLLM sliced it while
        the workspace pointed at the previous chunk's slot)."""
        if where is None:
            return args
        offset, rows = where
        return dict(args, dst=self.workspace[offset: offset + rows])

    def _mismatch(self, name: str, args: dict, chunk: int,
                  where: tuple[int, int] | None) -> str | None:
        """Why this call is not the recorded one its slot was filled by (None: it is). The
        workspace itself was checked against the slot when the step was recorded
        (:meth:`_fits`): a consuming layer has the same step's metadata, so the same one."""
        model = self.model
        if chunk >= len(model.calls):
            return f"layer {self.index} gathers more context chunks than the step's first layer"
        call = model.calls[chunk]
        if not call.matches(name, args) or where != (call.offset, call.rows):
            return (f"layer {self.index}'s context gather {chunk} differs from the step's first "
                    f"layer's (another chunking or metadata)")
        if self.index not in model.filled:
            return f"layer {self.index} was not prefetched in this step"
        cache, scale = model.filled[self.index]
        if cache != _signature(args["src_cache"]):
            return f"layer {self.index} reads another KV cache than its prefetch did"
        if "scale" in args and scale != (None if args["scale"] is None
                                         else _signature(args["scale"])):
            return f"layer {self.index}'s KV scale is not the one its prefetch used"
        return None

    def _check(self, call: GatherCall, slot: torch.Tensor, args: dict) -> None:
        """Verification: the slot against vLLM's own gather of the same chunk (host sync)."""
        rows = int(args["cu_seq_lens"][-1]) if "cu_seq_lens" in args else call.rows
        start = call.offset
        self._compare(f"layer {self.index} chunk {self.calls}", slot[start: start + rows],
                      self.workspace[start: start + rows])

    def _compare(self, what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        model = self.model
        model.checked += 1
        if not torch.equal(ours, theirs):
            bad = (ours != theirs).any(dim=-1).nonzero().flatten()
            model.mismatches.append(f"{what}: {bad.numel()} of {ours.shape[0]} rows differ "
                                    f"(first {bad[:4].tolist()})")
            log.error("verify: %s", model.mismatches[-1])
        if math.log10(model.checked).is_integer():  # 1, 10, 100, ... checks: a summary
            log.info("verify: %d consumed context slot(s) checked against vLLM's own gather, "
                     "%d differed", model.checked, len(model.mismatches))

    def _restore(self) -> None:
        if self.saved is not None:  # only a consuming layer re-points the workspace
            self.workspace.set_(*self.saved)

    def close(self, failed: bool) -> None:
        """The layer's context attention returned (or raised): the workspace is vLLM's again;
        a recording layer starts the step's plan, a consuming one ends its last unit."""
        self._restore()
        model, ring = self.model, self.model.ring
        if failed or self.give_up:
            if ring.in_step:
                ring.abandon(self.give_up or "a layer's context attention raised")
            return
        if self.mode == "record":
            layers = len(model.layers) - 1
            if model.dcp_size > 1 and any(c.exchange is None for c in model.calls):
                self._stop_recording("ctx-dcp-none", "vLLM's DCP context path gathered a chunk "
                                     "without the exchange ringflow hooks (another vLLM?)")
            if model.calls and layers > 0:
                if not self._fits() or self._short():
                    return
                ring.start(layers, len(model.calls), model.fill)
        elif self.mode == "consume":
            if self.calls != len(model.calls):
                ring.abandon(f"layer {self.index} read {self.calls} of the step's "
                             f"{len(model.calls)} context chunks")
            else:
                ring.end()

    def _short(self) -> bool:
        """Whether the step's context is below ``min_context_tokens``: then nothing is planned
        and the later layers gather for themselves (Note [Short context])."""
        model = self.model
        if not model.min_context:
            return False
        tokens, source = context_tokens(self.chunked, model.dcp_size), "vLLM's chunk metadata"
        if tokens is None:  # another vLLM: the rows its gathers wrote (a bound from above)
            tokens = sum(call.rows for call in model.calls) * model.dcp_size
            source = "the rows vLLM's gathers wrote"
        if tokens >= model.min_context:
            return False
        model.short_steps += 1
        model.state.log_once("ctx-short", "a step of %d context token(s) (counted from %s) runs "
                             "vLLM's own context gathers: kv_prefetch.min_context_tokens is %d "
                             "(set it to 0 to prefetch every step; logged once)", tokens, source,
                             model.min_context)
        model.calls = []
        return True

    def _fits(self) -> bool:
        ws, ring = self.workspace, self.model.ring
        if ws.shape[0] <= ring.shape[0] and tuple(ws.shape[1:]) == ring.shape[1:] \
                and ws.dtype == ring.dtype:
            return True
        self.model.state.log_once("ctx-shape", "vLLM's context workspace %s %s does not fit "
                                  "the slot ringflow reserved %s %s; context prefetch stays "
                                  "off", tuple(ws.shape), ws.dtype, ring.shape, ring.dtype)
        self.model.calls = []
        return False


# -- hooks --------------------------------------------------------------------------------------

def install(state: PluginState) -> None:
    """Wrap MLA's context computation and vLLM's context gathers (inert without a session)."""
    from vllm import _custom_ops
    from vllm.model_executor.layers.attention import mla_attention

    wrap(mla_attention.MLACommonBaseImpl, "_compute_prefill_context", on_prefill_context, state)
    if hasattr(mla_attention.MLACommonBaseImpl, "_context_parallel_compute_prefill_context"):
        wrap(mla_attention.MLACommonBaseImpl, "_context_parallel_compute_prefill_context",
             on_dcp_prefill_context, state)
    for name in GATHER_OPS:
        if hasattr(_custom_ops, name):
            wrap_function(_custom_ops, name, _gather_hook(name), state)


def _gather_hook(name: str):
    signature = []  # the op's, looked up at its first call in a session

    def hook(state: PluginState, original, *args, **kwargs):
        session = _SESSION.get()
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
    owner = getattr(impl, "_ringflow_context", None)
    if (owner is None or _SESSION.get() is not None or state.steps.ubatch() != 0
            or q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return original(impl, *args, **kwargs)
    model, index = owner
    session = Session(model, index, attn_metadata, dcp=dcp)
    token = _SESSION.set(session)
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
        _SESSION.reset(token)
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
    group = _dcp_coordinator()
    if group is not None:  # vLLM 0.26: get_dcp_group().all_gather(local, dim=0)
        all_gather = type(group).all_gather

        def routed_all_gather(input_, dim=-1, _g=group):
            if dim != 0:
                return all_gather(_g, input_, dim)
            return session.exchange("all_gather", lambda out: all_gather(_g, input_, dim),
                                    input_, None)

        group.all_gather = routed_all_gather
        patched.append((group, "all_gather"))


def _dcp_coordinator():
    """vLLM's DCP group coordinator (None where there is none)."""
    try:
        from vllm.distributed.parallel_state import get_dcp_group
        return get_dcp_group()
    except (ImportError, AssertionError):
        return None


# -- attaching layers ---------------------------------------------------------------------------

def workspace_shape(layer, config) -> tuple[int, int]:
    """The chunked-context workspace vLLM's MLA metadata builder allocates for ``config``
    (under DCP, ``1 / size`` larger: the local gather's rows before the exchanged ones)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
    rows = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(config)
    size = dcp_size(config)
    return rows + (rows // size if size > 1 else 0), layer.kv_lora_rank + layer.qk_rope_head_dim


def dcp_size(config) -> int:
    return getattr(config.parallel_config, "decode_context_parallel_size", 1) or 1


def attach(state: PluginState, layer, profile: Profile, config) -> bool:
    """Give MLA ``layer`` (just built) its model's context ring (the model's first MLA layer
    allocates it, before the KV cache is sized). False: the layer has no consumer here (said
    once at start-up; nothing is gathered for it)."""
    from ringflow.integrations.torch.kv_prefetch import check_not_after_kv

    why = _no_consumer(layer, config)
    if why is not None:
        state.log_once(f"ctx-none:{why}", "kv_prefetch: %s; nothing is gathered for it (the "
                       "full-KV check mode, consumer: full_kv_check, gathers for verification "
                       "only)", why)
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
            exchange, transport, storage = _dcp_exchange(profile, config, shape, dtype, device)
        model = ContextModel(state, key, profile, shape, dtype, device,
                             name=f"{profile.name}/model{key}/context", dcp_size=size,
                             exchange=exchange, transport=transport, storage=storage)
        state.context_models[key] = model
        state.record("context-ring-allocated")
        log.info("%s; MLA's context gathers (prefix hits, chunked prefill) are read from it "
                 "one chunk ahead; allocated before the KV cache is sized (%s)",
                 model.ring.describe(), mib(model.reserved_bytes))
    layer.impl._ringflow_context = (model, len(model.layers))
    model.layers.append(weakref.ref(layer))
    return True


def _no_consumer(layer, config) -> str | None:
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


def _dcp_exchange(profile: Profile, config, shape: tuple[int, int], dtype: torch.dtype,
                  device: torch.device) -> tuple[Exchange, str, torch.Tensor | None]:
    """The DCP exchange of the context ring's fills, its transport, and the ring's storage
    when the transport needs its own (collective: every worker calls it at its model's first
    MLA layer, in the same order). ``peer`` and ``auto``: copy engines pulling the peers' rows
    from a ring in symmetric memory, or NCCL where that is unavailable (logged); ``nccl``: an
    all-gather over a communicator of ringflow's own. ``auto`` is ``peer`` without timing the
    two: an exchange timed alone does not show that the copy engines leave the SMs to the
    attention it hides behind (Note [Peer exchange])."""
    from ringflow.integrations.torch.kv_prefetch import peer_ring
    from ringflow.integrations.vllm.attention import dcp_group
    from ringflow.kernels.kv_gathers import all_gather_parts

    transport = profile.kv_prefetch.dcp_transport
    group = dcp_group(config, transport, who="MLA context prefetch")
    if transport in ("peer", "auto"):
        spec = profile.kv_prefetch
        try:  # the pool's own fit: the same on every rank, nothing collective yet
            peer, why = peer_ring("ctx", shape, dtype, spec.depth,
                                  int(spec.workspace_mib * MIB), device, group.group)
        except BudgetError as exc:
            raise ProfileError("kv_prefetch.workspace_mib", str(exc), profile.source) from exc
        if peer is not None:
            log.info("MLA context prefetch under DCP (%d ranks): each chunk's exchange is "
                     "prefetched with the local gather, by copy engines pulling the peers' rows "
                     "from a ring in symmetric memory (dcp_transport: %s)", group.size,
                     transport)
            return peer.gather_parts, "peer", peer.storage
        log.warning("MLA context prefetch: DCP transport '%s' unavailable (%s); the exchange "
                    "is an NCCL all-gather", transport, why)
    if torch.cuda.is_available():  # NCCL's own buffers now, before vLLM sizes the KV cache
        probe = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
        all_gather_parts(torch.empty(group.size, device=probe.device), probe, group.group)
        torch.cuda.synchronize(probe.device)
    log.info("MLA context prefetch under DCP (%d ranks): each chunk's exchange is prefetched "
             "with the local gather, as an NCCL all-gather over ringflow's own communicator",
             group.size)
    return (lambda gathered, local: all_gather_parts(gathered, local, group.group)), "nccl", None


def models(state: PluginState) -> list[ContextModel]:
    return list(state.context_models.values())
