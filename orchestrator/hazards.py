"""HazardCheck: a pure proof that a Dag is safe to run, or the nodes that make it unsafe.

It reads only the Dag (see Note [Issue order and edges] in dag.py) and checks:

* ``wait-without-record``: every wait has a record of its event issued before it;
* ``read-after-write``: every compute of a slot happens-after the gather that wrote its lease;
* ``write-after-read``: a slot's next lease is written only after every read of the previous
  one, and the previous writer, happen-before it;
* ``lease-overlap``: a slot is acquired only after its previous lease was released (host order),
  every lease is released once, after its reads; no two slots alias one byte range, and no two
  lanes share a pool;
* ``unjoined``: every side-stream node happens-before the compute stream's last node;
* ``isolated``: every gather stream starts with its fork wait, and every side-stream node
  happens-after the start of the forward on the compute stream, so it never waits on work
  issued before the forward (or before a capture began);
* ``cross-lane``: a wait never binds to another lane's record (lanes are independent: two
  micro-batches or a target and a draft model must not serialise on each other's gathers);
* ``incomplete``: each lane computes every layer exactly once, in layer order (a plan that
  skips or repeats a layer's compute is no forward of the model);
* ``serialized``: the overlap the plan promises is there. A compute never waits for a later
  layer's gather of its lane, and a prefetching gather depends on no compute of its lane later
  than the reader of its slot's previous lease (none for the first ring-full): no edge forces
  gather l+1 after compute l except the planned slot reuse.

A plan that carries leases across the forward boundary (Note [Forward boundary] in dag.py) is
proven unrolled: its prime, one forward whose tail gathers the next forward's leases, and a
second forward that reads them; every check above then covers the boundary too. Leases are
keyed by (lane, forward, layer).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from ringflow.errors import ConfigError, HazardError
from ringflow.orchestrator.dag import (COMPUTE_STREAM, Dag, EventRole, Node, NodeKind,
                                       gather_stream)

_WRITERS = (NodeKind.GATHER, NodeKind.SYNC_GATHER)


@dataclass
class _LeaseNodes:
    lane: str
    layer: int
    forward: int = 0
    writer: Node | None = None
    readers: list[Node] = field(default_factory=list)
    releases: list[Node] = field(default_factory=list)


def check_hazards(dag: Dag) -> Dag:
    """Prove ``dag`` safe; return it as a proven Dag (``proven=True``, same nodes). A proven Dag
    is returned as it is: it is not checked again.

    Raises:
        HazardError: naming the hazard kind and the offending node ids.
    """
    if not isinstance(dag, Dag):
        raise ConfigError(f"check_hazards proves a Dag (Planner(...).plan() or from_json), not "
                          f"{type(dag).__name__}")
    if dag.proven:
        return dag
    _check_complete(dag)
    if dag.prime:  # each part is captured or issued on its own: each must fork and join
        for part in (dag.nodes, dag.prime):
            alone = Dag(dag.name, dag.layers, dag.pools, part)
            _check_waits(alone)
            _check_fork_join(alone)
    target = _unrolled(dag) if dag.prime else dag
    _check_waits(target)
    _check_pools(target)
    leases = _collect_leases(target)
    _check_leases(target, leases)
    _check_slot_reuse(target, leases)
    _check_fork_join(target)
    _check_lanes(target)
    _check_overlap(target, leases, carried={(lane, layer) for lane, layer, _ in dag.carried})
    proved = dataclasses.replace(dag)  # the same plan; only a copy made here is marked
    object.__setattr__(proved, "proven", True)
    return proved


def _check_complete(dag: Dag) -> None:
    if not dag.nodes:
        raise HazardError("incomplete", f"plan '{dag.name}' has no nodes; it computes none of its "
                          f"{dag.layers} layers", [])
    for pool in dag.pools:
        computes = [n for n in dag.nodes if n.kind is NodeKind.COMPUTE and n.lane == pool.lane]
        if [n.layer for n in computes] != list(range(dag.layers)):
            have = sorted({n.layer for n in computes})
            missing = sorted(set(range(dag.layers)) - set(have))
            raise HazardError(
                "incomplete",
                f"lane '{pool.lane}' must compute layers 0..{dag.layers - 1} once each, in "
                f"order; it computes {len(computes)} time(s)"
                + (f", never layer(s) {missing}" if missing else ", out of order or repeated"),
                [n.id for n in computes])


def _unrolled(dag: Dag) -> Dag:
    """``dag``'s prime, a forward, and a second forward without its tail gathers, as one Dag
    whose nodes carry absolute forward numbers (what the hazard check proves to cover the
    boundary)."""
    nodes: list[Node] = []

    def add(node: Node, forward: int) -> None:
        nodes.append(dataclasses.replace(node, id=len(nodes), forward=forward))

    for node in dag.prime:
        add(node, 0)
    for node in dag.nodes:
        add(node, node.forward)
    for node in dag.nodes:
        if not node.forward:  # the last forward's tail would be reclaimed at teardown
            add(node, 1)
    return Dag(dag.name, dag.layers, dag.pools, tuple(nodes), meta=dict(dag.meta))


def _check_waits(dag: Dag) -> None:
    for node, preds in zip(dag.nodes, dag.predecessors):
        if node.kind is NodeKind.WAIT and not any(kind == "event" for _, kind in preds):
            raise HazardError(
                "wait-without-record",
                f"{node.label} on {node.stream} waits on event '{node.event}', which no node "
                f"recorded before it, so it orders nothing",
                [node.id],
            )
        if node.kind in (NodeKind.RECORD, NodeKind.WAIT) and not node.event:
            raise HazardError("wait-without-record", f"{node.label} names no event", [node.id])


def _check_pools(dag: Dag) -> None:
    by_pool: dict[str, set[str]] = defaultdict(set)
    for pool in dag.pools:
        by_pool[pool.pool].add(pool.lane)
    for name, lanes in by_pool.items():
        if len(lanes) > 1:
            raise HazardError(
                "lease-overlap",
                f"lanes {sorted(lanes)} share pool '{name}'; each lane must own its pool",
                [],
            )
    ranges = sorted(dag.slot_ranges, key=lambda r: (r.pool, r.offset))
    for a, b in zip(ranges, ranges[1:]):
        if a.pool == b.pool and b.offset < a.end:
            raise HazardError(
                "lease-overlap",
                f"slots {a.lane}/{a.index} and {b.lane}/{b.index} alias bytes "
                f"[{b.offset}, {min(a.end, b.end)}) of pool '{a.pool}'",
                [],
            )
    slots = {(p.lane): p.slots for p in dag.pools}
    for node in dag.nodes:
        if node.slot is not None and not 0 <= node.slot < slots.get(node.lane, 0):
            raise HazardError(
                "lease-overlap",
                f"{node.label} uses slot {node.slot} of lane '{node.lane}', whose pool has "
                f"{slots.get(node.lane, 0)} slot(s)",
                [node.id],
            )


def _collect_leases(dag: Dag) -> dict[tuple[str, int, int], _LeaseNodes]:
    leases: dict[tuple[str, int, int], _LeaseNodes] = {}
    for node in dag.nodes:
        if node.slot is None or node.kind not in (*_WRITERS, NodeKind.COMPUTE, NodeKind.RELEASE):
            continue
        key = (node.lane, node.forward, node.layer)
        lease = leases.setdefault(key, _LeaseNodes(node.lane, node.layer, node.forward))
        if node.kind in _WRITERS:
            if lease.writer is not None:
                raise HazardError(
                    "write-after-read",
                    f"layer {node.layer} of lane '{node.lane}' is written twice in one forward",
                    [lease.writer.id, node.id],
                )
            lease.writer = node
        elif node.kind is NodeKind.COMPUTE:
            lease.readers.append(node)
        else:
            lease.releases.append(node)
    return leases


def _check_leases(dag: Dag, leases: dict[tuple[str, int, int], _LeaseNodes]) -> None:
    hb = dag.happens_before
    for lease in leases.values():
        what = f"layer {lease.layer} of lane '{lease.lane}'" + \
            (f" (forward {lease.forward})" if lease.forward else "")
        if lease.writer is None:
            ids = [n.id for n in lease.readers + lease.releases]
            raise HazardError("read-after-write", f"{what} is read but never gathered", ids)
        w = lease.writer
        for reader in lease.readers:
            if reader.slot != w.slot:
                raise HazardError(
                    "read-after-write",
                    f"{reader.label} reads slot {reader.slot} but {w.label} wrote slot {w.slot}",
                    [w.id, reader.id],
                )
            if not hb(w.id, reader.id):
                raise HazardError(
                    "read-after-write",
                    f"{reader.label} may run before {w.label} on {w.stream} finishes writing",
                    [w.id, reader.id],
                )
        if len(lease.releases) != 1:
            raise HazardError(
                "lease-overlap",
                f"{what} is released {len(lease.releases)} times; a lease is released exactly once",
                [w.id] + [n.id for n in lease.releases],
            )
        release = lease.releases[0]
        for node in [w, *lease.readers]:
            if node.id > release.id:
                raise HazardError(
                    "lease-overlap",
                    f"{release.label} hands the slot back before {node.label} was issued",
                    [node.id, release.id],
                )


def _check_slot_reuse(dag: Dag, leases: dict[tuple[str, int, int], _LeaseNodes]) -> None:
    hb = dag.happens_before
    by_slot: dict[tuple[str, int], list[_LeaseNodes]] = defaultdict(list)
    for lease in leases.values():
        by_slot[(lease.lane, lease.writer.slot)].append(lease)
    for (lane, slot), chain in by_slot.items():
        chain.sort(key=lambda x: x.writer.id)
        for prev, nxt in zip(chain, chain[1:]):
            w = nxt.writer
            if prev.releases[0].id > w.id:
                raise HazardError(
                    "lease-overlap",
                    f"slot {slot} of lane '{lane}' is leased to layer {nxt.layer} while layer "
                    f"{prev.layer} still holds it",
                    [prev.releases[0].id, w.id],
                )
            for earlier in [prev.writer, *prev.readers]:
                if not hb(earlier.id, w.id):
                    raise HazardError(
                        "write-after-read",
                        f"{w.label} may overwrite slot {slot} of lane '{lane}' before "
                        f"{earlier.label} is done with layer {prev.layer}",
                        [earlier.id, w.id],
                    )


def _check_fork_join(dag: Dag) -> None:
    main = dag.on_stream(COMPUTE_STREAM)
    side = [n for n in dag.nodes if n.stream != COMPUTE_STREAM]
    if not side:
        return
    if not main:
        raise HazardError("isolated", "side-stream work with no compute-stream node", [side[0].id])
    first, last = main[0], main[-1]
    for lane in {n.lane for n in side}:
        head = next((n for n in side if n.stream == gather_stream(lane)), None)
        if head is not None and (head.kind is not NodeKind.WAIT or head.role is not EventRole.FORK):
            raise HazardError(
                "isolated",
                f"{head.stream} starts with {head.label}, not with its fork wait: a gather stream "
                f"joins the forward (and a capture) by waiting on the compute stream first",
                [head.id])
    for node in side:
        if not dag.happens_before(first.id, node.id):
            raise HazardError(
                "isolated",
                f"{node.label} on {node.stream} does not follow the forward's start on "
                f"{COMPUTE_STREAM}; it could wait on work issued before the forward (or capture)",
                [first.id, node.id],
            )
        if not dag.happens_before(node.id, last.id):
            raise HazardError(
                "unjoined",
                f"{node.label} on {node.stream} is not joined back to {COMPUTE_STREAM} before the "
                f"forward ends",
                [node.id, last.id],
            )


def _check_lanes(dag: Dag) -> None:
    for node, preds in zip(dag.nodes, dag.predecessors):
        for src, kind in preds:
            if kind == "event" and dag.nodes[src].lane != node.lane:
                raise HazardError(
                    "cross-lane",
                    f"{node.label} of lane '{node.lane}' waits on {dag.nodes[src].label} of lane "
                    f"'{dag.nodes[src].lane}'; lanes must not wait on each other's events",
                    [src, node.id])


def _order(node: Node) -> tuple[int, int]:
    return (node.forward, node.layer)


def _prefix_max(dag: Dag, kind: NodeKind, skip=frozenset()) -> dict:
    """Per (stream, lane): the stream positions of ``kind`` nodes (but those of ``skip``
    (lane, layer) pairs), and for each the id of the latest-layer node of that kind up to it
    (so a vector clock finds it with one bisect)."""
    table: dict[tuple[str, str], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for node in dag.nodes:
        if node.kind is kind and (node.lane, node.layer) not in skip:
            positions, best = table[(node.stream, node.lane)]
            keep = best and _order(dag.nodes[best[-1]]) >= _order(node)
            positions.append(dag.positions[node.id])
            best.append(best[-1] if keep else node.id)
    return table


def _latest(dag: Dag, table, stream: str, lane: str, upto: int) -> Node | None:
    entry = table.get((stream, lane))
    if entry is None:
        return None
    i = bisect.bisect_right(entry[0], upto) - 1
    return dag.nodes[entry[1][i]] if i >= 0 else None


def _check_overlap(dag: Dag, leases: dict[tuple[str, int, int], _LeaseNodes],
                   carried=frozenset()) -> None:
    # a carried lease is gathered in the previous forward's tail (or the prime) and ordered by
    # its join, before this forward starts: no compute of this forward loses overlap to it
    gathers = _prefix_max(dag, NodeKind.GATHER, skip=carried)
    computes = _prefix_max(dag, NodeKind.COMPUTE)
    # a gather may follow the reader of its slot's previous lease, and nothing later
    previous: dict[int, tuple[int, int] | None] = {}
    chains: dict[tuple[str, int], list[_LeaseNodes]] = defaultdict(list)
    for lease in leases.values():
        chains[(lease.lane, lease.writer.slot)].append(lease)
    for chain in chains.values():
        chain.sort(key=lambda x: x.writer.id)
        for prev, nxt in zip([None, *chain], chain):
            previous[nxt.writer.id] = None if prev is None else (prev.forward, prev.layer)
    for node in dag.nodes:
        if node.kind not in (NodeKind.COMPUTE, NodeKind.GATHER):
            continue
        for s, stream in enumerate(dag.streams):
            upto = dag.clocks[node.id][s]
            if node.kind is NodeKind.COMPUTE:
                late = _latest(dag, gathers, stream, node.lane, upto)
                if late is not None and _order(late) > _order(node):
                    raise HazardError(
                        "serialized",
                        f"{node.label} waits for {late.label} of a later layer: the prefetch of "
                        f"layer {late.layer} no longer overlaps layer {node.layer}",
                        [late.id, node.id])
            else:
                allowed = previous.get(node.id)
                if allowed is not None and allowed[0] < node.forward and \
                        (node.lane, node.layer) not in carried:
                    # the slot's first lease of a forward: issued at its start, after the fork
                    allowed = (node.forward - 1, float("inf"))
                reader = _latest(dag, computes, stream, node.lane, upto)
                if reader is not None and (allowed is None or _order(reader) > allowed):
                    what = ("the start of the forward" if allowed is None or
                            allowed[1] == float("inf") else
                            f"the reader of its slot's previous lease (layer {allowed[1]})")
                    raise HazardError(
                        "serialized",
                        f"{node.label} waits for {reader.label}, later than {what}: it could "
                        f"start earlier and overlap more",
                        [reader.id, node.id])
