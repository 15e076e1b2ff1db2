"""What ringflow is measured against: the two-slot ring a user writes by hand, and any forward
callable captured into a CUDA graph the plain way."""

from __future__ import annotations

import torch

from ringflow.bench.workload import SyntheticWorkload


class HandRing:
    """The ring a user writes by hand: two slots, a copy stream, and the next gathered layer's
    copy launched before the current gathered layer computes (a lookahead of one)."""

    def __init__(self, work: SyntheticWorkload, layers: int, gathered: set[int], lane: str):
        self.work, self.layers, self.lane = work, layers, lane
        self.order = sorted(gathered)
        self.slots = [torch.empty(work.shape, dtype=work.dtype, device=work.device)
                      for _ in range(2)]
        self.stream = torch.cuda.Stream()
        self.ready = [torch.cuda.Event() for _ in self.order]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]

    def _fetch(self, k: int) -> None:
        with torch.cuda.stream(self.stream):
            if k >= 2:  # slot k % 2 still holds layer k - 2 until its compute is done
                self.stream.wait_event(self.free[k % 2])
            self.work.gather(self.order[k], self.lane, self.slots[k % 2])
            self.ready[k].record()

    def run(self) -> None:
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        if self.order:
            self._fetch(0)
        k = 0
        for layer in range(self.layers):
            if k < len(self.order) and layer == self.order[k]:
                if k + 1 < len(self.order):
                    self._fetch(k + 1)
                compute.wait_event(self.ready[k])
                self.work.compute(layer, self.lane, self.slots[k % 2])
                self.free[k % 2].record(compute)
                k += 1
            else:
                self.work.compute(layer, self.lane, None)
        compute.wait_stream(self.stream)


def side_by_side(first, second, side: torch.cuda.Stream):
    """A callable that runs ``first`` on ``side`` and ``second`` on the current stream, with no
    edge between them, and joins: captured, two branches of one graph (the bench's ``beside``
    variant, ``tools/copy_contention.py``)."""
    def run() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first()
        second()
        torch.cuda.current_stream().wait_stream(side)
    return run


class Graphed:
    """Any forward callable captured once and replayed (warm-up first, outside the capture)."""

    def __init__(self, fn, pool=None) -> None:
        # the graph holds raw pointers into whatever fn's owner allocated (the hand ring's
        # slots, a prefetcher's ring): keep the owner alive as long as the graph, or replays
        # touch freed memory
        self.fn = fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def run(self) -> None:
        self.graph.replay()
