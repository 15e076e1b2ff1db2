"""Process groups for multi-process tests and benchmarks: one fresh process per rank, joined
through a file rendezvous (no port is ever taken)."""

from __future__ import annotations


def _group_entry(rank: int, world: int, init: str, backend: str, fn, args) -> None:
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_group(world: int, fn, *args, backend: str = "gloo", rendezvous: str) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in one process group.

    ``fn`` must be importable (module level). Any failure in any rank raises here. ``rendezvous``
    is a path for a file-based init (a fresh one per call), so no port is ever taken.
    """
    import torch.multiprocessing as mp
    mp.spawn(_group_entry, args=(world, f"file://{rendezvous}", backend, fn, args),
             nprocs=world, join=True)


