"""KVPrefetcher: the full KV of layer l + d gathered into a ring slot while layer l computes.

Independent of vLLM: an engine (through ringflow's attention hooks, or a test's layer loop)
calls :meth:`KVPrefetcher.begin` before a layer's attention and :meth:`KVPrefetcher.end` after
it, and says where each layer's KV lives through a *source* callable evaluated when the gather
is issued. The plan, hazards, streams, capture policy and leases are the same machinery as
every ringflow plan (Planner, EagerExecutor/SyncExecutor, LayerStepper).

Note [What a gather reads]
    A gather of layer j issued during layer l < j of the same step reads the tokens already in
    j's cache: each request's *context* (its tokens minus the ones this step adds). The step's
    own new tokens are written by j's KV update later, after j's wait for the gather, into rows
    the gather does not read (rows layout) or into a page it already copied (pages layout: the
    wait comes before the update, so the copy is not torn). So a slot holds exactly the context
    KV of its layer, which is also what the verification mode checks.

Note [Lifecycle]
    The ring is allocated by the constructor, which the vLLM hooks call when the attention
    implementation is built: before vLLM sizes the KV cache. Nothing is keyed on cache
    tensors: sources are read at issue time. :meth:`retire` (called when the engine re-binds
    or resizes its caches) hands back every lease of a step in flight after a host sync and
    forgets the step, so no gather issued afterwards can touch a replaced cache and no slot of
    the old step can be read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringflow.errors import BudgetError, ConfigError, KernelError, LifecycleError
from ringflow.graphs.eager import executor_for
from ringflow.graphs.slots import SlotPool
from ringflow.graphs.stepped import LayerStepper, engine_computes
from ringflow.integrations.torch.verification import Verification, check_slot
from ringflow.kernels import dcp_gather, dcp_slot_rows, dcp_slot_starts, page_gather, paged_gather
from ringflow.kernels.kv_gathers import NcclExchange, time_exchanges
from ringflow.kernels.peer_exchange import PeerExchange, symmetric_exchange
from ringflow.orchestrator.planner import Planner
from ringflow.orchestrator.vocab import DCP_TRANSPORTS, check_choice
from ringflow.units import ceil_div, mib

log = logging.getLogger("ringflow")
LAYOUTS = ("rows", "pages")
PEER_PREFERENCE = 1.10  # auto keeps peer while it is within 10% of NCCL's exchange time


@dataclass(frozen=True)
class KVLayout:
    """How a layer's cache is read.

    ``rows``: the cache is viewed as ``[num_blocks, block_size, *unit]`` and gathered token by
    token (MLA's latent rows; FlashAttention's K and V planes as a strided view). ``pages``: the
    cache is ``[num_blocks, *unit]`` with a backend-private page interior, copied page by page.
    """

    kind: str
    unit: tuple[int, ...]
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        check_choice("KV layout", self.kind, LAYOUTS, ConfigError)
        if self.block_size < 1 or any(d < 1 for d in self.unit):
            raise ConfigError(f"KV layout needs a positive block size and unit shape, got "
                              f"{self.block_size} and {self.unit}")

    def units(self, tokens: int, requests: int) -> int:
        """Slot rows needed for ``tokens`` context tokens over at most ``requests`` requests."""
        if self.kind == "rows":
            return tokens
        return ceil_div(tokens, self.block_size) + requests


@dataclass(frozen=True)
class KVSource:
    """Where layer j's KV is, for the step in flight (all tensors on the slot's device).

    ``cache`` is the rows or pages view of :class:`KVLayout`; ``context_lens`` holds each
    request's tokens already in the cache; ``max_tokens`` is a host-side upper bound of their
    sum (None when the engine cannot say without a sync).
    """

    cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    max_tokens: int | None = None


@dataclass(frozen=True)
class DcpGroup:
    """A DCP all-gather for the gather lane: its own process group, size and interleave.

    ``transport``: how the ranks' parts are exchanged: ``nccl`` (all-gather on the SMs),
    ``peer`` (copy engines pulling from the peers' rings in symmetric memory, Note [Peer
    exchange]) or ``auto`` (both timed on the ring when it is built; peer kept unless NCCL is
    more than 10% faster; the choice and the times are logged and recorded in the plan's
    ``meta``).
    """

    group: object
    size: int
    rank: int
    interleave: int = 1
    transport: str = "nccl"

    def __post_init__(self) -> None:
        check_choice("DCP transport", self.transport, DCP_TRANSPORTS, ConfigError)


@dataclass(frozen=True)
class DcpTransport:
    """How a DCP lane's ranks exchange their KV parts: decided when its ring is built, before
    any gather, and recorded in the plan's ``meta["dcp"]``.

    ``name``: what runs (``nccl`` or ``peer``); ``requested``: what was asked (``auto`` too);
    ``staged``: the slots carry NCCL's staging parts (``nccl`` needs them, ``auto`` keeps them
    should NCCL win, ``peer`` does without); ``measured_ms``: both exchanges timed on the ring
    (``auto``); ``fallback``: why the requested transport is not the one that runs ("" if it is).
    """

    name: str
    requested: str
    staged: bool
    measured_ms: dict[str, float] = field(default_factory=dict)
    fallback: str = ""

    def meta(self, dcp: DcpGroup) -> dict:
        return {"size": dcp.size, "interleave": dcp.interleave, "transport": self.name,
                "requested": self.requested, "staged": self.staged,
                "measured_ms": dict(self.measured_ms), "fallback": self.fallback}



class KVPrefetcher:
    """One lane's ring of full-KV slots and the plan that fills them one or more layers ahead.

    Args:
        layout: how each layer's cache is read (:class:`KVLayout`).
        capacity_tokens: context tokens one slot holds (all requests of a step together).
        max_requests: most requests in a step (the pages layout and the DCP slot's alignment
            need it).
        depth: layers of lookahead; the ring holds ``depth + 1`` slots (reduced to fit).
        workspace_bytes: device budget of the ring.
        device: where the ring lives (a CUDA device runs eagerly on streams, a CPU synchronously).
        dcp: all-gather across a DCP group instead of a local gather (rows layout only).
        verify: compare each slot with its layer's cache before the attention reads it
            (debug; host-syncs; inside a CUDA graph capture it is compared on the device
            instead, see :meth:`read_captured_verification`).
        capture, gather_priority, poison: as for every executor.

    Raises:
        ConfigError: a slot of no token, or DCP with a pages layout.
        BudgetError: a ring that cannot hold one slot.
    """

    def __init__(self, layout: KVLayout, capacity_tokens: int, *, max_requests: int, depth: int,
                 workspace_bytes: int, device: torch.device | str, dcp: DcpGroup | None = None,
                 verify: bool = False, capture: str = "join", gather_priority: str = "normal",
                 poison: bool = False, name: str = "kv", lane: str = "kv") -> None:
        if dcp is not None and layout.kind != "rows":
            raise ConfigError("a DCP all-gather restores token order and needs a rows layout; "
                              "this backend's cache is paged opaquely")
        self.layout, self.dcp, self.verify = layout, dcp, verify
        self.name, self.lane, self.device = name, lane, torch.device(device)
        self.max_requests, self.depth = max_requests, depth
        self._allocate(capacity_tokens, workspace_bytes)
        self._executor_options = dict(capture=capture, gather_priority=gather_priority)
        self.poison = poison
        self.layers = 0
        self.stepper: LayerStepper | None = None
        self.dag = None
        # [checks, mismatches] of captured verification live on the device (no host sync)
        self.verification = Verification(device_counts=torch.zeros(
            2, dtype=torch.int64, device=self.device) if verify else None)
        self.steps = 0
        self.skipped: dict[str, int] = {}  # steps run without prefetch, by reason
        self.retired = 0
        self.orphan_layers = 0
        self._valid: set[int] = set()
        self._sources: Callable[[int], KVSource] | None = None
        self._step_ok = False
        self._current = -1
        self._open: int | None = None  # the layer begun and not yet ended
        #: called before each gather on the gather stream (tests inject a sleep kernel here)
        self.gather_hook: Callable[[], None] | None = None

    def _sizes(self, capacity_tokens: int, workspace_bytes: int, staged: bool
               ) -> tuple[int, int, int]:
        """(slot rows, output rows, staging rows per rank), checked against the budget. Under
        DCP the output rows are aligned (Note [DCP layout]) and ``staged`` adds the NCCL path's
        staging parts.

        Raises:
            ConfigError: a slot of no token or no request.
            BudgetError: the budget holds not one such slot.
        """
        if capacity_tokens < 1 or self.max_requests < 1:
            raise ConfigError(f"a full-KV slot must hold at least one token of one request, got "
                              f"capacity_tokens={capacity_tokens} and "
                              f"max_requests={self.max_requests}")
        layout, dcp = self.layout, self.dcp
        if dcp is None:
            capacity, local = layout.units(capacity_tokens, self.max_requests), 0
        else:
            capacity = dcp_slot_rows(capacity_tokens, self.max_requests, dcp.size, dcp.interleave)
            local = capacity // dcp.size if staged else 0  # a rank's part of every chunk
        rows = capacity + (dcp.size * local if dcp else 0)
        try:
            SlotPool.fit(self.lane, (rows, *layout.unit), layout.dtype, self.depth,
                         workspace_bytes)
        except BudgetError as exc:
            staging = " with the NCCL staging parts" if local else ""
            raise BudgetError(self.lane, exc.slot_bytes, workspace_bytes,
                              what=f"full-KV slot ({capacity_tokens:,} tokens{staging})",
                              hint=", or fewer capacity tokens") from exc
        return rows, capacity, local

    def _allocate(self, capacity_tokens: int, workspace_bytes: int) -> None:
        """The ring, the one allocation of this lane (Note [Lifecycle]), and under DCP the
        transport over it, decided first (:class:`DcpTransport`): ``peer`` and ``auto`` put the
        ring in symmetric memory; ``peer`` needs no staging parts (Note [Peer exchange]),
        ``auto`` keeps them for NCCL should it win; a ``peer`` that is unavailable falls back to
        NCCL with staging (logged)."""
        requested = self.dcp.transport if self.dcp is not None else None
        staged = requested != "peer"
        rows, capacity, local = self._sizes(capacity_tokens, workspace_bytes, staged)
        peer, fallback = None, ""
        if requested in ("peer", "auto"):
            peer, fallback = self._open_peer_ring(rows, workspace_bytes)
            if peer is None and not staged:
                try:
                    rows, capacity, local = self._sizes(capacity_tokens, workspace_bytes, True)
                except BudgetError as exc:
                    raise BudgetError(exc.lane, exc.slot_bytes, exc.budget_bytes,
                                      what="full-KV slot with the NCCL staging parts (DCP "
                                           "transport 'peer' is unavailable here, logged above)",
                                      hint=", or fewer capacity tokens") from exc
                staged = True
        self.pool = SlotPool(self.lane, (rows, *self.layout.unit), self.layout.dtype,
                             depth=self.depth, workspace_bytes=workspace_bytes,
                             device=self.device, storage=None if peer is None else peer.storage)
        self.capacity_tokens, self.capacity, self.local_capacity = capacity_tokens, capacity, local
        self.transport, self._exchanger = None, None
        if self.dcp is not None:
            nccl = NcclExchange(self.dcp.group)
            measured: dict[str, float] = {}
            name = "nccl" if peer is None else "peer"
            if requested == "auto" and peer is not None:
                measured, name = self._choose_transport(nccl, peer)
            self.transport = DcpTransport(name, requested, staged, measured, fallback)
            self._exchanger = peer if name == "peer" else nccl

    def _open_peer_ring(self, rows: int, workspace_bytes: int
                        ) -> tuple[PeerExchange | None, str]:
        """The ring in memory every DCP rank maps (collective), or None and why (logged)."""
        peer, why = peer_ring(self.lane, (rows, *self.layout.unit), self.layout.dtype,
                              self.depth, workspace_bytes, self.device, self.dcp.group)
        if peer is None:
            log.warning("'%s': DCP transport '%s' unavailable (%s); the gather uses NCCL",
                        self.name, self.dcp.transport, why)
        return peer, why

    def _staging(self, slot: torch.Tensor) -> torch.Tensor | None:
        if not self.local_capacity:
            return None
        return slot[self.capacity:].view(self.dcp.size, self.local_capacity, *self.layout.unit)

    def _choose_transport(self, nccl: NcclExchange, peer: PeerExchange
                          ) -> tuple[dict[str, float], str]:
        """Time both exchanges on slot 0 (collective); peer unless its time is more than
        :data:`PEER_PREFERENCE` times NCCL's."""
        slot = self.pool.storage[0]
        measured = time_exchanges(slot[: self.capacity], self._staging(slot),
                                  {"nccl": nccl, "peer": peer}, self.dcp.group,
                                  interleave=self.dcp.interleave)
        # every rank has the slowest rank's times, so every rank chooses the same. Timed alone,
        # the exchanges do not show that the copy engines leave the SMs to the attention (nor
        # that NCCL's path adds an order-restoring pass): peer wins ties and near-ties
        name = "peer" if measured["peer"] <= PEER_PREFERENCE * measured["nccl"] else "nccl"
        log.info("'%s': DCP exchange of a %s slot: %s; using %s%s", self.name,
                 mib(slot[: self.capacity].nbytes),
                 ", ".join(f"{k} {v:.3f} ms" for k, v in measured.items()), name,
                 " (the ring keeps NCCL's staging parts, unused; dcp_transport: peer drops them)"
                 if name == "peer" else "")
        return measured, name

    def resize(self, capacity_tokens: int, workspace_bytes: int) -> None:
        """A new ring for new sizes: every per-step state retires, the old ring is freed after
        its last reader, the new one allocated and the plan rebuilt over it. Host-syncs.

        A CUDA graph captured over the old ring keeps its raw pointers: drop and recapture
        such graphs (vLLM recaptures after it re-initialises its KV cache).

        Raises:
            BudgetError: the new sizes do not fit (checked first: nothing is lost then).
        """
        self._sizes(capacity_tokens, workspace_bytes,
                    self.dcp is not None and self.dcp.transport != "peer")
        self.retire("the workspace is resized")
        self.pool.close()
        # the old peer ring's mapping goes before the new one is opened: never two at once
        self._exchanger = self.transport = None
        layers, self.stepper, self.dag = self.layers, None, None  # no plan over a closed ring
        self._allocate(capacity_tokens, workspace_bytes)
        if layers:
            self.plan(layers)

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes

    def describe(self) -> str:
        return (f"full-KV ring '{self.name}': {self.pool.slots} slot(s) x "
                f"{mib(self.pool.slot_bytes)} ({self.capacity_tokens:,} tokens, "
                f"{self.layout.kind} layout"
                f"{f', DCP all-gather over {self.transport.name}' if self.dcp else ''}), "
                f"depth {self.pool.depth}")

    # -- planning -----------------------------------------------------------------------------

    def plan(self, layers: int, *, wrap_gather: Callable | None = None) -> None:
        """Plan ``layers`` attention layers, every one gathered (host work only; no allocation).

        ``wrap_gather`` wraps the gather callable the plan runs (a benchmark's timing events);
        a plan of the same size with no wrapper is kept.

        Raises:
            LifecycleError: a different plan asked for while a step is in flight.
        """
        if self.stepper is not None and self.layers == layers and wrap_gather is None:
            return
        if self.stepper is not None and self.stepper.in_forward:
            raise LifecycleError(f"'{self.name}': cannot re-plan in the middle of a step; plan "
                                 f"before layer 0 or after the step's last layer")
        self.layers = layers
        meta = {"dcp": self.transport.meta(self.dcp)} if self.dcp is not None else None
        self.dag = Planner(layers, [self.pool.layout], gathered=range(layers), name=self.name,
                           meta=meta).plan()
        gather = self._gather if wrap_gather is None else wrap_gather(self._gather)
        executor = executor_for(self.dag, [self.pool], gather, engine_computes, poison=False,
                                **self._executor_options)
        self.stepper = LayerStepper(executor, poison=self.poison)

    # -- the step -----------------------------------------------------------------------------

    def begin(self, layer: int, sources: Callable[[int], KVSource | None]) -> None:
        """Before ``layer``'s attention (or its KV update, whichever comes first).

        Waits for the layer's gather on the current stream and issues the gathers the plan
        puts before it. Layer 0 starts a step and ``sources`` becomes the step's sources; a
        second ``begin`` of the layer in flight (update, then attention) does nothing.
        """
        if self.stepper is None:
            raise LifecycleError(f"'{self.name}' has no plan; call plan(layers) before a step")
        if layer == self._open:
            return
        if layer != 0 and (not self.stepper.in_forward or layer < self._current):
            if self.stepper.in_forward:  # the engine went back mid-step: drop this step
                log.warning("'%s': layer %d came after layer %d; the step is dropped and its "
                            "slots returned; prefetch resumes at the next layer 0", self.name,
                            layer, self._current)
                self.stepper.abandon()
                self._current = -1
            self.orphan_layers += 1  # the rest of a dropped or retired step: nothing to do
            return
        if layer == 0:
            self._start_step(sources)
        self.stepper.before(layer)
        self._current = self._open = layer
        if self.verify and self._step_ok and layer in self._valid:
            check_slot(self, layer, self._sources(layer))

    def end(self, layer: int) -> None:
        """After ``layer``'s attention: its slot retires and the gathers it frees are issued."""
        if self.stepper is None or layer != self._open:
            return  # a layer the step did not begin (no metadata, or after a retire)
        self._open = None
        self.stepper.after(layer)
        if not self.stepper.in_forward:
            self._current = -1
            self._sources = None

    def gathered(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s full context KV while its attention runs (None if not gathered).

        Rows layout: ``[capacity, *row]`` with requests packed in order (request r's rows start
        at the sum of the earlier context lengths); pages layout: the pages likewise. Under
        DCP each request starts at a multiple of ``size * interleave`` rows instead
        (:meth:`request_starts`; Note [DCP layout] in kv_gathers.py).
        """
        if self.stepper is None or not self.stepper.in_forward or not self._step_ok:
            return None
        if layer != self._current or layer not in self._valid:
            return None
        lease = self.stepper.lease(layer)
        return None if lease is None else lease.tensor[: self.capacity]

    def request_starts(self, context_lens: torch.Tensor) -> torch.Tensor:
        """The slot row (rows layout) or page (pages layout) where each request begins, for
        the step's ``context_lens``; computed on the device, no host sync."""
        lens = context_lens.to(torch.int64)
        if self.dcp is not None:
            return dcp_slot_starts(lens, self.dcp.size, self.dcp.interleave)
        units = lens if self.layout.kind == "rows" else ceil_div(lens, self.layout.block_size)
        return torch.cumsum(units, 0) - units

    def retire(self, reason: str) -> None:
        """Forget all per-step state; a step in flight hands its slots back (host sync)."""
        if self.stepper is not None and self.stepper.in_forward:
            self.stepper.abandon()
            log.info("'%s': %s; the step in flight was abandoned and its slots returned",
                     self.name, reason)
        self.pool.reclaim(sync=True)
        self._sources, self._current, self._open, self._step_ok = None, -1, None, False
        self.retired += 1

    # -- internals ----------------------------------------------------------------------------

    def _start_step(self, sources: Callable[[int], KVSource | None]) -> None:
        self._sources = sources
        self._valid.clear()
        self.steps += 1
        first = sources(0)
        reason = None
        if first is None:
            reason = ("no-source", "the engine gave no KV source for the first layer of a step",
                      "check the log line above for why")
        elif first.block_table.shape[0] > self.max_requests:
            reason = ("requests", f"a step of {first.block_table.shape[0]} requests exceeds the "
                      f"{self.max_requests} the ring was sized for", "raise max_requests")
        else:
            bound = first.max_tokens
            if bound is None:  # every block the table can address: a bound with no sync
                bound = first.block_table.numel() * self.layout.block_size * \
                    (self.dcp.size if self.dcp else 1)
            if bound > self.capacity_tokens:
                reason = ("capacity", f"a step with up to {bound:,} context tokens does not fit "
                          f"a slot of {self.capacity_tokens:,}",
                          "raise capacity_tokens (a profile's kv_prefetch.capacity_tokens)")
        self._step_ok = reason is None
        if reason is not None:
            key, what, fix = reason
            count = self.skipped[key] = self.skipped.get(key, 0) + 1
            if count == 1 or count % 1000 == 0:
                log.warning("'%s': %s; it runs without prefetched KV (%d such step(s) so far; "
                            "%s)", self.name, what, count, fix)

    @property
    def skipped_steps(self) -> int:
        return sum(self.skipped.values())

    def _gather(self, layer: int, lane: str, slot: torch.Tensor) -> None:
        if not self._step_ok:
            return
        source = self._sources(layer)
        if source is None:  # the engine has nothing to gather for this layer in this step
            self._valid.discard(layer)
            return
        if self.gather_hook is not None:
            self.gather_hook()
        self._valid.add(layer)
        self._fill(slot, source)

    def _fill(self, slot: torch.Tensor, source: KVSource) -> None:
        out = slot[: self.capacity]
        if self.dcp is not None:
            dcp_gather(source.cache, source.block_table, source.context_lens, out,
                       self._staging(slot), self._exchanger, interleave=self.dcp.interleave)
        elif self.layout.kind == "rows":
            paged_gather(source.cache, source.block_table, source.context_lens, out)
        else:
            page_gather(source.cache, source.block_table, source.context_lens,
                        self.layout.block_size, out)

    def gather_into(self, slot: int, source: KVSource) -> torch.Tensor:
        """Gather ``source`` into ring slot ``slot`` now, on the current stream, outside any
        plan or lease (a benchmark's gather-only loop); returns the slot's full-KV rows. Under
        DCP it is a collective: every rank calls it in the same order."""
        self._fill(self.pool.storage[slot], source)
        return self.pool.storage[slot][: self.capacity]

    def exchange_into(self, slot: int) -> None:
        """Only the DCP exchange of ring slot ``slot``'s parts (what NCCL or the copy engines
        move between the ranks), on the current stream, outside any plan (collective).

        Raises:
            ConfigError: the lane has no DCP group.
        """
        if self.dcp is None:
            raise ConfigError(f"'{self.name}' has no DCP group: there is nothing to exchange")
        storage = self.pool.storage[slot]
        self._exchanger.exchange(storage[: self.capacity], self._staging(storage),
                                 self.dcp.interleave)

    def read_captured_verification(self) -> Verification:
        """Fold the device-side counts of captured checks into :attr:`verification` (host
        sync) and return it."""
        return self.verification.read_device_counts(self.name)


def peer_ring(lane: str, slot_shape: tuple[int, ...], dtype: torch.dtype, depth: int,
              workspace_bytes: int, device: torch.device, group
              ) -> tuple[PeerExchange | None, str]:
    """The ring a ``SlotPool`` of these arguments would allocate, in symmetric memory over
    ``group`` (collective: every rank calls it at the same point), or None and why: copy
    engines need CUDA and symmetric memory on every rank (Note [Peer exchange]).

    Raises:
        BudgetError: the budget holds not one slot (the same on every rank, before any
            collective).
    """
    if device.type != "cuda":
        return None, "copy engines need a CUDA device"
    slots = SlotPool.fit(lane, slot_shape, dtype, depth, workspace_bytes).slots
    try:
        return symmetric_exchange((slots, *slot_shape), dtype, device, group), ""
    except KernelError as exc:  # every rank has it (symmetric_exchange agrees first)
        return None, str(exc)


def check_not_after_kv(kv_sized: bool, name: str) -> None:
    """Refuse to allocate a ring once the engine has sized its KV cache (the budget would lie)."""
    if kv_sized:
        raise LifecycleError(f"'{name}': a full-KV ring was requested after the KV cache was "
                             f"sized; its bytes would come out of memory the cache already "
                             f"counted. Build rings before KV sizing (ringflow's hooks do so when "
                             f"the attention implementation is built)")
