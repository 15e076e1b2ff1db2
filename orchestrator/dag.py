"""The plan of one forward pass: typed nodes in host issue order, and the edges they imply.

Note [Forward boundary]
    A lane whose sources do not change between forwards (streamed weights) may fill the next
    forward's first slots during this forward's tail, behind its last layers' compute. Such a
    plan carries leases across the boundary: its tail gathers write the *next* forward's lease
    (``forward=1``), the next forward's computes of those layers read them without a wait of
    their own (the forward's final join ordered the whole gather stream before its end), and
    the slots stay leased in between. ``Dag.prime`` is the step that fills them when nothing
    was carried in (the first forward; after a forward was abandoned, or the ring reclaimed):
    a fork, the gathers, a join. Every forward of such a plan has the same entry and exit
    contract (those slots leased and filled, ordered before the forward starts), so CUDA graphs
    of different buckets replay in any order and eager and captured forwards can alternate.
    The hazard check proves the boundary on the plan unrolled: prime, then two forwards.

Note [Issue order and edges]
    ``Dag.nodes`` is the order in which an executor issues work from the host. Two kinds of
    happens-before edge follow from it, exactly as CUDA defines them:

    * stream edges: a node runs after the previous node on the same stream;
    * event edges: a ``wait`` on event E runs after the most recent ``record`` of E issued before
      it (a wait issued before any record of its event waits for nothing; the hazard check
      rejects that).

    Edges are derived, never stored, so a dump, a mutation in a test and an executor always agree
    on what the plan means. Issue order is a topological order of the edges by construction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from ringflow.errors import PlanError
from ringflow.orchestrator.budget import PoolLayout, SlotRange

COMPUTE_STREAM = "compute"


def gather_stream(lane: str) -> str:
    """Name of the side stream that runs ``lane``'s prefetching gathers."""
    return f"gather/{lane}"


class NodeKind(str, enum.Enum):
    GATHER = "gather"  # writes a slot ahead of its layer, on the lane's gather stream
    SYNC_GATHER = "sync_gather"  # writes a slot on the compute stream, for layers not prefetched
    COMPUTE = "compute"  # the layer's work; reads its slot if it has one
    RECORD = "record"  # records ``event`` on ``stream``
    WAIT = "wait"  # makes ``stream`` wait for the latest record of ``event``
    RELEASE = "release"  # hands the lease's slot back to the pool (host bookkeeping)

    def __str__(self) -> str:
        return self.value


class EventRole(str, enum.Enum):
    FORK = "fork"  # compute stream -> gather stream at the start of the forward
    READY = "ready"  # after a gather: the slot holds the layer's data
    RETIRE = "retire"  # after the last read: the slot may be rewritten
    JOIN = "join"  # gather stream -> compute stream at the end of the forward

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Node:
    """One step of the plan. ``slot`` is the ring index a gather writes or a compute reads."""

    id: int
    kind: NodeKind
    stream: str
    lane: str
    layer: int | None = None
    slot: int | None = None
    event: str | None = None
    role: EventRole | None = None
    forward: int = 0  # a gather of the next forward's lease: 1 (Note [Forward boundary])

    @property
    def nvtx_name(self) -> str:
        """``ringflow/<lane>/<kind>/L<layer>``; events add their role (``wait.ready``)."""
        kind = f"{self.kind}.{self.role}" if self.role is not None else str(self.kind)
        tail = f"/L{self.layer}" if self.layer is not None else ""
        return f"ringflow/{self.lane}/{kind}{tail}"

    @property
    def label(self) -> str:
        parts = [f"n{self.id}", str(self.kind)]
        if self.role is not None:
            parts.append(str(self.role))
        if self.layer is not None:
            parts.append(f"L{self.layer}" + (f"@F+{self.forward}" if self.forward else ""))
        if self.slot is not None:
            parts.append(f"s{self.slot}")
        return " ".join(parts)


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    kind: str  # "stream" or "event"


@dataclass(frozen=True)
class Dag:
    """One forward pass: nodes in issue order over the lanes' slot pools."""

    name: str
    layers: int
    pools: tuple[PoolLayout, ...]
    nodes: tuple[Node, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    prime: tuple[Node, ...] = ()  # fills the carried slots (Note [Forward boundary])
    #: set only by :func:`~ringflow.orchestrator.hazards.check_hazards`, on the copy it returns;
    #: a proven Dag is not checked again (executors check every Dag they are given). Not an
    #: argument: any Dag built or ``dataclasses.replace``-d from another starts unproven.
    proven: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for nodes in (self.nodes, self.prime):
            for position, node in enumerate(nodes):
                if node.id != position:
                    raise PlanError(f"node ids must be their issue positions: node {node.id} is "
                                    f"at {position}")
        lanes = [p.lane for p in self.pools]
        if len(set(lanes)) != len(lanes):
            raise PlanError(f"each lane owns exactly one pool; lanes {lanes} repeat")

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(p.lane for p in self.pools)

    @cached_property
    def carried(self) -> tuple[tuple[str, int, int], ...]:
        """``(lane, layer, slot)`` of every lease a forward starts with (filled by the previous
        forward's tail, or by :attr:`prime`)."""
        return tuple((n.lane, n.layer, n.slot) for n in self.prime if n.kind is NodeKind.GATHER)

    @cached_property
    def streams(self) -> tuple[str, ...]:
        seen = dict.fromkeys([COMPUTE_STREAM])
        seen.update(dict.fromkeys(n.stream for n in self.nodes))
        return tuple(seen)

    @cached_property
    def slot_ranges(self) -> tuple[SlotRange, ...]:
        return tuple(r for p in self.pools for r in p.slot_ranges())

    @cached_property
    def predecessors(self) -> tuple[tuple[tuple[int, str], ...], ...]:
        """For each node, its direct happens-before predecessors as ``(node id, edge kind)``.

        A wait whose event was never recorded before it has no event predecessor.
        """
        last_on_stream: dict[str, int] = {}
        last_record: dict[str, int] = {}
        preds: list[tuple[tuple[int, str], ...]] = []
        for node in self.nodes:
            mine: list[tuple[int, str]] = []
            if node.stream in last_on_stream:
                mine.append((last_on_stream[node.stream], "stream"))
            if node.kind is NodeKind.WAIT and node.event in last_record:
                mine.append((last_record[node.event], "event"))
            if node.kind is NodeKind.RECORD:
                last_record[node.event] = node.id
            last_on_stream[node.stream] = node.id
            preds.append(tuple(mine))
        return tuple(preds)

    @property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(
            Edge(src, node.id, kind)
            for node, preds in zip(self.nodes, self.predecessors)
            for src, kind in preds
        )

    @cached_property
    def positions(self) -> tuple[int, ...]:
        """Each node's position on its own stream."""
        count: dict[str, int] = {}
        out = []
        for node in self.nodes:
            out.append(count.get(node.stream, 0))
            count[node.stream] = out[-1] + 1
        return tuple(out)

    @cached_property
    def clocks(self) -> tuple[tuple[int, ...], ...]:
        """Vector clocks: ``clocks[b][s]`` is the last position on stream ``streams[s]`` of a node
        that happens-before node ``b`` (-1 if none). Streams are chains, so this is exact, and
        costs nodes x streams instead of nodes squared."""
        index = {name: i for i, name in enumerate(self.streams)}
        width = len(self.streams)
        out: list[tuple[int, ...]] = []
        for node, preds in zip(self.nodes, self.predecessors):
            clock = [-1] * width
            for src, _ in preds:
                for i, value in enumerate(out[src]):
                    if value > clock[i]:
                        clock[i] = value
                s = index[self.nodes[src].stream]
                clock[s] = max(clock[s], self.positions[src])
            out.append(tuple(clock))
        return tuple(out)

    def happens_before(self, a: int, b: int) -> bool:
        """True when node ``a`` is guaranteed to finish before node ``b`` starts."""
        stream = self.streams.index(self.nodes[a].stream)
        return a != b and self.positions[a] <= self.clocks[b][stream]

    def on_stream(self, stream: str) -> list[Node]:
        return [n for n in self.nodes if n.stream == stream]
