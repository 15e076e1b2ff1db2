"""EagerExecutor on a GPU: bit-identical to SyncExecutor, with race windows widened by a sleep
kernel on the gather lane and slots poisoned with NaN after their last read."""

from pathlib import Path

import pytest
import torch

from ringflow import EagerExecutor, Planner, Profile, SlotPool, SyncExecutor
from ringflow.testing.tracing import TracingWorkload
from ringflow.bench.workload import SyntheticWorkload

pytestmark = pytest.mark.cuda
# every profile that plans on its own (offload-only profiles are planned from a vLLM model)
PROFILES = [p for p in sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.yaml"))
            if Profile.load(p).layers is not None]
SLEEP_CYCLES = 200_000  # ~0.1 ms at H200 clocks: longer than most layers here
MAX_LAYERS = 6


def sleepy(gather):
    def run(layer, lane, out):
        torch.cuda._sleep(SLEEP_CYCLES)  # lands on the gather stream the executor made current
        gather(layer, lane, out)
    return run


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("race", [False, True], ids=["plain", "sleep+poison"])
def test_eager_is_bit_identical_to_sync_for_every_profile(path, race):
    profile = Profile.load(path)
    if profile.layers > MAX_LAYERS:  # the 61-layer 400k-token profile: its slots, fewer layers
        profile = profile.replace(layers=MAX_LAYERS, ineligible=[l for l in profile.ineligible
                                                                 if l < MAX_LAYERS])
    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    work = SyntheticWorkload(profile, "cuda")
    gather = sleepy(work.gather) if race else work.gather
    sync = SyncExecutor(dag, pools, work.gather, work.compute, poison=race)
    eager = EagerExecutor(dag, pools, gather, work.compute, poison=race,
                          gather_priority=profile.gather_priority)
    for seed in range(3):
        work.refresh(100 + seed)  # fresh random data for every forward
        sync.run()
        want = work.outputs()
        work.refresh(100 + seed)
        eager.run()
        got = work.outputs()
        for lane in profile.lanes:
            assert not torch.isnan(got[lane]).any(), "a read saw a poisoned (released) slot"
            assert torch.equal(got[lane], want[lane]), f"lane {lane} differs at seed {seed}"
    torch.cuda.synchronize()
    assert all(p.free_count == p.slots for p in pools)
    for p in pools:
        p.close()


def test_gather_priority_high_makes_high_priority_side_streams():
    pool = SlotPool("kv", (16,), torch.float32, depth=1, workspace_bytes=1 << 10, device="cuda")
    dag = Planner(3, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 3, (16,), "cuda")
    high = EagerExecutor(dag, [pool], trace.gather, trace.compute, gather_priority="high")
    normal = EagerExecutor(dag, [pool], trace.gather, trace.compute)
    assert high.stream("gather/kv").priority < normal.stream("gather/kv").priority


def test_gather_streams_are_never_streams_torch_hands_to_others():
    """torch.cuda.Stream() round-robins 32 shared streams (Note [Dedicated streams]); ours
    must be none of them, or another capture or the compute stream could be our gather lane."""
    pools = [SlotPool(lane, (16,), torch.float32, depth=1, workspace_bytes=1 << 10, device="cuda")
             for lane in ("a", "b")]
    dag = Planner(3, [p.layout for p in pools]).plan()
    trace = TracingWorkload(["a", "b"], 3, (16,), "cuda")
    runs = [EagerExecutor(dag, pools, trace.gather, trace.compute, gather_priority=priority)
            for priority in ("normal", "high")]
    ours = {r.stream(f"gather/{lane}").cuda_stream for r in runs for lane in ("a", "b")}
    shared = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    assert len(ours) == 4 and not ours & shared


def test_a_collected_executors_streams_go_to_the_next_one_and_are_never_destroyed():
    """Destroying them aborted the process on the H200 (Note [Dedicated streams])."""
    import gc

    from ringflow.graphs.streams import idle_streams, streams_created
    pool = SlotPool("kv", (16,), torch.float32, depth=1, workspace_bytes=1 << 10, device="cuda")
    dag = Planner(3, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 3, (16,), "cuda")
    gc.collect()  # earlier tests' executors: recycled before we count
    first = EagerExecutor(dag, [pool], trace.gather, trace.compute)
    trace.new_forward()
    first.run()
    handle, idle = first.stream("gather/kv").cuda_stream, idle_streams()
    del first
    gc.collect()
    assert idle_streams() == idle + 1
    created = streams_created()
    second = EagerExecutor(dag, [pool], trace.gather, trace.compute)
    assert streams_created() == created and idle_streams() == idle  # taken, not made
    assert second.stream("gather/kv").cuda_stream == handle
    trace.new_forward()
    second.run()  # a recycled stream still works
    torch.cuda.synchronize()
    trace.check()


def test_eager_follows_the_callers_stream():
    pool = SlotPool("kv", (64,), torch.float32, depth=1, workspace_bytes=1 << 12, device="cuda")
    dag = Planner(5, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 5, (64,), "cuda")
    ex = EagerExecutor(dag, [pool], trace.gather, trace.compute, poison=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        trace.new_forward()
        torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy; the plan must follow it
        ex.run()
    side.synchronize()
    trace.check()


def test_a_gather_that_raises_returns_every_slot_and_the_next_forward_is_right():
    pool = SlotPool("kv", (64,), torch.float32, depth=2, workspace_bytes=1 << 12, device="cuda")
    dag = Planner(7, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 7, (64,), "cuda")
    fail = {"armed": True}

    def gather(layer, lane, out):
        if layer == 4 and fail["armed"]:
            fail["armed"] = False
            raise RuntimeError("gather failed")
        trace.gather(layer, lane, out)

    ex = EagerExecutor(dag, [pool], gather, trace.compute)
    with pytest.raises(RuntimeError):
        ex.run()
    assert pool.free_count == pool.slots
    trace.new_forward()
    ex.run()
    torch.cuda.synchronize()
    trace.check()
