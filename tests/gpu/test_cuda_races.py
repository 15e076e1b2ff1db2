"""Races the plan's orderings exist to close, opened on purpose (Note [Sizing race windows]).

Every test here delays gathers (producer side) and reads (consumer side) at random, seeded,
by more than the measured host issue time between a record and its wait, runs forwards back
to back without a host sync, and checks every read of every forward afterwards: each forward
and each graph bucket writes tags of its own, so a read of the previous forward's data, of
another bucket's data or of a slot's next layer is caught. ``tools/gpu-mutants`` applies
deliberate ordering bugs to the executors (tests/helpers/mutants.py) and checks that this file fails.
"""

import random

import pytest
import torch

from ringflow import CapturedExecutor, EagerExecutor, Planner, SlotPool
from ringflow.integrations.torch.kv_prefetch import KVLayout, KVPrefetcher
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.testing.models import PagedAttentionStack, decoder_stack
from ringflow.testing.races import RaceWindows
from ringflow.testing.tracing import TracingWorkload

pytestmark = pytest.mark.cuda
FORWARDS = 4


def random_plan(rng):
    layers = rng.randint(2, 12)
    lanes = ["a", "b"][: rng.randint(1, 2)]
    depth = rng.randint(0, 3)
    gathered = None if rng.random() < 0.5 else {l for l in range(layers) if rng.random() < 0.7}
    pool_layers = set(range(layers)) if gathered is None else gathered
    ineligible = {l for l in pool_layers if rng.random() < 0.15}
    pools = [SlotPool(lane, (512,), torch.float32, depth=depth, workspace_bytes=1 << 20,
                      device="cuda") for lane in lanes]
    cross = [lane for lane in lanes if rng.random() < 0.5]  # static sources: carried leases
    dag = Planner(layers, [p.layout for p in pools], gathered=gathered,
                  ineligible=ineligible, cross_forward=cross).plan()
    return dag, pools, lanes, gathered, cross


def tracing(dag, lanes, gathered, cross, **kwargs):
    return TracingWorkload(lanes, dag.layers, (512,), "cuda", gathered=gathered, static=cross,
                           **kwargs)


@pytest.mark.parametrize("seed", range(4))
def test_eager_forwards_back_to_back_see_exactly_their_own_writes(seed):
    rng = random.Random(seed)
    delays = 0
    for _ in range(4):
        dag, pools, lanes, gathered, cross = random_plan(rng)
        trace = tracing(dag, lanes, gathered, cross)
        plain = EagerExecutor(dag, pools, trace.gather, trace.compute)
        windows = RaceWindows.measured(dag, plain.run, seed=rng.randrange(1 << 30))
        ex = EagerExecutor(dag, pools, windows.producer(trace.gather),
                           windows.consumer(trace.compute), poison=True,
                           gather_priority=rng.choice(["normal", "high"]))
        torch.cuda.synchronize()
        for _ in range(FORWARDS):  # no host sync between forwards: the fork orders them
            trace.new_forward()
            ex.run()
        torch.cuda.synchronize()
        trace.check(all_forwards=True)
        delays += windows.delays
    assert delays > 0


@pytest.mark.parametrize("seed", range(2))
def test_captured_replays_see_the_current_forwards_writes(seed):
    rng = random.Random(100 + seed)
    dag, pools, lanes, gathered, cross = random_plan(rng)
    trace = tracing(dag, lanes, gathered, cross)
    windows = RaceWindows.measured(dag, EagerExecutor(dag, pools, trace.gather,
                                                      trace.compute).run, seed=seed,
                                   probability=0.5)
    ex = CapturedExecutor(dag, pools, windows.producer(trace.gather),
                          windows.consumer(trace.compute), poison=True)
    assert ex.capture() is not None, "the plan could not be captured (see the log)"
    torch.cuda.synchronize()
    for _ in range(FORWARDS):  # new tags between replays, on the replaying stream
        trace.new_forward()
        ex.run()
    torch.cuda.synchronize()
    trace.check(all_forwards=True)


def test_buckets_replayed_on_different_streams_never_overlap():
    """Buckets share one pool: each writes its own tags, so overlapping replays would read each
    other's slots."""
    pool = SlotPool("kv", (1 << 14,), torch.float32, depth=1, workspace_bytes=1 << 20,
                    device="cuda")
    dag = Planner(6, [pool.layout]).plan()
    traces = {b: TracingWorkload(["kv"], 6, (1 << 14,), "cuda", bucket=b) for b in (1, 2, 3)}
    # long reads on every layer: a replay that does not wait for the previous one overlaps it
    windows = RaceWindows(RaceWindows.cycles_per_second() * 300e-6, seed=0, probability=1.0)
    ex = CapturedExecutor(dag, [pool], traces[1].gather, traces[1].compute)
    for bucket, trace in traces.items():
        ex.capture(bucket, gather=trace.gather, compute=windows.consumer(trace.compute))
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for i in range(6):
        order = [(1 + (i + k) % 3, streams[(i + k) % 3]) for k in range(3)]
        for bucket, stream in order:  # three replays in flight on three streams
            with torch.cuda.stream(stream):
                ex.run(bucket)
        torch.cuda.synchronize()
        for bucket, trace in traces.items():
            trace.check()


def test_a_plan_joined_into_an_outer_capture_sees_its_own_writes():
    """The way vLLM's graph wrapper captures a model: the plan forks from and joins the
    capturing stream inside the capture, after model work that it must come after."""
    rng = random.Random(7)
    dag, pools, lanes, gathered, cross = random_plan(rng)
    trace = tracing(dag, lanes, gathered, cross)
    windows = RaceWindows.measured(dag, EagerExecutor(dag, pools, trace.gather,
                                                      trace.compute).run, seed=7)
    ex = EagerExecutor(dag, pools, windows.producer(trace.gather),
                       windows.consumer(trace.compute), poison=True, capture="join")
    ex.run()  # warm-up outside the capture
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        windows.delay()  # model work before the plan: the fork must order the gathers after it
        ex.run()
    for _ in range(FORWARDS):
        trace.new_forward()
        graph.replay()
    torch.cuda.synchronize()
    trace.check(all_forwards=True)


@pytest.mark.parametrize("seed", range(2))
def test_carried_slots_survive_buckets_replayed_in_any_order_and_eager_forwards_between(seed):
    """Every graph of a cross-forward plan starts with the carried slots filled and ends having
    filled them again: graphs of any bucket, and eager forwards, may follow each other."""
    rng = random.Random(200 + seed)
    pools = [SlotPool("w", (512,), torch.float32, depth=rng.randint(0, 2),
                      workspace_bytes=1 << 20, device="cuda")]
    # layer 9 stays resident, so every slot's last reader is followed by compute: carried
    gathered = sorted(({l for l in range(9) if rng.random() < 0.6} | {0, 2}))
    dag = Planner(10, [pools[0].layout], gathered=gathered, cross_forward=["w"]).plan()
    assert dag.carried
    traces = {b: tracing(dag, ["w"], gathered, ["w"]) for b in (1, 2)}
    probe = traces[1]
    windows = RaceWindows.measured(dag, EagerExecutor(dag, pools, probe.gather,
                                                      probe.compute).run, seed=seed)
    ex = CapturedExecutor(dag, pools, windows.producer(probe.gather), probe.compute,
                          poison=True)
    for bucket, trace in traces.items():
        graph = ex.capture(bucket, gather=windows.producer(trace.gather),
                           compute=windows.consumer(trace.compute))
        assert graph is not None, "the plan could not be captured (see the log)"
    eager = EagerExecutor(dag, pools, windows.producer(probe.gather),
                          windows.consumer(probe.compute), poison=True)
    torch.cuda.synchronize()
    for step in range(12):  # graphs of both buckets and eager forwards, in a seeded order
        choice = rng.choice(["eager", 1, 2])
        trace = probe if choice == "eager" else traces[choice]
        trace.new_forward()
        eager.run() if choice == "eager" else ex.run(choice)
    torch.cuda.synchronize()
    for trace in traces.values():
        trace.check(all_forwards=True)


class LayerFailed(Exception):
    pass


@pytest.mark.parametrize("seed", range(2))
def test_replays_after_a_failed_forward_refill_their_carried_slots(seed):
    """A forward fails inside a layer's compute (its executor reclaims the pool, carried leases
    included), the slots are overwritten, and the captured graph's next replays still read
    exactly their writes: the replay primes the carried slots first (mutant
    skip-replay-prime: it does not, and the first layers read the overwrite)."""
    rng = random.Random(300 + seed)
    pools = [SlotPool("w", (512,), torch.float32, depth=rng.randint(0, 2),
                      workspace_bytes=1 << 20, device="cuda")]
    gathered = sorted({l for l in range(9) if rng.random() < 0.6} | {0, 2})
    dag = Planner(10, [pools[0].layout], gathered=gathered, cross_forward=["w"]).plan()
    assert dag.carried
    trace = tracing(dag, ["w"], gathered, ["w"])
    ex = CapturedExecutor(dag, pools, trace.gather, trace.compute, poison=True)
    assert ex.capture(None) is not None, "the plan could not be captured (see the log)"
    for _ in range(2):
        trace.new_forward()
        ex.run()
    torch.cuda.synchronize()
    trace.check(all_forwards=True)
    other = tracing(dag, ["w"], gathered, ["w"], bucket=3)  # writes other values

    def failing(layer, lane, slot):
        if layer == 5:
            raise LayerFailed("an exception inside layer 5")
        other.compute(layer, lane, slot)

    with pytest.raises(LayerFailed):
        EagerExecutor(dag, pools, other.gather, failing).run()
    assert not pools[0].carried  # the failure reclaimed every lease, carried ones too
    torch.cuda.synchronize()
    pools[0].storage.fill_(float("nan"))  # what the replay must not read
    for _ in range(3):
        trace.new_forward()
        ex.run()
    torch.cuda.synchronize()
    trace.check(all_forwards=True)


@torch.no_grad()
def test_streamed_weights_with_delays_on_both_sides_compute_what_resident_ones_did():
    layers = decoder_stack(6, hidden=1024, intermediate=2816, heads=8, device="cuda")
    inputs = [torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=None)
              for _ in range(FORWARDS)]
    want = [run_layers(layers, x) for x in inputs]
    ws = WeightStreamer(layers, [0, 2, 3, 5], depth=1, workspace_bytes=1 << 30, poison=True)
    windows = RaceWindows.measured(ws.dag, lambda: run_layers(layers, inputs[0]), seed=3,
                                   factor=8.0)
    ws.gather_hook = windows.delay
    delayed = [delay_before(layer, windows) for layer in layers]
    torch.cuda.synchronize()
    got = [run_layers(layers, x) for x in inputs]  # back to back, no host sync
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for undo in delayed:
        undo()
    ws.close()


@torch.no_grad()
@pytest.mark.parametrize("depth", [0, 1])
def test_prefetched_kv_with_delays_on_both_sides_is_the_layers_context(depth):
    kwargs = dict(row=576, block_size=64, requests=3, max_tokens_per_request=1024,
                  dtype=torch.bfloat16, device="cuda")
    ours, inline = PagedAttentionStack(6, **kwargs), PagedAttentionStack(6, **kwargs)
    for s in (ours, inline):
        s.start([900, 33, 0])
    layout = KVLayout("rows", (ours.row,), ours.dtype, ours.block_size)
    pf = KVPrefetcher(layout, ours.capacity, max_requests=ours.requests, depth=depth,
                      workspace_bytes=1 << 30, device="cuda", poison=True, name="race")
    pf.plan(ours.layers)
    windows = RaceWindows.measured(pf.dag, lambda: ours.step(pf), seed=depth, factor=8.0)
    pf.gather_hook = windows.delay
    ours.before_read = windows.delay
    shape = (FORWARDS, ours.layers, ours.capacity, ours.row)
    got = torch.full(shape, float("nan"), dtype=ours.dtype, device="cuda")
    want = torch.full(shape, float("nan"), dtype=ours.dtype, device="cuda")
    torch.cuda.synchronize()
    for step in range(FORWARDS):  # steps back to back, no host sync
        for s, snaps in ((ours, got), (inline, want)):
            s.refill(step)
            s.step(pf if s is ours else None, snapshots=snaps[step])
            s.advance()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def run_layers(layers, x):
    residual = None
    for layer in layers:
        x, residual = layer(None, x, residual)
    return x + residual


def delay_before(layer, windows):
    """Delay the layer's compute stream (maybe) before it reads its weights; returns an undo."""
    hook = layer.register_forward_pre_hook(lambda module, args: windows.delay())
    return hook.remove
