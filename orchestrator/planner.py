"""Planner: turns layers x lanes x slot rings into a Dag in host issue order.

Note [When a gather is issued]
    Each lane's gathered layers take the ring's slots in rotation: the i-th gathered layer uses
    slot ``i % slots``. A prefetching gather is issued at the earliest point its slot allows: at
    the start of the forward for the first ring-full, otherwise right after the compute that
    read the slot's previous lease (its ``retire`` record), never "a fixed number of layers
    ahead" and never across a forward boundary. With resident layers in between (weights
    streaming with only some layers offloaded) this starts each copy as soon as its slot is
    free, so the copies hide behind the resident layers.

    A layer the plan cannot prefetch (``ineligible``, or every layer at depth 0) becomes a
    ``sync_gather`` on the compute stream. It still takes its turn in the rotation, so it waits
    for the slot's previous reader and the slot's next writer waits for it: the synchronous
    fallback is ordered after every pending user of what it touches (a bug the hand-written CKV
    ring shipped).

    Gather streams fork from the compute stream at the start (one ``fork`` record/wait per
    lane) and join back at the end (``join``), so a forward never waits on work issued before
    it and leaves no side-stream work behind: both are CUDA graph capture rules, and the fork is
    also what orders this forward's writes after the previous forward's reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ringflow.errors import PlanError
from ringflow.orchestrator.budget import MAX_LAYERS, PoolLayout
from ringflow.orchestrator.dag import COMPUTE_STREAM, Dag, EventRole, Node, NodeKind, gather_stream
from ringflow.orchestrator.hazards import check_hazards


@dataclass
class _Lease:
    """One gathered layer of one lane: which slot it takes and how it is written."""

    index: int  # position among the lane's gathered layers
    layer: int
    slot: int
    sync: bool
    released: bool = False


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, kind: NodeKind, stream: str, lane: str, **fields) -> None:
        self.nodes.append(Node(len(self.nodes), kind, stream, lane, **fields))


def _event(lane: str, role: EventRole, layer: int | None = None) -> str:
    return f"{lane}/{role}" + (f"/L{layer}" if layer is not None else "")


def _layer_set(name: str, layers: Iterable[int] | None, count: int, default: set[int]) -> set[int]:
    if layers is None:
        return set(default)
    chosen = set()
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
            raise PlanError(
                f"{name} must hold layer indices in 0..{count - 1}, got {layer!r}; "
                f"fix the layer set or the layer count"
            )
        chosen.add(layer)
    return chosen


class Planner:
    """Plans one forward pass of ``layers`` layers over one slot ring per lane.

    Args:
        layers: number of layers in the forward (>= 1).
        pools: one :class:`PoolLayout` per lane, in lane order; each lane's effective depth is
            its ring size minus one.
        gathered: layers that need a gather (``None``: every layer). Others compute from
            resident data and take no slot.
        ineligible: gathered layers the plan may not prefetch; they run as ``sync_gather``.
        name: carried into dumps.
    """

    def __init__(
        self,
        layers: int,
        pools: Sequence[PoolLayout],
        *,
        gathered: Iterable[int] | None = None,
        ineligible: Iterable[int] = (),
        name: str = "plan",
    ) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
            raise PlanError(f"layers must be an integer in 1..{MAX_LAYERS}, got {layers!r}")
        if not pools:
            raise PlanError("a plan needs at least one lane (one PoolLayout)")
        self.layers = layers
        self.pools = tuple(pools)
        self.gathered = _layer_set("gathered", gathered, layers, set(range(layers)))
        self.ineligible = _layer_set("ineligible", ineligible, layers, set())
        self.name = name

    @classmethod
    def from_profile(cls, profile) -> Planner:
        """A planner for ``profile`` (a :class:`~ringflow.orchestrator.profile.Profile`)."""
        return cls(
            profile.layers,
            profile.pool_layouts(),
            gathered=None if profile.gathered_layers is None else sorted(profile.gathered_layers),
            ineligible=sorted(profile.ineligible),
            name=profile.name,
        )

    def plan(self) -> Dag:
        """Build the forward's Dag and prove it with :func:`check_hazards`."""
        b = _Builder()
        rings = {p.lane: self._leases(p) for p in self.pools}
        by_layer = {(lane, lease.layer): lease for lane, ring in rings.items() for lease in ring}
        slots = {p.lane: p.slots for p in self.pools}
        cursor = dict.fromkeys(rings, 0)
        forked = [lane for lane, ring in rings.items() if any(not x.sync for x in ring)]

        def pump(lane: str) -> None:
            """Issue, in order, every prefetching gather of ``lane`` whose slot is free."""
            ring, n = rings[lane], slots[lane]
            while cursor[lane] < len(ring):
                lease = ring[cursor[lane]]
                previous = ring[lease.index - n] if lease.index >= n else None
                if previous is not None and not previous.released:
                    return  # the slot is still leased; the gather follows its release
                cursor[lane] += 1
                if lease.sync:
                    continue  # issued by the compute stream when its layer comes
                stream = gather_stream(lane)
                if previous is not None:
                    b.add(NodeKind.WAIT, stream, lane, layer=lease.layer, slot=lease.slot,
                          event=_event(lane, EventRole.RETIRE, previous.layer), role=EventRole.RETIRE)
                b.add(NodeKind.GATHER, stream, lane, layer=lease.layer, slot=lease.slot)
                b.add(NodeKind.RECORD, stream, lane, layer=lease.layer, slot=lease.slot,
                      event=_event(lane, EventRole.READY, lease.layer), role=EventRole.READY)

        for lane in forked:
            b.add(NodeKind.RECORD, COMPUTE_STREAM, lane, event=_event(lane, EventRole.FORK),
                  role=EventRole.FORK)
        for lane in forked:
            b.add(NodeKind.WAIT, gather_stream(lane), lane, event=_event(lane, EventRole.FORK),
                  role=EventRole.FORK)
            pump(lane)

        for layer in range(self.layers):
            for pool in self.pools:
                lane = pool.lane
                lease = by_layer.get((lane, layer))
                if lease is None:
                    b.add(NodeKind.COMPUTE, COMPUTE_STREAM, lane, layer=layer)
                    continue
                slot = lease.slot
                if lease.sync:
                    b.add(NodeKind.SYNC_GATHER, COMPUTE_STREAM, lane, layer=layer, slot=slot)
                else:
                    b.add(NodeKind.WAIT, COMPUTE_STREAM, lane, layer=layer, slot=slot,
                          event=_event(lane, EventRole.READY, layer), role=EventRole.READY)
                b.add(NodeKind.COMPUTE, COMPUTE_STREAM, lane, layer=layer, slot=slot)
                ring = rings[lane]
                successor = lease.index + pool.slots
                if successor < len(ring) and not ring[successor].sync:
                    # the slot's next writer runs on the gather stream: it must see this retire
                    b.add(NodeKind.RECORD, COMPUTE_STREAM, lane, layer=layer, slot=slot,
                          event=_event(lane, EventRole.RETIRE, layer), role=EventRole.RETIRE)
                b.add(NodeKind.RELEASE, COMPUTE_STREAM, lane, layer=layer, slot=slot)
                lease.released = True
                if lane in forked:
                    pump(lane)

        for lane in forked:
            b.add(NodeKind.RECORD, gather_stream(lane), lane, event=_event(lane, EventRole.JOIN),
                  role=EventRole.JOIN)
            b.add(NodeKind.WAIT, COMPUTE_STREAM, lane, event=_event(lane, EventRole.JOIN),
                  role=EventRole.JOIN)

        dag = Dag(self.name, self.layers, self.pools, tuple(b.nodes),
                  meta={"gathered": sorted(self.gathered), "ineligible": sorted(self.ineligible)})
        return check_hazards(dag)  # every plan is proven before anyone can run it

    def _leases(self, pool: PoolLayout) -> list[_Lease]:
        order = sorted(self.gathered)
        return [
            _Lease(i, layer, i % pool.slots, sync=pool.depth == 0 or layer in self.ineligible)
            for i, layer in enumerate(order)
        ]
