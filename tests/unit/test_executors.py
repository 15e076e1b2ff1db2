"""SyncExecutor on the CPU: equals a straight-line reference; faults leave no lease behind."""

import pytest
import torch

from ringflow import (EagerExecutor, ExecutorError, LeaseError, NodeKind, Planner, Profile,
                      SlotPool, SyncExecutor)
from ringflow.testing.tracing import TracingWorkload
from ringflow.bench.workload import SyntheticWorkload


def small(gather="h2d", **changes):
    base = Profile.load("demo").replace(workload={"gather": gather, "queries": 4,
                                                  "store_layers": 3, "block_size": 5, "seed": 3})
    return base.replace(**changes) if changes else base


def setup(profile):
    pools = [SlotPool.for_profile(profile, lane) for lane in profile.lanes]
    return pools, Planner.from_profile(profile).plan(), SyntheticWorkload(profile)


@pytest.mark.parametrize("gather", ["h2d", "index", "paged"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_sync_executor_equals_the_straight_line_reference(gather, depth):
    profile = small(gather, depth=depth, lanes=["a", "b"], slot={"shape": [40, 8],
                                                                  "dtype": "float32"})
    pools, dag, work = setup(profile)
    expected = work.reference()
    SyncExecutor(dag, pools, work.gather, work.compute).run()
    got = work.outputs()
    for lane in profile.lanes:
        assert torch.equal(got[lane], expected[lane])
        assert not torch.isnan(got[lane]).any()
    f64 = work.reference_float64()
    for lane in profile.lanes:
        err = (got[lane].double() - f64[lane]).norm() / f64[lane].norm()
        assert err < 1e-5, err


def test_sync_executor_matches_with_resident_layers_between_gathered_ones():
    profile = small(layers=9, gathered_layers=[2, 3, 7], ineligible=[3])
    pools, dag, work = setup(profile)
    expected = work.reference({2, 3, 7})
    SyncExecutor(dag, pools, work.gather, work.compute).run()
    assert torch.equal(work.outputs()["kv"], expected["kv"])


def test_every_read_sees_the_write_the_plan_intends_across_forwards():
    pools = [SlotPool(l, (4,), torch.float32, depth=2, workspace_bytes=1 << 10) for l in "ab"]
    dag = Planner(11, [p.layout for p in pools], ineligible=[4, 5]).plan()
    trace = TracingWorkload(["a", "b"], 11)
    ex = SyncExecutor(dag, pools, trace.gather, trace.compute)
    for _ in range(3):
        trace.new_forward()
        ex.run()
        trace.check()
        assert all(p.free_count == p.slots for p in pools)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_cross_forward_lane_starts_each_forward_with_its_first_slots_filled(depth):
    """Lane 'w' carries leases across forwards (static sources), lane 'kv' does not; the first
    forward primes, later ones adopt what the previous tail filled; a failed forward makes the
    next one prime again; every read of every forward sees its layer."""
    pools = [SlotPool(l, (4,), torch.float32, depth=depth, workspace_bytes=1 << 10)
             for l in ("w", "kv")]
    gathered = [0, 1, 3, 4, 6]
    dag = Planner(8, [p.layout for p in pools], gathered=gathered, cross_forward=["w"]).plan()
    assert dag.carried and {lane for lane, _, _ in dag.carried} == {"w"}
    trace = TracingWorkload(["w", "kv"], 8, gathered=gathered, static=["w"])
    copies = []

    def gather(layer, lane, out):
        copies.append((lane, layer))
        trace.gather(layer, lane, out)

    ex = SyncExecutor(dag, pools, gather, trace.compute, poison=True)
    for forward in range(4):
        trace.new_forward()
        copies.clear()
        ex.run()
        trace.check()
        w = [layer for lane, layer in copies if lane == "w"]
        # forward 0 primes the carried layers; each forward gathers the rest and, in its tail,
        # the next forward's carried ones: every layer once per forward, plus the prime
        carried = [layer for _, layer, _ in dag.carried]
        assert sorted(w) == sorted(gathered + (carried if forward == 0 else []))
        assert len(pools[0].carried) == len(carried)
    failing = {"armed": True}

    def compute(layer, lane, slot):
        if layer == 3 and failing.pop("armed", False):
            raise RuntimeError("layer failed")
        trace.compute(layer, lane, slot)

    broken = SyncExecutor(dag, pools, gather, compute, poison=True)
    trace.new_forward()
    with pytest.raises(RuntimeError):
        broken.run()
    assert not pools[0].carried and pools[0].free_count == pools[0].slots
    trace.new_forward()
    copies.clear()
    ex.run()  # primes again, then runs
    trace.check()
    assert sum(lane == "w" for lane, _ in copies) == len(gathered) + len(dag.carried)


def test_poison_mode_fills_each_slot_with_nan_after_its_last_read():
    pools = [SlotPool("kv", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)]
    dag = Planner(3, [pools[0].layout]).plan()
    trace = TracingWorkload(["kv"], 3)
    SyncExecutor(dag, pools, trace.gather, trace.compute, poison=True).run()
    trace.check()
    assert torch.isnan(pools[0].storage).all()


@pytest.mark.parametrize("fail_in", ["gather", "compute"])
def test_a_callable_that_raises_mid_forward_leaves_no_slot_leased(fail_in):
    pools = [SlotPool("kv", (4,), torch.float32, depth=2, workspace_bytes=1 << 10)]
    dag = Planner(6, [pools[0].layout]).plan()
    trace = TracingWorkload(["kv"], 6)
    calls = {"n": 0}

    def flaky(original):
        def run(layer, lane, x):
            if layer == 3 and calls["n"] == 0:
                calls["n"] += 1
                raise RuntimeError("boom")
            return original(layer, lane, x)
        return run

    gather = flaky(trace.gather) if fail_in == "gather" else trace.gather
    compute = flaky(trace.compute) if fail_in == "compute" else trace.compute
    ex = SyncExecutor(dag, pools, gather, compute)
    with pytest.raises(RuntimeError, match="boom"):
        ex.run()
    assert pools[0].free_count == pools[0].slots and not pools[0].leases()
    trace.new_forward()
    ex.run()  # the next forward is correct
    trace.check()


def test_executors_refuse_pools_that_do_not_match_the_plan():
    pool = SlotPool("kv", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)
    other = SlotPool("kv", (4,), torch.float32, depth=2, workspace_bytes=1 << 10)
    dag = Planner(3, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 3)
    with pytest.raises(ExecutorError, match="3 slot\\(s\\).*expects 2"):
        SyncExecutor(dag, [other], trace.gather, trace.compute)
    with pytest.raises(ExecutorError, match="no pool was given"):
        SyncExecutor(dag, [], trace.gather, trace.compute)


def test_executors_refuse_two_lanes_on_one_memory():
    a = SlotPool("a", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)
    b = SlotPool("b", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)
    b.storage = a.storage  # what a shared staging buffer would look like
    dag = Planner(3, [a.layout, b.layout]).plan()
    trace = TracingWorkload(["a", "b"], 3)
    with pytest.raises(ExecutorError, match="share memory"):
        SyncExecutor(dag, [a, b], trace.gather, trace.compute)


def test_eager_executor_refuses_cpu_pools_with_a_pointer_to_sync():
    pool = SlotPool("kv", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)
    dag = Planner(3, [pool.layout]).plan()
    with pytest.raises(ExecutorError, match="use SyncExecutor on the CPU"):
        EagerExecutor(dag, [pool], lambda *a: None, lambda *a: None)


def test_every_node_runs_inside_its_nvtx_range(nvtx_recorder):
    events = nvtx_recorder.events
    pool = SlotPool("kv", (4,), torch.float32, depth=1, workspace_bytes=1 << 10)
    dag = Planner(3, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 3)

    def gather(layer, lane, out):
        events.append(("gather", layer))
        trace.gather(layer, lane, out)

    SyncExecutor(dag, [pool], gather, trace.compute).run()
    assert nvtx_recorder.pushed == [n.nvtx_name for n in dag.nodes]
    assert sum(e == "pop" for e, _ in events) == len(dag.nodes)
    i = events.index(("gather", 0))
    assert events[i - 1] == ("push", "ringflow/kv/gather/L0") and events[i + 1][0] == "pop"


def test_no_range_is_wrapped_where_none_would_be_recorded(nvtx_recorder, monkeypatch):
    """Ranges off, or the nvtx package with no tool attached (its DummyDomain gives None
    attributes): each node's step is the bound callable itself, not a push/call/pop wrapper."""
    pytest.importorskip("nvtx")
    from ringflow.graphs import nvtx_ranges

    def step():
        pass

    assert nvtx_ranges.ranged("x", step) is not step  # a recorder records: wrapped
    monkeypatch.setenv("RINGFLOW_NVTX", "0")
    monkeypatch.setattr(nvtx_ranges, "backend", nvtx_ranges.select_backend())
    assert nvtx_ranges.ranged("x", step) is step
    monkeypatch.delenv("RINGFLOW_NVTX")
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)  # no tool attached here
    monkeypatch.setattr(nvtx_ranges, "backend", nvtx_ranges.select_backend())
    assert nvtx_ranges.backend.name == "nvtx" and nvtx_ranges.ranged("x", step) is step


def test_a_host_workers_thread_profiles_its_runs_only_while_a_tool_records(monkeypatch):
    """Note [Host work in NVTX]: the worker's thread runs under torch's NVTX profiler only
    with ranges on, a tool attached (``NVTX_INJECTION64_PATH``, set by Nsight) and not
    ``NVTX_DISABLE``, on a CUDA build; otherwise under no profiler (its ranges cost nothing)."""
    import contextlib

    from ringflow.graphs import nvtx_ranges
    on = type("Recording", (), {"name": "nvtx"})()
    real = nvtx_ranges.select_backend
    monkeypatch.setattr(nvtx_ranges, "select_backend", lambda: on)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    assert not nvtx_ranges.tool_attached()
    assert isinstance(nvtx_ranges.host_thread_ranges(), contextlib.nullcontext)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    assert nvtx_ranges.tool_attached()
    made = nvtx_ranges.host_thread_ranges()
    if torch.cuda.is_available():
        assert isinstance(made, torch.autograd.profiler.emit_nvtx)
    else:  # torch's NVTX profiler needs a CUDA build
        assert isinstance(made, contextlib.nullcontext)
    monkeypatch.setenv("NVTX_DISABLE", "1")
    assert not nvtx_ranges.tool_attached()
    monkeypatch.delenv("NVTX_DISABLE")
    monkeypatch.setattr(nvtx_ranges, "select_backend", real)
    monkeypatch.setenv("RINGFLOW_NVTX", "0")  # ranges off: the real choice, before any NVTX
    assert not nvtx_ranges.tool_attached()


def test_a_lease_misused_by_a_hand_built_order_is_a_lease_error():
    # The executor checks lease states as it goes: compute reading a slot never marked ready.
    pool = SlotPool("kv", (4,), torch.float32, depth=0, workspace_bytes=1 << 10)
    dag = Planner(2, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 2)
    ex = SyncExecutor(dag, [pool], trace.gather, trace.compute)
    ex._leases[("kv", 0)] = pool.acquire(0)  # WRITING, as if its gather were still running
    compute = next(n for n in dag.nodes if n.kind is NodeKind.COMPUTE and n.layer == 0)
    with pytest.raises(LeaseError, match="read before ready"):
        ex._bind_compute(compute)()


def test_decoder_compute_streams_a_layers_weights_through_its_slot():
    profile = Profile.from_mapping({
        "layers": 5, "depth": 1, "workspace_mib": 1, "gathered_layers": [1, 3, 4],
        "slot": {"shape": [3 * 32 * 32 + 32 * 32 + 2 * 48 * 32 + 32 * 48 + 2 * 32],
                 "dtype": "float32"},
        "workload": {"compute": "decoder", "hidden": 32, "intermediate": 48, "heads": 4,
                     "queries": 6}})
    pools, dag, work = setup(profile)
    expected = work.reference({1, 3, 4})
    SyncExecutor(dag, pools, work.gather, work.compute, poison=True).run()
    got = work.outputs()["kv"]
    assert torch.equal(got, expected["kv"]) and not torch.isnan(got).any()
