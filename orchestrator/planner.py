"""Planner: turns layers x lanes x slot rings into a Dag in host issue order.

Note [When a gather is issued]
    Each lane's gathered layers take the ring's slots in rotation: the i-th gathered layer uses
    slot ``i % slots``. A prefetching gather is issued at the earliest point its slot allows:
    right after the compute that read the slot's previous lease (its ``retire`` record), at
    the start of the forward for a slot's first lease, never "a fixed number of layers ahead".
    Ring size is memory, not lookahead: even a ring of one slot prefetches, its gather starting
    as soon as the previous gathered layer's compute is done, so with resident layers in
    between (weights streaming with only some layers offloaded) every copy still hides behind
    them.

    Only a layer the plan must not prefetch becomes a ``sync_gather`` on the compute stream:
    one the profile marks ``ineligible``, or every layer of a ``synchronous`` plan. It still
    takes its turn in the rotation, so it waits for the slot's previous reader and the slot's
    next writer waits for it: the synchronous fallback is ordered after every pending user of
    what it touches (a bug the hand-written CKV ring shipped).

    Lanes whose sources do not change between forwards (``cross_forward``) also issue, after a
    slot's last reader in the forward, the gather of the next forward's first lease of that
    slot (Note [Forward boundary] in dag.py), where compute still follows to hide it. A slot
    whose last reader is the forward's last layer is filled at the next forward's start
    instead, where it overlaps that forward's first layers.

    Gather streams fork from the compute stream at the start (one ``fork`` record/wait per
    lane) and join back at the end (``join``), so a forward never waits on work issued before
    it and leaves no side-stream work behind: both are CUDA graph capture rules, and the fork is
    also what orders this forward's writes after the previous forward's reads, the join what
    orders the next forward's reads of carried slots after this forward's tail gathers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ringflow.errors import PlanError
from ringflow.orchestrator.budget import MAX_LAYERS, PoolLayout
from ringflow.orchestrator.dag import COMPUTE_STREAM, Dag, EventRole, Node, NodeKind, gather_stream
from ringflow.orchestrator.hazards import check_hazards


@dataclass
class _Lease:
    """One gathered layer of one lane: which slot it takes and how it is written."""

    layer: int
    slot: int
    sync: bool
    forward: int = 0  # 1: the next forward's lease, gathered in this forward's tail
    carried: bool = False  # filled before the forward starts (by the previous one's tail)
    previous: _Lease | None = None  # the slot's previous lease in this forward
    following: _Lease | None = None  # the slot's next lease (maybe the next forward's)
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
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise PlanError(f"{name} must be a collection of layer indices (a list or a set), got "
                        f"{type(layers).__name__} {layers!r:.40}")
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
        meta: more facts to record in the plan's ``meta`` (what the caller decided around it,
            such as a DCP lane's transport), in every dump of it.
    """

    def __init__(
        self,
        layers: int,
        pools: Sequence[PoolLayout],
        *,
        gathered: Iterable[int] | None = None,
        ineligible: Iterable[int] = (),
        cross_forward: Iterable[str] = (),
        synchronous: bool = False,
        name: str = "plan",
        meta: Mapping[str, object] | None = None,
    ) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
            raise PlanError(f"layers must be an integer in 1..{MAX_LAYERS}, got {layers!r}")
        if not pools:
            raise PlanError("a plan needs at least one lane (one PoolLayout)")
        for pool in pools:
            if not isinstance(pool, PoolLayout):
                raise PlanError(f"pools must be PoolLayouts (SlotPool(...).layout, or "
                                f"profile.pool_layouts()), got {type(pool).__name__} "
                                f"{pool!r:.40}")
        self.layers = layers
        self.pools = tuple(pools)
        self.gathered = _layer_set("gathered", gathered, layers, set(range(layers)))
        self.ineligible = _layer_set("ineligible", ineligible, layers, set())
        self.cross_forward = set(cross_forward)
        unknown = self.cross_forward - {p.lane for p in self.pools}
        if unknown:
            raise PlanError(f"cross_forward names lanes {sorted(unknown)} the plan does not have "
                            f"({', '.join(p.lane for p in self.pools)})")
        self.synchronous = bool(synchronous)
        self.meta = dict(meta or {})
        self.name = name

    @classmethod
    def from_profile(cls, profile) -> Planner:
        """A planner for ``profile`` (a :class:`~ringflow.orchestrator.profile.Profile`)."""
        return cls(
            profile.layers,
            profile.pool_layouts(),
            gathered=None if profile.gathered_layers is None else sorted(profile.gathered_layers),
            ineligible=sorted(profile.ineligible),
            cross_forward=profile.cross_forward,
            synchronous=profile.synchronous,
            name=profile.name,
        )

    def plan(self) -> Dag:
        """Build the forward's Dag and prove it with :func:`check_hazards`."""
        b = _Builder()
        rings = {p.lane: self._leases(p) for p in self.pools}
        by_layer = {(lane, lease.layer): lease for lane, ring in rings.items() for lease in ring
                    if not lease.forward}
        cursor = dict.fromkeys(rings, 0)
        forked = [lane for lane, ring in rings.items()
                  if any(not x.sync and not x.carried for x in ring)]

        def pump(lane: str) -> None:
            """Issue, in order, every prefetching gather of ``lane`` whose slot is free."""
            ring = rings[lane]
            while cursor[lane] < len(ring):
                lease = ring[cursor[lane]]
                previous = lease.previous
                if previous is not None and not previous.released:
                    return  # the slot is still leased; the gather follows its release
                cursor[lane] += 1
                if lease.sync or lease.carried:
                    continue  # issued by the compute stream, or already in its slot
                stream = gather_stream(lane)
                if previous is not None:
                    b.add(NodeKind.WAIT, stream, lane, layer=lease.layer, slot=lease.slot,
                          event=_event(lane, EventRole.RETIRE, previous.layer),
                          role=EventRole.RETIRE, forward=lease.forward)
                b.add(NodeKind.GATHER, stream, lane, layer=lease.layer, slot=lease.slot,
                      forward=lease.forward)
                if not lease.forward:  # a carried lease is ordered by the forward's join
                    b.add(NodeKind.RECORD, stream, lane, layer=lease.layer, slot=lease.slot,
                          event=_event(lane, EventRole.READY, lease.layer), role=EventRole.READY)

        _fork(b, forked)
        for lane in forked:
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
                elif not lease.carried:
                    b.add(NodeKind.WAIT, COMPUTE_STREAM, lane, layer=layer, slot=slot,
                          event=_event(lane, EventRole.READY, layer), role=EventRole.READY)
                b.add(NodeKind.COMPUTE, COMPUTE_STREAM, lane, layer=layer, slot=slot)
                if lease.following is not None and not lease.following.sync:
                    # the slot's next writer runs on the gather stream: it must see this retire
                    b.add(NodeKind.RECORD, COMPUTE_STREAM, lane, layer=layer, slot=slot,
                          event=_event(lane, EventRole.RETIRE, layer), role=EventRole.RETIRE)
                b.add(NodeKind.RELEASE, COMPUTE_STREAM, lane, layer=layer, slot=slot)
                lease.released = True
                if lane in forked:
                    pump(lane)

        _join(b, forked)
        prime = _Builder()
        carried = {lane: [x for x in ring if x.carried] for lane, ring in rings.items()}
        primed = [lane for lane, leases in carried.items() if leases]
        _fork(prime, primed)
        for lane in primed:
            for lease in carried[lane]:
                prime.add(NodeKind.GATHER, gather_stream(lane), lane, layer=lease.layer,
                          slot=lease.slot)
        _join(prime, primed)
        dag = Dag(self.name, self.layers, self.pools, tuple(b.nodes),
                  meta={"gathered": sorted(self.gathered), "ineligible": sorted(self.ineligible),
                        "cross_forward": sorted(primed), "synchronous": self.synchronous,
                        **self.meta},
                  prime=tuple(prime.nodes))
        return check_hazards(dag)  # every plan is proven before anyone can run it

    def _leases(self, pool: PoolLayout) -> list[_Lease]:
        """The lane's leases in issue order: this forward's, then (cross-forward lanes) the
        next forward's first leases of slots whose last reader is not the last layer."""
        n = pool.slots
        ring = [_Lease(layer, i % n, sync=self.synchronous or layer in self.ineligible)
                for i, layer in enumerate(sorted(self.gathered))]
        last_on_slot: dict[int, _Lease] = {}
        for lease in ring:
            lease.previous = last_on_slot.get(lease.slot)
            if lease.previous is not None:
                lease.previous.following = lease
            last_on_slot[lease.slot] = lease
        if pool.lane not in self.cross_forward:
            return ring
        ahead = []
        for first in ring[:n]:
            last = last_on_slot[first.slot]
            if first.sync or last.sync or last.layer == self.layers - 1:
                continue  # nothing left to hide it behind: it is gathered at the next start
            first.carried = True
            nxt = _Lease(first.layer, first.slot, sync=False, forward=1, previous=last)
            last.following = nxt
            ahead.append(nxt)
        # issued in the order their slots free up (the pump issues a lane's gathers in order)
        ahead.sort(key=lambda x: x.previous.layer)  # ring is in layer order
        return ring + ahead


def _fork(b: _Builder, lanes: list[str]) -> None:
    for lane in lanes:
        b.add(NodeKind.RECORD, COMPUTE_STREAM, lane, event=_event(lane, EventRole.FORK),
              role=EventRole.FORK)
    for lane in lanes:
        b.add(NodeKind.WAIT, gather_stream(lane), lane, event=_event(lane, EventRole.FORK),
              role=EventRole.FORK)


def _join(b: _Builder, lanes: list[str]) -> None:
    for lane in lanes:
        b.add(NodeKind.RECORD, gather_stream(lane), lane, event=_event(lane, EventRole.JOIN),
              role=EventRole.JOIN)
        b.add(NodeKind.WAIT, COMPUTE_STREAM, lane, event=_event(lane, EventRole.JOIN),
              role=EventRole.JOIN)
