"""Stand-ins for symmetric memory in CPU tests of the copy-engine exchange (Note [Peer
exchange]): every rank maps every rank's ring, and the barrier is a real one, so a pull
before its owner's write reads the NaN the rings start with."""

import torch


def symmetric_view(ring: torch.Tensor, shape, dtype, offset: int) -> torch.Tensor:
    """``get_buffer``'s answer: ``shape`` elements of ``dtype`` from element ``offset`` of
    ``ring``'s memory (symmetric memory's own offsets count in the dtype asked for)."""
    flat = ring.view(-1).view(dtype)
    return flat[offset: offset + torch.Size(shape).numel()].view(shape)


class ThreadRings:
    """Stands in for symmetric memory between threads: every 'rank' maps every ring, and the
    barrier is a real one, so a pull before its owner's pack reads NaN and fails the test."""

    def __init__(self, rings: list[torch.Tensor]) -> None:
        import threading
        self.rings, self.wall = rings, threading.Barrier(len(rings))
        self.barriers, self._count = 0, threading.Lock()

    def get_buffer(self, rank, shape, dtype, offset):
        return symmetric_view(self.rings[rank], shape, dtype, offset)

    def barrier(self, channel=0, timeout_ms=0):
        with self._count:
            self.barriers += 1
        self.wall.wait(timeout=30)


class ProcessRings:
    """Stands in for symmetric memory between processes: every rank's ring in shared memory,
    mapped by all, and a real barrier (gloo), so a pull before its owner's write reads NaN."""

    def __init__(self, rings, group, slow: bool = False) -> None:
        self.rings, self.group, self.barriers = rings, group, 0
        self.slow = slow  # this rank is late: 0.2 s after every barrier

    def get_buffer(self, rank, shape, dtype, offset):
        return symmetric_view(self.rings[rank], shape, dtype, offset)

    def barrier(self, channel=0, timeout_ms=0):
        import time

        import torch.distributed as dist
        self.barriers += 1
        dist.barrier(group=self.group)
        if self.slow:
            time.sleep(0.2)
