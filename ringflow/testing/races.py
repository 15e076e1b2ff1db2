"""RaceWindows: device-side delays that open the windows a plan's orderings close
(Note [Sizing race windows])."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from ringflow.orchestrator.dag import Dag, NodeKind
from ringflow.timing import elapsed_ms


class RaceWindows:
    """Seeded random device-side delays before gathers (producer) and before computes'
    reads (consumer), long enough to open every window a plan's orderings close.

    Note [Sizing race windows]
        A missing ordering shows only if the two racing operations really overlap on the
        device. Eagerly, the host issues a slot's writer and its reader some nodes apart; the
        device may finish the writer before the host even issues the reader, and then a
        missing READY wait changes nothing. A delay placed on the device before the writer
        (producer side) that is longer than the host's issue time between the two makes the
        reader run first unless it waits; a delay before a reader (consumer side) does the
        same for the next writer of its slot (RETIRE), for the next forward's first gathers
        (FORK) and for a replay on another stream. So the delay is sized as
        ``factor x`` (host issue time per node, measured on the plan's own callables) ``x``
        (the largest number of nodes between a record and its wait in the plan), and converted
        to GPU cycles with the sleep rate measured here. Each gather and compute is delayed
        with probability ``p``, drawn from a seeded generator, so a failing run can be replayed.
        Inside a CUDA graph every branch starts at launch, so the same delays outlast the
        competing kernel instead.

    Args:
        cycles: the delay, in GPU cycles (see :meth:`measured`).
        seed: seeds the per-node draws.
        probability: chance that a given gather or compute is delayed.
    """

    def __init__(self, cycles: int, seed: int, probability: float = 0.5) -> None:
        self.cycles = int(cycles)
        self.probability = probability
        self._rng = random.Random(seed)
        self.delays = 0

    @staticmethod
    def cycles_per_second(device: torch.device | str = "cuda") -> float:
        """GPU sleep rate, timed with events around ``torch.cuda._sleep``."""
        with torch.cuda.device(device):
            torch.cuda._sleep(1000)  # load the kernel
            return 2_000_000 / (elapsed_ms(lambda: torch.cuda._sleep(2_000_000)) / 1e3)

    @staticmethod
    def issue_seconds_per_node(run: Callable[[], None], nodes: int, repeats: int = 5) -> float:
        """Host time per node of ``run()`` (one forward issued with its real callables)."""
        run()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
            torch.cuda.synchronize()
        return best / max(nodes, 1)

    @staticmethod
    def widest_gap(dag: Dag) -> int:
        """The most nodes between a record and a wait on its event (issue order), at least 1."""
        last: dict[str, int] = {}
        gap = 1
        for node in dag.nodes:
            if node.kind is NodeKind.RECORD:
                last[node.event] = node.id
            elif node.kind is NodeKind.WAIT and node.event in last:
                gap = max(gap, node.id - last[node.event])
        return gap

    @classmethod
    def measured(cls, dag: Dag, run: Callable[[], None], *, seed: int, factor: float = 4.0,
                 probability: float = 0.5, floor_seconds: float = 50e-6) -> RaceWindows:
        """Windows for ``dag`` issued by ``run`` (Note [Sizing race windows])."""
        per_node = cls.issue_seconds_per_node(run, len(dag.nodes))
        seconds = max(factor * per_node * cls.widest_gap(dag), floor_seconds)
        return cls(seconds * cls.cycles_per_second(), seed, probability)

    def delay(self) -> None:
        """Maybe sleep on the current stream (a seeded draw)."""
        if self._rng.random() < self.probability:
            self.delays += 1
            torch.cuda._sleep(self.cycles)

    def producer(self, gather):
        """``gather`` with a chance of a delay before it writes (on its own stream)."""
        def delayed(layer, lane, out):
            self.delay()
            return gather(layer, lane, out)
        return delayed

    def consumer(self, compute):
        """``compute`` with a chance of a delay before it reads its slot."""
        def delayed(layer, lane, slot):
            self.delay()
            return compute(layer, lane, slot)
        return delayed


