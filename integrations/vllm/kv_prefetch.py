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
from dataclasses import dataclass

import torch

from ringflow.errors import KernelError, LifecycleError, ProfileError, RingflowError
from ringflow.graphs.eager import EagerExecutor
from ringflow.graphs.stepped import LayerStepper
from ringflow.graphs.sync import SyncExecutor
from ringflow.integrations.vllm.verification import Verification, check_slot
from ringflow.kernels import dcp_gather, dcp_slot_rows, dcp_slot_starts, page_gather, paged_gather
from ringflow.kernels.kv_gathers import NcclExchange, time_exchanges
from ringflow.kernels.peer_exchange import symmetric_exchange
from ringflow.orchestrator.budget import MIB, PoolLayout
from ringflow.orchestrator.planner import Planner
from ringflow.orchestrator.profile import DCP_TRANSPORTS
from ringflow.orchestrator.slots import SlotPool

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
        if self.kind not in LAYOUTS:
            raise RingflowError(f"KV layout must be one of {LAYOUTS}, got {self.kind!r}")
        if self.block_size < 1 or any(d < 1 for d in self.unit):
            raise RingflowError(f"KV layout needs a positive block size and unit shape, got "
                                f"{self.block_size} and {self.unit}")

    def units(self, tokens: int, requests: int) -> int:
        """Slot rows needed for ``tokens`` context tokens over at most ``requests`` requests."""
        if self.kind == "rows":
            return tokens
        return -(-tokens // self.block_size) + requests


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
        if self.transport not in DCP_TRANSPORTS:
            raise RingflowError(f"DCP transport must be one of {', '.join(DCP_TRANSPORTS)}, got "
                                f"{self.transport!r}")


def _noop(layer: int, lane: str, slot: torch.Tensor | None) -> None:
    """The engine's attention is the compute."""


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
        ProfileError: a ring that cannot hold one slot.
        RingflowError: DCP with a pages layout.
    """

    def __init__(self, layout: KVLayout, capacity_tokens: int, *, max_requests: int, depth: int,
                 workspace_bytes: int, device: torch.device | str, dcp: DcpGroup | None = None,
                 verify: bool = False, capture: str = "join", gather_priority: str = "normal",
                 poison: bool = False, name: str = "kv", lane: str = "kv") -> None:
        if dcp is not None and layout.kind != "rows":
            raise RingflowError("a DCP all-gather restores token order and needs a rows layout; "
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
        staging parts."""
        if capacity_tokens < 1 or self.max_requests < 1:
            raise ProfileError("kv_prefetch.capacity_tokens", f"a slot must hold at least one "
                               f"token of one request, got {capacity_tokens} tokens and "
                               f"{self.max_requests} requests")
        layout, dcp = self.layout, self.dcp
        if dcp is None:
            capacity, local = layout.units(capacity_tokens, self.max_requests), 0
        else:
            capacity = dcp_slot_rows(capacity_tokens, self.max_requests, dcp.size, dcp.interleave)
            local = capacity // dcp.size if staged else 0  # a rank's part of every chunk
        rows = capacity + (dcp.size * local if dcp else 0)
        slot_bytes = rows * torch.Size(layout.unit).numel() * layout.dtype.itemsize
        try:
            PoolLayout.fit(self.lane, slot_bytes, self.depth, workspace_bytes)
        except ProfileError:
            raise ProfileError(
                "kv_prefetch.workspace_mib",
                f"a ring of {workspace_bytes / MIB:.2f} MiB is smaller than one full-KV slot "
                f"({slot_bytes / MIB:.2f} MiB for {capacity_tokens:,} tokens"
                f"{' with the NCCL staging parts' if local else ''}); accepted: at least "
                f"{slot_bytes / MIB:.2f} MiB, or fewer capacity_tokens") from None
        return rows, capacity, local

    def _allocate(self, capacity_tokens: int, workspace_bytes: int) -> None:
        """The ring: the one allocation of this lane (Note [Lifecycle]). Under DCP with the
        ``peer`` or ``auto`` transport it lies in symmetric memory; ``peer`` needs no staging
        parts (Note [Peer exchange]), ``auto`` keeps them for NCCL should it win."""
        self.exchange, self.transport, self.transport_ms = None, None, {}
        self._exchanger = None  # NCCL, or the peer exchange
        requested = self.dcp.transport if self.dcp is not None else None
        self.transport = requested
        self._pool(capacity_tokens, workspace_bytes, staged=requested != "peer",
                   symmetric=requested in ("peer", "auto"))
        if requested == "peer" and self.transport == "nccl":  # fell back (logged): NCCL stages
            self.pool.close()
            try:
                self._pool(capacity_tokens, workspace_bytes, staged=True, symmetric=False)
            except ProfileError as exc:
                raise ProfileError("kv_prefetch.workspace_mib",
                                   f"DCP transport 'peer' is unavailable here (logged above) and "
                                   f"NCCL's gather needs staging parts beside each slot: "
                                   f"{str(exc).split(': ', 1)[-1]}") from None
        if self.dcp is not None:
            nccl = NcclExchange(self.dcp.group)
            if self.transport == "auto":  # the symmetric ring is there: it fell back otherwise
                self._choose_transport(nccl)
            self._exchanger = self.exchange if self.transport == "peer" else nccl

    def _pool(self, capacity_tokens: int, workspace_bytes: int, *, staged: bool,
              symmetric: bool) -> None:
        rows, capacity, local = self._sizes(capacity_tokens, workspace_bytes, staged)
        self.pool = SlotPool(self.lane, (rows, *self.layout.unit), self.layout.dtype,
                             depth=self.depth, workspace_bytes=workspace_bytes,
                             device=self.device, allocate=self._symmetric if symmetric else None)
        self.capacity_tokens, self.capacity, self.local_capacity = capacity_tokens, capacity, local

    def _symmetric(self, shape, dtype, device) -> torch.Tensor:
        """The ring in memory every DCP rank maps, or a plain one and NCCL (logged)."""
        why = "copy engines need a CUDA device"
        if device.type == "cuda":
            try:
                self.exchange = symmetric_exchange(shape, dtype, device, self.dcp.group)
                return self.exchange.storage
            except KernelError as exc:
                why = str(exc)
        log.warning("'%s': DCP transport '%s' unavailable (%s); the gather uses NCCL",
                    self.name, self.transport, why)
        self.transport = "nccl"
        return torch.empty(shape, dtype=dtype, device=device)

    def _staging(self, slot: torch.Tensor) -> torch.Tensor | None:
        if not self.local_capacity:
            return None
        return slot[self.capacity:].view(self.dcp.size, self.local_capacity, *self.layout.unit)

    def _choose_transport(self, nccl: NcclExchange) -> None:
        """Time both exchanges on slot 0 (collective); keep peer unless its time is more than
        :data:`PEER_PREFERENCE` times NCCL's."""
        slot = self.pool.storage[0]
        self.transport_ms = time_exchanges(slot[: self.capacity], self._staging(slot),
                                           {"nccl": nccl, "peer": self.exchange}, self.dcp.group,
                                           interleave=self.dcp.interleave)
        # every rank has the slowest rank's times, so every rank chooses the same. Timed alone,
        # the exchanges do not show that the copy engines leave the SMs to the attention (nor
        # that NCCL's path adds an order-restoring pass): peer wins ties and near-ties
        ms = self.transport_ms
        self.transport = "peer" if ms["peer"] <= PEER_PREFERENCE * ms["nccl"] else "nccl"
        log.info("'%s': DCP exchange of a %.1f MiB slot: %s; using %s%s", self.name,
                 slot[: self.capacity].nbytes / MIB,
                 ", ".join(f"{k} {v:.3f} ms" for k, v in self.transport_ms.items()),
                 self.transport, " (the ring keeps NCCL's staging parts, unused; "
                 "dcp_transport: peer drops them)" if self.transport == "peer" else "")

    def resize(self, capacity_tokens: int, workspace_bytes: int) -> None:
        """A new ring for new sizes: every per-step state retires, the old ring is freed after
        its last reader, the new one allocated and the plan rebuilt over it. Host-syncs.

        A CUDA graph captured over the old ring keeps its raw pointers: drop and recapture
        such graphs (vLLM recaptures after it re-initialises its KV cache).

        Raises:
            ProfileError: the new sizes do not fit (checked first: nothing is lost then).
        """
        self._sizes(capacity_tokens, workspace_bytes,
                    self.dcp is not None and self.dcp.transport != "peer")
        self.retire("the workspace is resized")
        self.pool.close()
        layers, self.stepper, self.dag = self.layers, None, None  # no plan over a closed ring
        self._allocate(capacity_tokens, workspace_bytes)
        if layers:
            self.plan(layers)

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes

    def describe(self) -> str:
        return (f"full-KV ring '{self.name}': {self.pool.slots} slot(s) x "
                f"{self.pool.slot_bytes / MIB:.2f} MiB ({self.capacity_tokens:,} tokens, "
                f"{self.layout.kind} layout"
                f"{f', DCP all-gather over {self.transport}' if self.dcp else ''}), "
                f"depth {self.pool.depth}")

    # -- planning -----------------------------------------------------------------------------

    def plan(self, layers: int) -> None:
        """Plan ``layers`` attention layers, every one gathered (host work only; no allocation)."""
        if self.stepper is not None and self.layers == layers:
            return
        if self.stepper is not None and self.stepper.in_forward:
            raise RingflowError(f"'{self.name}': cannot re-plan in the middle of a step")
        self.layers = layers
        self.dag = Planner(layers, [self.pool.layout], gathered=range(layers),
                           name=self.name).plan()
        if self.dcp is not None:  # what the gather lane runs, in every dump of this plan
            self.dag.meta["dcp"] = {"size": self.dcp.size, "interleave": self.dcp.interleave,
                                    "transport": self.transport,
                                    "requested": self.dcp.transport,
                                    "measured_ms": dict(self.transport_ms)}
        if self.device.type == "cuda":
            executor = EagerExecutor(self.dag, [self.pool], self._gather, _noop, poison=False,
                                     **self._executor_options)
        else:
            executor = SyncExecutor(self.dag, [self.pool], self._gather, _noop, poison=False)
        self.stepper = LayerStepper(executor, poison=self.poison)

    # -- the step -----------------------------------------------------------------------------

    def begin(self, layer: int, sources: Callable[[int], KVSource | None]) -> None:
        """Before ``layer``'s attention (or its KV update, whichever comes first).

        Waits for the layer's gather on the current stream and issues the gathers the plan
        puts before it. Layer 0 starts a step and ``sources`` becomes the step's sources; a
        second ``begin`` of the layer in flight (update, then attention) does nothing.
        """
        if self.stepper is None:
            raise RingflowError(f"'{self.name}' has no plan; call plan(layers) first")
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
        units = lens if self.layout.kind == "rows" else -(-lens // self.layout.block_size)
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
                          "raise kv_prefetch.capacity_tokens")
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
        out = slot[: self.capacity]
        if self.dcp is not None:
            dcp_gather(source.cache, source.block_table, source.context_lens, out,
                       self._staging(slot), self._exchanger, interleave=self.dcp.interleave)
        elif self.layout.kind == "rows":
            paged_gather(source.cache, source.block_table, source.context_lens, out)
        else:
            page_gather(source.cache, source.block_table, source.context_lens,
                        self.layout.block_size, out)

    def read_captured_verification(self) -> Verification:
        """Fold the device-side counts of captured checks into :attr:`verification` (host
        sync) and return it."""
        return self.verification.read_device_counts(self.name)


def check_not_after_kv(kv_sized: bool, name: str) -> None:
    """Refuse to allocate a ring once the engine has sized its KV cache (the budget would lie)."""
    if kv_sized:
        raise LifecycleError(f"'{name}': a full-KV ring was requested after the KV cache was sized; "
                         f"its bytes would come out of memory the cache already counted. Build "
                         f"rings before KV sizing (ringflow's hooks do so when the attention "
                         f"implementation is built)")
