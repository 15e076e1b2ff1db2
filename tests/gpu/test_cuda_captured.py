"""CapturedExecutor on a GPU: replays equal the SyncExecutor, allocate nothing, keep the planned
topology in the real CUDA graph, and behave per policy inside someone else's capture."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringflow import (CaptureError, EagerExecutor, Planner, Profile, SlotPool, SyncExecutor)
from ringflow.graphs.captured import CapturedExecutor
from ringflow.graphs.graph_view import read_graph, write_dot
from ringflow.testing.tracing import TracingWorkload
from ringflow.bench.workload import SyntheticWorkload

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]


def demo(**changes):
    profile = Profile.load("demo")
    return profile.replace(**changes) if changes else profile


def build(profile):
    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    return pools, Planner.from_profile(profile).plan(), SyntheticWorkload(profile, "cuda")


@pytest.mark.parametrize("alloc", ["", "expandable_segments:True", "backend:cudaMallocAsync"],
                         ids=["default", "expandable", "cudaMallocAsync"])
def test_replays_are_bit_identical_to_sync_for_every_profile_under_each_allocator(alloc):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc, PYTHONUNBUFFERED="1")
    if not alloc:
        env.pop("PYTORCH_CUDA_ALLOC_CONF")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "cuda_replay_check.py"), "100"],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runnable = [p for p in (ROOT / "profiles").glob("*.yaml") if Profile.load(p).layers]
    assert proc.stdout.count("100 replays bit-identical") == len(runnable)


def test_steady_state_replay_makes_no_allocator_calls_and_pools_match_the_plan():
    profile = demo()
    pools, dag, work = build(profile)
    assert sum(p.storage.untyped_storage().nbytes() for p in pools) == profile.reserved_bytes
    assert sum(p.reserved_bytes for p in dag.pools) == profile.reserved_bytes
    ex = CapturedExecutor(dag, pools, work.gather, work.compute)
    for _ in range(3):
        ex.run()
    torch.cuda.synchronize()
    keys = ["allocation.all.allocated", "allocation.all.freed", "segment.all.allocated",
            "reserved_bytes.all.current", "num_alloc_retries", "num_device_alloc"]
    before = {k: v for k, v in torch.cuda.memory_stats().items() if k in keys}
    for _ in range(1000):
        ex.run()
    torch.cuda.synchronize()
    after = {k: v for k, v in torch.cuda.memory_stats().items() if k in keys}
    assert before == after and len(before) >= 4


def test_the_real_cuda_graph_runs_the_gather_branch_parallel_to_compute(tmp_path):
    layers, depth = 7, 1  # 7 layers over a ring of 2: not divisible
    pool = SlotPool("kv", (1 << 16,), torch.float32, depth=depth, workspace_bytes=1 << 20,
                    device="cuda")
    dag = Planner(layers, [pool.layout]).plan()
    host = [torch.randn(1 << 16).pin_memory() for _ in range(layers)]
    acc = torch.zeros(1 << 16, device="cuda")

    def gather(layer, lane, out):
        out.copy_(host[layer], non_blocking=True)  # exactly one memcpy node per layer

    def compute(layer, lane, slot):
        acc.add_(slot)  # exactly one kernel node per layer

    ex = CapturedExecutor(dag, [pool], gather, compute, keep_graph=True)
    graph = ex.capture()
    view = read_graph(graph)
    copies = {next(l for l in range(layers) if host[l].data_ptr() == n.src): n.index
              for n in view.of_type("Memcpy")}
    kernels = [n.index for n in view.of_type("Kernel")]
    assert sorted(copies) == list(range(layers)) and len(kernels) == layers
    # kernels are the compute chain: order them by reachability
    kernels.sort(key=lambda k: len([o for o in kernels if view.reaches(o, k)]))
    slots = depth + 1
    for l in range(layers):
        assert view.reaches(copies[l], kernels[l]), f"compute {l} does not wait for gather {l}"
        if l + 1 < layers:
            assert not view.reaches(kernels[l], copies[l + 1]), \
                f"gather {l + 1} is forced after compute {l}: no overlap"
            assert not view.reaches(copies[l + 1], kernels[l])
        if l + slots < layers:
            assert view.reaches(kernels[l], copies[l + slots]), "planned slot-reuse edge missing"
    write_dot(graph, str(tmp_path / "g.dot"))
    assert "digraph" in (tmp_path / "g.dot").read_text()
    acc.zero_()  # the eager warm-up before capture accumulated once already
    ex.run()
    torch.cuda.synchronize()
    assert torch.allclose(acc, sum(h.cuda() for h in host))


def test_buckets_share_one_pool_and_replay_in_order():
    pool = SlotPool("kv", (64,), torch.float32, depth=1, workspace_bytes=1 << 12, device="cuda")
    dag = Planner(5, [pool.layout]).plan()
    traces = {b: TracingWorkload(["kv"], 5, (64,), "cuda") for b in (16, 32)}
    ex = CapturedExecutor(dag, [pool], traces[16].gather, traces[16].compute)
    for bucket, trace in traces.items():
        ex.capture(bucket, gather=trace.gather, compute=trace.compute)
    assert len(ex.graphs) == 2
    other = torch.cuda.Stream()
    for i in range(6):
        bucket = (16, 32)[i % 2]
        with torch.cuda.stream(other if i % 3 == 0 else torch.cuda.current_stream()):
            ex.run(bucket)
    torch.cuda.synchronize()
    for trace in traces.values():
        trace.check()


def outer_capture(executor, work):
    """Capture the forward inside a torch.cuda.graph the way vLLM's wrapper captures a model."""
    graph = torch.cuda.CUDAGraph()
    for x in work.inputs.values():
        x.mul_(1.0)  # some model work before
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for x in work.inputs.values():
            x.mul_(1.0)
        executor.run()
    return graph


@pytest.mark.parametrize("policy", ["join", "sync"])
def test_a_forward_inside_an_outer_capture_works_under_join_and_sync(policy, caplog):
    profile = demo(lanes=["a", "b"], capture=policy)
    pools, dag, work = build(profile)
    sync = SyncExecutor(dag, pools, work.gather, work.compute)
    sync.run()
    want = work.outputs()
    ex = EagerExecutor(dag, pools, work.gather, work.compute, capture=policy, poison=True)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        graph = outer_capture(ex, work)
    assert ("runs the synchronous path" in caplog.text) == (policy == "sync")
    for seed in range(5):
        work.refresh(seed)
        sync.run()
        want = work.outputs()
        graph.replay()
        got = work.outputs()
        for lane in profile.lanes:
            assert torch.equal(got[lane], want[lane])


def test_the_error_policy_refuses_an_outer_capture():
    profile = demo(capture="error")
    pools, dag, work = build(profile)
    ex = EagerExecutor(dag, pools, work.gather, work.compute, capture="error")
    with pytest.raises(CaptureError, match="capture policy is 'error'"):
        outer_capture(ex, work)
    assert all(p.free_count == p.slots for p in pools)
    ex.run()  # outside a capture it runs
    torch.cuda.synchronize()


@pytest.mark.parametrize("policy", ["join", "error"])
def test_a_capture_that_fails_midway_falls_back_per_policy(policy, caplog):
    pool = SlotPool("kv", (64,), torch.float32, depth=1, workspace_bytes=1 << 12, device="cuda")
    dag = Planner(4, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 4, (64,), "cuda")

    def compute(layer, lane, slot):
        if layer == 2 and torch.cuda.is_current_stream_capturing():
            slot.sum().item()  # a host sync: illegal inside a capture
        trace.compute(layer, lane, slot)

    ex = CapturedExecutor(dag, [pool], trace.gather, compute, capture=policy)
    if policy == "error":
        with pytest.raises(CaptureError, match="capturing plan"):
            ex.run()
    else:
        with caplog.at_level(logging.WARNING, logger="ringflow"):
            ex.run()
        assert "running that bucket eagerly" in caplog.text
    assert pool.free_count == pool.slots
    torch.cuda.synchronize()
    if policy == "join":
        trace.new_forward()
        ex.run()  # the next forward is correct
        torch.cuda.synchronize()
        trace.check()


def test_nvtx_ranges_appear_at_capture_and_replay_gets_one_named_range(nvtx_recorder):
    pool = SlotPool("kv", (64,), torch.float32, depth=1, workspace_bytes=1 << 12, device="cuda")
    dag = Planner(3, [pool.layout]).plan()
    trace = TracingWorkload(["kv"], 3, (64,), "cuda")
    ex = CapturedExecutor(dag, [pool], trace.gather, trace.compute, warmup=0)
    ex.capture(bucket=128)
    assert nvtx_recorder.pushed == [n.nvtx_name for n in dag.nodes]
    nvtx_recorder.pushed.clear()
    ex.run(128)
    ex.run(128)
    assert nvtx_recorder.pushed == ["ringflow/replay/128", "ringflow/replay/128"]


def test_plan_cli_writes_the_real_cuda_graph_dot(tmp_path):
    out = tmp_path / "cuda.dot"
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan", "demo", "--out",
                           str(tmp_path / "dag.dot"), "--format", "dot", "--cuda-graph-dot",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "digraph" in out.read_text() and "wrote the captured CUDA graph" in proc.stderr
    assert (tmp_path / "dag.dot").read_text().startswith('digraph "demo"')


@pytest.mark.parametrize("depth", [0, 1])
def test_replays_after_sources_changed_gather_every_slot_from_the_new_sources(depth):
    """A cross-forward plan in a CUDA graph: the sources of its static lane change between
    replays. Unannounced, the carried layers read the old data (their slots were filled in the
    previous replay's tail: what the API is for); after ``sources_changed`` the next replay
    primes them, and every gathered layer reads the new data."""
    layers, gathered = 8, [0, 1, 3, 6]
    pool = SlotPool("w", (4,), torch.float32, depth=depth, workspace_bytes=1 << 10,
                    device="cuda")
    dag = Planner(layers, [pool.layout], gathered=gathered, cross_forward=["w"]).plan()
    assert dag.carried
    data = torch.randn(layers, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reads = torch.full((layers, 4), float("nan"), device="cuda")

    def gather(layer, lane, out):
        out.copy_(data[layer])

    def compute(layer, lane, slot):
        if slot is not None:
            reads[layer].copy_(slot)

    ex = CapturedExecutor(dag, [pool], gather, compute, poison=True)
    assert ex.capture(None) is not None, "the plan could not be captured (see the log)"
    for _ in range(2):
        ex.run()
    torch.cuda.synchronize()
    assert torch.equal(reads[gathered], data[gathered])
    old = data.clone()
    data.copy_(torch.randn(layers, 4, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1)))
    carried = [layer for _, layer, _ in dag.carried]
    ex.run()
    torch.cuda.synchronize()
    assert torch.equal(reads[carried], old[carried])  # stale, as nothing was announced
    ex.sources_changed("w")
    ex.run()
    torch.cuda.synchronize()
    assert torch.equal(reads[gathered], data[gathered])
