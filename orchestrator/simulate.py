"""A CPU stream simulator: runs a Dag the way a GPU could, in any legal interleaving.

Each stream is an independent FIFO queue; a ``wait`` binds, when it is issued, to the latest
``record`` of its event issued before it (CUDA's rule) and cannot run before that record ran.
Nothing else orders two streams. A seeded adversarial scheduler picks, at every step, which
runnable stream head runs next (biased towards running gathers early and computes late, where
races bite). Slots are modelled as memory cells: a gather writes ``(forward, lane, layer)`` into
its slot (a tail gather the next forward's), a compute records what it found there. Several
forwards run back to back, so reuse across a forward boundary is exercised too, and so is the
boundary of a plan that carries leases from one forward into the next (Note [Forward boundary]
in dag.py): the plan's prime runs before the first forward and after every reset.

A reset is what a host does between forwards when it reclaims the ring (a forward abandoned
midway, a workspace resize, a KV-cache rebind, an executor closed and a new one built): it waits
for every issued node, hands the leases back, and the next forward primes again.

Use it to check a plan, mutated or hand-built, without a GPU::

    result = simulate(dag, seed=3)
    assert not result.wrong_reads
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ringflow.orchestrator.dag import Dag, Node, NodeKind


@dataclass(frozen=True)
class Read:
    forward: int
    lane: str
    layer: int
    saw: tuple[int, str, int] | None  # the write found in the slot: (forward, lane, layer)

    @property
    def intended(self) -> tuple[int, str, int]:
        return (self.forward, self.lane, self.layer)


@dataclass
class Simulation:
    order: list[tuple[int, int]] = field(default_factory=list)  # (forward, node id) as run
    reads: list[Read] = field(default_factory=list)
    primes: list[int] = field(default_factory=list)  # forwards the prime ran before

    @property
    def wrong_reads(self) -> list[Read]:
        return [r for r in self.reads if r.saw != r.intended]


def simulate(dag: Dag, *, forwards: int = 2, seed: int = 0, linearize: bool = False,
             bias: float = 0.7, resets: Iterable[int] = (),
             abandon: Mapping[int, int] | None = None) -> Simulation:
    """Run ``forwards`` forwards of ``dag`` in one adversarial interleaving.

    Args:
        seed: picks the interleaving (reproducible).
        linearize: run every node on one stream (the SyncExecutor's path).
        bias: probability of preferring a gather-stream head over the compute stream, which
            makes gathers run as early and computes as late as the edges allow.
        resets: forwards before which the host reclaims the ring (and the plan primes again).
        abandon: forward -> how many of its nodes were issued before it failed (the reads it
            did issue are checked); the host then reclaims the ring.
    """
    rng = random.Random(seed)
    abandon = dict(abandon or {})
    resets = set(resets)
    sim = Simulation()
    memory: dict[tuple[str, int], tuple[int, str, int]] = {}
    segment: list[tuple[int, Node]] = []  # (forward, node): prime nodes count as the forward's
    primed = False
    for f in range(forwards):
        if f in resets or not primed:
            _run(segment, rng, linearize, bias, memory, sim)  # the host waits for everything
            segment = []
            if dag.prime:
                sim.primes.append(f)
                segment += [(f, node) for node in dag.prime]
            primed = True
        nodes = dag.nodes[: abandon[f]] if f in abandon else dag.nodes
        segment += [(f, node) for node in nodes]
        if f in abandon:  # the executor reclaims every lease after a host sync
            primed = False
    _run(segment, rng, linearize, bias, memory, sim)
    return sim


def _run(segment, rng, linearize, bias, memory, sim) -> None:
    total = len(segment)
    deps: list[list[int]] = [[] for _ in range(total)]
    last_record: dict[str, int] = {}
    for g, (_, node) in enumerate(segment):  # issue every node in host order, bind waits
        if node.kind is NodeKind.WAIT and node.event in last_record:
            deps[g].append(last_record[node.event])
        if node.kind is NodeKind.RECORD:
            last_record[node.event] = g
    queues: dict[str, list[int]] = {}
    for g, (_, node) in enumerate(segment):
        queues.setdefault("sync" if linearize else node.stream, []).append(g)
    heads = dict.fromkeys(queues, 0)
    done = [False] * total
    while True:
        runnable = [s for s, q in queues.items() if heads[s] < len(q)
                    and all(done[d] for d in deps[q[heads[s]]])]
        if not runnable:
            break
        side = [s for s in runnable if not s.startswith("compute")]
        pool = side if side and rng.random() < bias else runnable
        stream = rng.choice(pool)
        g = queues[stream][heads[stream]]
        heads[stream] += 1
        done[g] = True
        f, node = segment[g]
        sim.order.append((f, node.id))
        if node.kind in (NodeKind.GATHER, NodeKind.SYNC_GATHER):
            memory[(node.lane, node.slot)] = (f + node.forward, node.lane, node.layer)
        elif node.kind is NodeKind.COMPUTE and node.slot is not None:
            sim.reads.append(Read(f, node.lane, node.layer, memory.get((node.lane, node.slot))))
    assert all(done), "the simulator stalled: issue order is not a topological order"
