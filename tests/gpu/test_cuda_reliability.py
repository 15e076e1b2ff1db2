"""Reliability on a GPU: a 10,000-replay soak with flat memory and identical outputs, and an
interrupted benchmark that leaves no device or pinned memory behind."""

import gc

import pytest
import torch

from ringflow import Planner, Profile, SlotPool, SyncExecutor
from ringflow.bench import scenarios as bench
from ringflow.graphs.captured import CapturedExecutor
from ringflow.bench.workload import SyntheticWorkload

pytestmark = pytest.mark.cuda


def test_ten_thousand_replays_keep_memory_flat_and_outputs_identical():
    profile = Profile.load("demo").replace(lanes=["a", "b"])
    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    work = SyntheticWorkload(profile, "cuda")
    sync = SyncExecutor(dag, pools, work.gather, work.compute)
    captured = CapturedExecutor(dag, pools, work.gather, work.compute, poison=True)
    captured.run()
    sync.run()  # cuBLAS makes its default-stream workspace on first use: not part of the soak
    gc.collect()  # earlier tests' models must not be collected mid-soak
    torch.cuda.synchronize()
    start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    compared = 0
    for i in range(10_000):
        work.refresh(i, sources=i % 2000 == 0)  # fresh inputs every replay
        if i % 10 == 0:  # every tenth replay is checked against the synchronous path
            sync.run()
            want = work.outputs()
            captured.run()
            got = work.outputs()
            assert all(torch.equal(got[k], want[k]) for k in want), f"replay {i} differs"
            compared += 1
            del want, got
        else:
            calls = torch.cuda.memory_stats()["allocation.all.allocated"]
            captured.run()
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == calls
    torch.cuda.synchronize()
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == start
    assert compared == 1000 and all(p.free_count == p.slots for p in pools)


def test_an_interrupted_benchmark_leaves_no_device_or_pinned_memory(monkeypatch):
    profile = Profile.load("demo").replace(slot={"shape": [4096, 1024], "dtype": "bfloat16"},
                                           workspace_mib=64)
    bench.release_memory()
    torch._C._cuda_clearCublasWorkspaces()  # nothing captured is alive between tests
    before = torch.cuda.memory_allocated()
    pinned_before = pinned_bytes()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "interleaved_ms", interrupt)  # the timing loop, mid-measurement
    with pytest.raises(KeyboardInterrupt):
        bench.run_profile("interrupted", profile, replays=2)
    gc.collect()
    # torch keeps a cuBLAS workspace per stream a GEMM ran on; every graph of the bench is gone
    # by now, so dropping them here is safe and leaves only what ringflow might have leaked
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == before
    assert pinned_bytes() == pinned_before


def pinned_bytes():
    """Pinned host bytes in use (torch's host allocator), or None where torch cannot say."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return stats[key]
    return None
