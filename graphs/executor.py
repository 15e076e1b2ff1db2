"""What every executor shares: binding a Dag's nodes to lease operations and user callables.

Executors issue what the plan says, in the plan's order; they never decide order themselves.
Subclasses say only where work runs (which stream) and how events are recorded and awaited.

Callables:
    ``gather(layer, lane, out)`` fills ``out`` (the leased slot) with the layer's data. It runs
    with the node's stream current (the lane's gather stream, or the compute stream for a
    ``sync_gather``), so work it launches lands on that stream.

    ``compute(layer, lane, slot)`` does the layer's work; ``slot`` is the filled slot, or
    ``None`` for a layer that gathers nothing (resident data).

Note [Prime at the write]
    A cross-forward plan's tail fills the next forward's first slots (the carried leases). A
    forward ringflow's Python issues primes them when they are missing; a forward an engine
    replays from a CUDA graph it captured (vLLM's FULL decode steps) runs no Python of
    ringflow's and reads whatever the carried slots hold. So when the sources change (a weight
    reload), waiting for the next Python-issued forward is too late: the first replay after the
    write would read slots filled from the old data. ``sources_changed`` re-fills them at once,
    on the stream current at the write (the engine's); a caller that cannot know which stream
    the engine replays on next synchronizes after it (``WeightStreamer.writing_weights`` does).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ringflow import envs
from ringflow.errors import ConfigError, ExecutorError, LifecycleError
from ringflow.graphs import nvtx_ranges
from ringflow.orchestrator.dag import Dag, EventRole, Node, NodeKind
from ringflow.orchestrator.hazards import check_hazards
from ringflow.graphs.slots import Lease, LeaseState, SlotPool, poison
from ringflow.orchestrator.vocab import check_choice

log = logging.getLogger("ringflow")

GatherFn = Callable[[int, str, torch.Tensor], Any]
ComputeFn = Callable[[int, str, "torch.Tensor | None"], Any]


def poison_default() -> bool:
    """``RINGFLOW_POISON``: fill each slot with NaN after its last read (Note [Switches] in
    ``ringflow/envs.py``: a value that is not a flag raises ConfigError naming it)."""
    return envs.flag("RINGFLOW_POISON")


def cuda_device_of(pools: Iterable[SlotPool], who: str) -> torch.device:
    """The one CUDA device every pool lives on.

    Raises:
        ExecutorError: the pools are on the CPU or on several devices.
    """
    devices = {p.device for p in pools}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ExecutorError(f"{who} needs every pool on one CUDA device, got "
                            f"{sorted(map(str, devices))}; use SyncExecutor on the CPU")
    return next(iter(devices))


def check_option(what: str, value: object, choices) -> None:
    """An executor option (``capture``, ``gather_priority``) is one of ``choices``.

    Raises:
        ExecutorError: naming the option and what it accepts.
    """
    check_choice(what, value, choices, ExecutorError)


def pools_by_lane(pools: Mapping[str, SlotPool] | Iterable[SlotPool]) -> dict[str, SlotPool]:
    """``pools`` keyed by lane, whichever way they were given."""
    return dict(pools) if isinstance(pools, Mapping) else {p.lane: p for p in pools}


def _pools_by_lane(dag: Dag, pools: Mapping[str, SlotPool] | Iterable[SlotPool]) -> dict[str, SlotPool]:
    by_lane = pools_by_lane(pools)
    for layout in dag.pools:
        pool = by_lane.get(layout.lane)
        if pool is None:
            raise ExecutorError(f"the plan has lane '{layout.lane}' but no pool was given for it; "
                                f"pass one SlotPool per lane ({', '.join(dag.lanes)})")
        if (pool.slots, pool.slot_bytes) != (layout.slots, layout.slot_bytes):
            raise ExecutorError(
                f"pool of lane '{layout.lane}' has {pool.slots} slot(s) of {pool.slot_bytes} B but "
                f"the plan expects {layout.slots} of {layout.slot_bytes} B; plan from the pool's "
                f"layout (Planner(..., [pool.layout for pool in pools]))")
    spans = sorted((p.storage.data_ptr(), p.storage.data_ptr() + p.reserved_bytes, p.lane)
                   for p in by_lane.values() if p.reserved_bytes)
    for (a0, a1, la), (b0, b1, lb) in zip(spans, spans[1:]):
        if b0 < a1 and by_lane[la].device == by_lane[lb].device:
            raise ExecutorError(f"pools of lanes '{la}' and '{lb}' share memory; each lane must own "
                                f"its pool")
    return by_lane


class DagExecutor:
    """Runs one forward pass of a Dag per :meth:`run`. Subclasses: Eager, Sync (and Captured)."""

    kind = "dag"

    def __init__(self, dag: Dag, pools: Mapping[str, SlotPool] | Iterable[SlotPool],
                 gather: GatherFn, compute: ComputeFn, *, poison: bool | None = None) -> None:
        self.dag = check_hazards(dag)  # cheap, and a hand-built Dag gets the same proof
        self.pools = _pools_by_lane(dag, pools)
        self.gather = gather
        self.compute = compute
        self.poison = poison_default() if poison is None else poison
        self._leases: dict[tuple[str, int], Lease] = {}
        self._steps = [nvtx_ranges.ranged(node.nvtx_name, self._bind(node)) for node in dag.nodes]
        # Note [Forward boundary]: what fills the carried slots when nothing was carried in
        self._prime_steps = [nvtx_ranges.ranged(node.nvtx_name, self._bind(node, prime=True))
                             for node in dag.prime]

    # -- what subclasses decide ---------------------------------------------------------------

    def _stream_context(self, stream: str) -> contextlib.AbstractContextManager:
        """Makes ``stream`` current while a gather runs on it."""
        return contextlib.nullcontext()

    def _record(self, node: Node) -> torch.cuda.Event | None:
        """Records the node's event on its stream; returns it (None where streams do not exist)."""
        return None

    def _wait(self, node: Node) -> None:
        """Makes the node's stream wait for the latest record of its event."""

    # -- running ------------------------------------------------------------------------------

    def run(self) -> None:
        """Issue one forward pass. On any exception every leased slot goes back to its pool."""
        path = self.path_for_current_stream()
        path.start_forward()
        path.issue_steps(0, len(path.steps))

    @property
    def steps(self) -> list[Callable[[], None]]:
        """One bound callable per Dag node, in issue order."""
        return self._steps

    def path_for_current_stream(self) -> DagExecutor:
        """The executor that should issue a forward here (see EagerExecutor for captures)."""
        return self

    def start_forward(self) -> None:
        """Begin a forward: no lease is held from a previous one, except the carried leases
        the previous forward's tail filled, which this forward adopts (priming them first when
        they are not all there)."""
        self._leases.clear()
        if not self.dag.prime:
            return
        self.prime()
        for lane, layer, _ in self.dag.carried:
            lease = self.pools[lane].carried.pop((lane, layer))
            lease.mark_ready(None)  # ordered by the previous forward's (or prime's) join
            self._leases[(lane, layer)] = lease

    def sources_changed(self, lane: str) -> None:
        """What ``lane``'s gathers read has changed (an engine rewrote its weights): no slot
        filled from the old data is read again. Between forwards only. The carried slots are
        re-filled here, from the new sources, on the current stream (Note [Prime at the
        write]); every other slot is gathered again by the forward that reads it.

        Raises:
            ConfigError: the plan has no such lane.
            LifecycleError: a forward is in flight.
        """
        if lane not in self.pools:
            raise ConfigError(f"plan '{self.dag.name}' has no lane {lane!r}; lanes: "
                              f"{list(self.pools)}")
        if self._leases:
            raise LifecycleError(f"'{self.dag.name}': lane {lane!r}'s sources changed in the "
                                 f"middle of a forward; change them between forwards")
        self.pools[lane].forget_carried()
        self.prime()

    def primed(self) -> bool:
        """Whether every carried lease of the plan is leased and filled (or being filled)."""
        return all((lane, layer) in self.pools[lane].carried
                   for lane, layer, _ in self.dag.carried)

    def prime(self) -> None:
        """Fill the carried slots unless they already are: the first forward, and any forward
        after a reclaim (an abandoned forward, a closed executor) starts here."""
        if self.primed():
            return
        for pool in self.pools.values():
            pool.forget_carried()
        try:
            for step in self._prime_steps:
                step()
        except BaseException:
            self.abandon()
            raise

    def issue_steps(self, start: int, stop: int) -> None:
        """Issue nodes ``start..stop-1``; on an exception, hand every leased slot back."""
        try:
            for step in self._steps[start:stop]:
                step()
        except BaseException:
            self.abandon()
            raise

    def lease(self, lane: str, layer: int) -> Lease | None:
        """The lease layer ``layer`` of ``lane`` holds in the current forward, if any."""
        return self._leases.get((lane, layer))

    def abandon(self, reason: str | None = None) -> None:
        """Give back every lease of an unfinished forward (host-syncs unless capturing). A
        caller that gives a ``reason`` logs it itself (an engine's deliberate fallback); without
        one the forward failed and this says so."""
        outstanding = sum(pool.reclaim(sync=self._may_sync()) for pool in self.pools.values())
        self._leases.clear()
        if outstanding and reason is None:
            log.warning("forward failed; returned %d leased slot(s) to their pools",
                        outstanding)

    def _may_sync(self) -> bool:
        return True

    # -- binding nodes ------------------------------------------------------------------------

    def _bind(self, node: Node, prime: bool = False) -> Callable[[], None]:
        if node.kind in (NodeKind.GATHER, NodeKind.SYNC_GATHER):
            return self._bind_gather(node, carried=prime or node.forward == 1)
        return {
            NodeKind.COMPUTE: self._bind_compute,
            NodeKind.RECORD: self._bind_record,
            NodeKind.WAIT: self._bind_wait,
            NodeKind.RELEASE: self._bind_release,
        }[node.kind](node)

    def _bind_gather(self, node: Node, *, carried: bool) -> Callable[[], None]:
        pool, key, gather = self.pools[node.lane], (node.lane, node.layer), self.gather
        # a carried lease belongs to the pool until the next forward adopts it
        leases = pool.carried if carried else self._leases
        layer, lane, slot, sync = node.layer, node.lane, node.slot, node.kind is NodeKind.SYNC_GATHER
        context = self._stream_context

        def step() -> None:
            lease = pool.acquire(slot, tag=key)
            leases[key] = lease
            with context(node.stream):
                gather(layer, lane, lease.tensor)
            if sync:  # same stream as its reader: no event needed
                lease.mark_ready(None)

        return step

    def _bind_compute(self, node: Node) -> Callable[[], None]:
        layer, lane, compute = node.layer, node.lane, self.compute
        if node.slot is None:
            return lambda: compute(layer, lane, None)
        key, leases, poisoned = (lane, layer), self._leases, self.poison

        def step() -> None:
            slot = leases[key].begin_read()
            compute(layer, lane, slot)
            if poisoned:  # debug: a later read of this lease without a new gather sees NaN
                poison(slot)

        return step

    def _bind_record(self, node: Node) -> Callable[[], None]:
        key, leases, record = (node.lane, node.layer), self._leases, self._record
        if node.role is EventRole.READY:
            return lambda: leases[key].mark_ready(record(node))
        if node.role is EventRole.RETIRE:
            return lambda: leases[key].retire(record(node))
        return lambda: record(node)

    def _bind_wait(self, node: Node) -> Callable[[], None]:
        wait = self._wait
        return lambda: wait(node)

    def _bind_release(self, node: Node) -> Callable[[], None]:
        key, leases = (node.lane, node.layer), self._leases

        def step() -> None:
            lease = leases.pop(key)
            if lease.state is LeaseState.READING:  # next writer is on this stream: no event
                lease.retire(None)
            lease.release()

        return step
