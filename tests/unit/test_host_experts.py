"""The host's share of the expert lane (Note [Host split], [Host node], [Host experts]): the split
rule, the host node's thread and protocol, the CPU MoE and the lane with every split from
all-copy to all-CPU against the float64 MoE, and the proof with its mutants."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ringflow.errors import ConfigError, HazardError, KernelError
from ringflow.graphs.host_node import HostNode
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
from ringflow.integrations.torch.host_experts import HostExperts, fastest_threads
from ringflow.kernels.host_moe import moe_on_host, scripted
from ringflow.kernels.reference import moe_ref, moe_rows_as_kernel
from ringflow.orchestrator.expert_hazards import ExpertOp, check_expert_step
from ringflow.orchestrator.expert_model import fetch_ms
from ringflow.orchestrator.host_split import HostPolicy, HostRates, host_policy, split

from tests.unit.test_expert_cache import E, H, K, dequantized, experts, fp8_experts, routing

QWEN_BYTES = 9_437_184


def rates(ms_one: float, handoff: float = 0.03) -> HostRates:
    return HostRates({1: ms_one, 2: 1.2 * ms_one, 4: 1.6 * ms_one, 16: 4 * ms_one},
                     QWEN_BYTES, handoff, threads=16)


# the split (Note [Host split])

def test_the_split_is_the_least_of_the_larger_time_over_every_k():
    for ms_one in (0.02, 0.1, 0.2, 0.5, 5.0):
        r = rates(ms_one)
        for misses in (0, 1, 3, 6, 12):
            best = split(misses, 1, QWEN_BYTES, r)
            times = [max(r.handoff_ms + k * r.cpu_ms(1) if k else 0.0,
                         fetch_ms(misses - k, QWEN_BYTES)) for k in range(misses + 1)]
            assert best.ms == pytest.approx(min(times))
            assert best.to_host == times.index(min(times))  # ties go to copying
            assert best.copy_ms == pytest.approx(fetch_ms(misses, QWEN_BYTES))


def test_a_fast_host_takes_most_misses_and_a_slow_one_none():
    fast, slow = split(6, 1, QWEN_BYTES, rates(0.02)), split(6, 1, QWEN_BYTES, rates(5.0))
    assert fast.to_host >= 5 and fast.gain > 2
    assert slow.to_host == 0 and slow.gain == 1
    assert slow.share == 0
    even = split(6, 1, QWEN_BYTES, rates(0.2))  # as fast as the copy: about half each
    assert 2 <= even.to_host <= 4 and even.ms < even.copy_ms


def test_fp8_experts_copy_their_own_bytes_but_cost_the_cpu_their_bf16_size():
    r = rates(0.2)
    fp8 = split(6, 1, QWEN_BYTES // 2, r)  # as if the CPU read only fp8 bytes
    dequantized = split(6, 1, QWEN_BYTES // 2, r, cpu_bytes=QWEN_BYTES)
    assert dequantized.copy_ms == fp8.copy_ms and dequantized.to_host < fp8.to_host


def test_host_rates_interpolate_by_tokens_scale_by_bytes_and_load_from_json(tmp_path):
    r = rates(0.1)
    assert r.cpu_ms(1) == pytest.approx(0.1) and r.cpu_ms(3) == pytest.approx(0.14)
    assert r.cpu_ms(32) == pytest.approx(0.4 + 16 * (0.4 - 0.16) / 12)  # past the last point
    assert r.cpu_ms(1, QWEN_BYTES // 2) == pytest.approx(0.05)
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"host": {"cpu": "x"}, "model": {
        "expert_ms": {"1": 0.1, "4": 0.2}, "expert_bytes": QWEN_BYTES, "handoff_ms": 0.05,
        "threads": 8}}))
    loaded = HostRates.load(path)
    assert loaded.cpu_ms(4) == 0.2 and loaded.threads == 8 and loaded.source == str(path)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="tools/host_rates.py"):
        HostRates.load(path)
    with pytest.raises(ConfigError, match="positive"):
        HostRates({1: 0.0}, QWEN_BYTES, 0.1)


def test_the_policy_shares_by_token_count_and_stops_where_one_pass_ends():
    p = host_policy(rates(0.1), experts=128, top_k=8, slots=32, expert_bytes=QWEN_BYTES)
    assert 0 < p.share(1) <= 1 and p.max_tokens <= 4  # 5 tokens x 8 > 32 slots: two passes
    assert p.share(100) == 0 and "1 token:" in p.why
    assert host_policy(rates(5.0), experts=128, top_k=8, slots=32,
                       expert_bytes=QWEN_BYTES).max_tokens == 0  # no gain: off
    forced = host_policy(rates(5.0), experts=128, top_k=8, slots=32, expert_bytes=QWEN_BYTES,
                         forced=1.0)
    assert forced.share(1) == 1.0 and "forced" in forced.why


def test_a_profile_shares_steps_of_one_token_unless_it_asks_for_more():
    """experts.host_tokens defaults to 1 (the share gained at batch 1 and never at batch 8
    where measured): rates that gain at every size share one-token steps only, and a
    profile's host_tokens: 8 shares up to 8."""
    from ringflow.orchestrator.sections import experts_section

    def policy(**section):
        spec = experts_section({"layers": "all", "host_share": "auto", **section}, None)
        return host_policy(rates(0.1), experts=128, top_k=8, slots=64,
                           expert_bytes=QWEN_BYTES, max_tokens=spec.host_tokens)

    assert policy().max_tokens == 1 and policy().share(1) > 0
    assert policy().share(2) == 0
    assert policy(host_tokens=8).max_tokens == 8


# the CPU MoE

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_moe_computes_only_its_experts(dtype):
    w13, w2 = experts(dtype=dtype)
    g = torch.Generator().manual_seed(3)
    for s in range(6):
        ids, weights = routing(40 + s, 1 + s)
        hidden = torch.randn(1 + s, H, generator=g).to(dtype)
        mine = torch.rand(E, generator=g) < 0.5
        out = torch.full((1 + s, K, H), float("nan"), dtype=dtype)  # poisoned: all written
        count = moe_on_host(hidden, w13, w2, weights, ids, mine, out)
        keep = mine[ids]
        want = moe_ref(hidden, w13, w2, torch.where(keep, weights, 0), ids)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double().sum(1), want, rtol=tol, atol=tol)
        assert (out[~keep] == 0).all()  # the GPU's choices: zeros, so one sum takes both
        for t, j in keep.nonzero().tolist():  # each of its own rows alone: the expert's
            one = torch.zeros_like(weights)
            one[t, j] = weights[t, j]
            torch.testing.assert_close(out[t, j].double(),
                                       moe_ref(hidden, w13, w2, one, ids)[t], rtol=tol, atol=tol)
        assert count == len(set(ids[keep].tolist()))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_host_rows_round_where_vllms_kernel_rounds(compiled):
    """bf16 rows of Qwen3-30B-A3B's width (Note [Host rows round as the kernel]): each element
    as the kernel's rounding rule gives it from exact sums, but for a few in ten thousand
    whose float32 sums fall on the other side of a boundary (by an ulp, and the rest of that
    row by less than one ulp of its largest element). Rounding the second GEMM's row before
    the router weight, and the activation once, differed in 60% of them."""
    g = torch.Generator().manual_seed(21)
    experts, hidden_size, inter, top_k, tokens = 6, 2048, 768, 4, 3
    w13 = (torch.randn(experts, 2 * inter, hidden_size, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(experts, hidden_size, inter, generator=g) * 0.02).bfloat16()
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    out = torch.full((tokens, top_k, hidden_size), float("nan"), dtype=torch.bfloat16)
    run = scripted("moe_on_host") if compiled else moe_on_host
    run(hidden, w13, w2, weights, ids, torch.ones(experts, dtype=torch.bool), out, None, None)
    want = moe_rows_as_kernel(hidden, w13, w2, weights, ids)
    apart = out.float() != want.float()
    assert apart.float().mean().item() < 1e-3, apart.float().mean().item()
    largest = want.float().abs().amax(-1, keepdim=True)
    assert ((out.float() - want.float()).abs() <= largest * 2.0 ** -8).all()


def fp8_want(store: dict, hidden: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor) -> torch.Tensor:
    """What the host's rows of fp8 experts sum to: per tensor, the float64 MoE of the
    dequantized layer; in blocks, vLLM's kernel's rows (its inputs quantized per group)."""
    if store["w13_scale"].dim() == 3:
        return moe_rows_as_kernel(hidden, store["w13"], store["w2"], weights, ids,
                                  store["w13_scale"], store["w2_scale"]).double().sum(1)
    return moe_ref(hidden, dequantized(store, "w13"), dequantized(store, "w2"), weights, ids)


@pytest.mark.parametrize("blocks", [False, True])
def test_the_host_moe_dequantizes_fp8_experts_with_their_scales(blocks):
    host = fp8_experts("cpu", blocks)
    ids, weights = routing(9, 3)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(9))
    out = torch.empty(3, K, H)
    moe_on_host(hidden, host["w13"], host["w2"], weights, ids, torch.ones(E, dtype=torch.bool),
                out, host["w13_scale"], host["w2_scale"])
    torch.testing.assert_close(out.double().sum(1), fp8_want(host, hidden, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_block_fp8_host_rows_quantize_their_inputs_as_vllms_kernel(compiled):
    """128x128 block fp8 experts, bf16 model, a realistic width (Note [Host rows round as the
    kernel]): the host's rows are the kernel's rows (inputs quantized per row and group of
    128 columns, float32 sums, the activation float32 into its quantization as vLLM's fused
    ``silu_and_mul_per_block_quant`` keeps it: the host rounding it to bf16 first, as before,
    moved 81% of the elements here) but for elements whose float32 sums fall on the other
    side of a rounding boundary; dequantizing the weights alone, unquantized inputs, is off
    in most elements by the activations' fp8 rounding."""
    g = torch.Generator().manual_seed(31)
    experts, hidden_size, inter, top_k, tokens = 4, 256, 256, 3, 2
    host = {"w13": (torch.randn(experts, 2 * inter, hidden_size, generator=g) * 8)
            .to(torch.float8_e4m3fn),
            "w2": (torch.randn(experts, hidden_size, inter, generator=g) * 8)
            .to(torch.float8_e4m3fn),
            "w13_scale": 0.002 + 0.001 * torch.rand(experts, 2 * inter // 128,
                                                    hidden_size // 128, generator=g),
            "w2_scale": 0.002 + 0.001 * torch.rand(experts, hidden_size // 128,
                                                   inter // 128, generator=g)}
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    out = torch.full((tokens, top_k, hidden_size), float("nan"), dtype=torch.bfloat16)
    run = scripted("moe_on_host") if compiled else moe_on_host
    run(hidden, host["w13"], host["w2"], weights, ids, torch.ones(experts, dtype=torch.bool),
        out, host["w13_scale"], host["w2_scale"])
    want = moe_rows_as_kernel(hidden, host["w13"], host["w2"], weights, ids,
                              host["w13_scale"], host["w2_scale"])
    apart = (out.float() != want.float()).float().mean().item()
    assert apart < 0.01, apart
    largest = want.float().abs().amax(-1, keepdim=True)
    assert ((out.float() - want.float()).abs() <= largest * 2.0 ** -6).all()
    unquantized = moe_rows_as_kernel(hidden, dequantized(host, "w13").bfloat16(),
                                     dequantized(host, "w2").bfloat16(), weights, ids)
    assert (unquantized.float() != want.float()).float().mean().item() > 0.5


def test_block_fp8_whose_columns_are_no_whole_blocks_are_refused_by_name():
    store = fp8_experts("cpu", True)
    store["w2_scale"] = store["w2_scale"][:, :, :1].repeat(1, 1, 3)  # 8 columns, 3 blocks
    with pytest.raises(ConfigError, match="w2 has 8 input columns in 3 fp8 blocks"):
        HostExperts({0: store}, H, K, 2, "cpu", torch.float32)


@pytest.mark.parametrize("blocks", [False, True])
def test_the_compiled_worker_computes_fp8_experts_as_the_float64_moe(blocks):
    """fp8 experts and their scales through the host share's compiled worker (what a step
    runs), for several layers' stores: each layer's rows from its own store (in blocks, as
    vLLM's kernel computes them)."""
    stores = {3: fp8_experts("cpu", blocks), 7: fp8_experts("cpu", not blocks)}
    host = HostExperts(stores, H, K, 4, "cpu", torch.float32)
    g = torch.Generator().manual_seed(12)
    try:
        for s, layer in enumerate([3, 7, 7, 3]):
            ids, weights = routing(80 + s, 1 + s)
            hidden = torch.randn(1 + s, H, generator=g)
            mine = torch.rand(E + 1, generator=g) < 0.6
            host.out.fill_(float("nan"))
            host.launch(layer, hidden, weights, ids, mine)
            got = host.join(1 + s)
            store = stores[layer]
            keep = mine[:E][ids]
            want = fp8_want(store, hidden, torch.where(keep, weights, 0), ids)
            torch.testing.assert_close(got.double().sum(1), want, rtol=1e-5, atol=1e-5)
        assert host.describe(3)["runs"] == 2 and host.describe(7)["runs"] == 2
    finally:
        host.close()


def test_the_fastest_thread_count_is_measured_through_the_worker():
    """``host_threads: 0``: the count the worker computes one token's expert fastest with,
    the fewest on a tie; its times are that count's."""
    w13, w2 = experts(dtype=torch.bfloat16)
    threads, ms = fastest_threads({"w13": w13, "w2": w2}, [2, 1, 2])
    assert threads in (1, 2) and set(ms) == {1, 2, 4, 8, 16}
    assert all(t > 0 for t in ms.values())


def test_a_join_without_its_launch_is_refused_not_left_to_wait():
    """One join per launch: a second join (or a launch before the last one's join) would leave
    the stream waiting for a run that never comes; both raise instead."""
    w13, w2 = experts()
    host = HostExperts({0: {"w13": w13, "w2": w2}}, H, K, 2, "cpu", torch.float32)
    ids, weights = routing(3, 1)
    hidden = torch.randn(1, H)
    mine = torch.ones(E, dtype=torch.bool)
    try:
        with pytest.raises(KernelError, match="without a launch"):
            host.join(1)
        host.launch(0, hidden, weights, ids, mine)
        with pytest.raises(KernelError, match="before layer 0's was joined"):
            host.launch(0, hidden, weights, ids, mine)
        host.join(1)
        with pytest.raises(KernelError, match="without a launch"):
            host.join(1)
    finally:
        host.close()


def test_each_host_run_is_a_range_named_by_its_layer_on_the_workers_own_thread(monkeypatch):
    """Note [Host work in NVTX]: the worker's loop wraps each run in a range named by the
    layer it computed for, recorded by whatever profiler its thread runs under
    (``host_thread_ranges``: torch's NVTX one under Nsight; here torch's CPU profiler, which
    sees the thread it was started on only), one per run."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from ringflow.graphs import nvtx_ranges
    seen: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def recorded():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        seen["worker"] = [e.name for e in prof.events()]

    monkeypatch.setattr(nvtx_ranges, "host_thread_ranges", recorded)
    w13, w2 = experts()
    host = HostExperts({1: {"w13": w13, "w2": w2}, 3: {"w13": w13.flip(0), "w2": w2.flip(0)}},
                       H, K, 2, "cpu", torch.float32)
    mine = torch.ones(E, dtype=torch.bool)
    try:
        for s, layer in enumerate([1, 3, 1]):
            ids, weights = routing(30 + s, 1)
            host.launch(layer, torch.randn(1, H), weights, ids, mine)
            host.join(1)
    finally:
        host.close()  # the worker's profiler ends with its loop
    names = seen["worker"]
    assert names.count("ringflow/experts/host/L1") == 2, names
    assert names.count("ringflow/experts/host/L3") == 1, names
    assert "aten::linear" in names  # the run's own ops, inside it


# the host node (Note [Host node])

def doubler(flags: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
            runs: torch.Tensor, idle_polls: int = 0) -> int:
    """A host node's loop (Note [Host node]'s protocol): ``dst = 2 * src`` at each doorbell;
    parked after ``idle_polls`` polls without one (0: never), as serve_experts does (Note [An
    idle worker parks])."""
    n = 0
    idle = 0
    while True:
        go = int(flags[0])
        if go == 0:
            if idle_polls > 0:
                idle += 1
                if idle >= idle_polls:
                    flags[2] = 1
                    break
            continue
        idle = 0
        flags[0] = 0
        if go < 0:
            break
        torch.mul(src, 2, out=dst)
        runs += 1
        n += 1
        flags[1] = 1
    return n


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_the_host_node_runs_its_loop_without_python_between_post_and_join():
    """The compiled loop on a thread of its own: each post and join computes the staged
    input once (output poisoned before), and while it polls, Python's other threads run (it
    holds no GIL)."""
    src, dst, runs = torch.zeros(8), torch.empty(8), torch.zeros((), dtype=torch.int64)
    node = HostNode(torch.jit.script(doubler), (src, dst, runs), "cpu", "ringflow/test/host")
    try:
        for i in range(4):
            src.copy_(torch.arange(8.0) + i)
            dst.fill_(float("nan"))
            node.post()
            node.join()
            assert torch.equal(dst, 2 * (torch.arange(8.0) + i))
        assert int(runs) == 4
        start, spins = time.perf_counter(), 0
        while time.perf_counter() - start < 0.1:  # the worker polls meanwhile
            spins += 1
        assert spins > 10_000
    finally:
        node.close()
    assert not node._thread.is_alive()
    with pytest.raises(KernelError, match="closed"):
        node.post()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("woken", [False, True])
def test_an_idle_worker_parks_and_serves_the_next_doorbell(woken):
    """After about a millisecond without a doorbell the loop parks (its thread waits, no
    polling); a doorbell set meanwhile (as a replayed graph's stream sets it, no Python
    before it) or a wake and a post are served, each exactly once; close stops a parked
    worker."""
    from ringflow.graphs.host_node import PARKED, idle_polls_for
    src, dst, runs = torch.zeros(8), torch.empty(8), torch.zeros((), dtype=torch.int64)
    node = HostNode(torch.jit.script(doubler), (src, dst, runs, idle_polls_for(1.0)),
                    "cpu", "ringflow/test/host")
    try:
        for i in range(3):
            deadline = time.perf_counter() + 5
            while node.parks <= i and time.perf_counter() < deadline:
                time.sleep(0.002)
            assert node.parks == i + 1 and int(node.flags[PARKED]) == 1, node.parks
            src.copy_(torch.arange(8.0) + i)
            dst.fill_(float("nan"))
            if woken:  # a step starts (vLLM's execute_model): back to polling before the
                node.wake()  # doorbell
                deadline = time.perf_counter() + 5
                while int(node.flags[PARKED]) and time.perf_counter() < deadline:
                    time.sleep(0.0005)
                assert int(node.flags[PARKED]) == 0
            node.post()
            node.join()
            assert torch.equal(dst, 2 * (torch.arange(8.0) + i)) and int(runs) == i + 1
        time.sleep(0.05)  # idle again, parked: no run without a doorbell
        assert int(runs) == 3 and node.parks >= 4
    finally:
        node.close()
    assert not node._thread.is_alive()


def test_an_idle_ms_that_is_no_time_is_refused():
    with pytest.raises(ConfigError, match="idle time"):
        HostExperts({0: {"w13": torch.zeros(2, 4, 2), "w2": torch.zeros(2, 2, 2)}}, 2, 1, 1,
                    "cpu", torch.float32, idle_ms=-1)


def test_a_loop_that_raises_marks_its_output_bad_and_stops_the_next_step(caplog):
    src, dst, runs = torch.zeros(8), torch.zeros(8), torch.zeros((), dtype=torch.int64)

    def broken(flags, src, dst, runs):  # the doorbell taken, then the work fails
        while int(flags[0]) == 0:
            time.sleep(0)
        flags[0] = 0
        raise RuntimeError("boom")

    node = HostNode(broken, (src, dst, runs), "cpu", "ringflow/test/host",
                    fail=lambda: dst.fill_(float("nan")))
    try:
        node.post()
        node.join()  # does not hang: the failed run still says done
        assert dst.isnan().all() and "boom" in caplog.text
        with pytest.raises(KernelError, match="raised on the host"):
            node.post()
        dst.zero_()
        node.flags[0] = 1  # a replayed graph's doorbell: answered, bad, without Python's post
        HostNode.join(node)
        assert dst.isnan().all()
    finally:
        node.close()
    assert not node._thread.is_alive()


def test_the_worker_computes_with_the_threads_it_was_given():
    seen = []

    def record(flags):
        seen.append(torch.get_num_threads())
        while int(flags[0]) >= 0:
            time.sleep(0)

    node = HostNode(record, (), "cpu", "ringflow/test/host", threads=1)
    node.close()
    assert seen == [1]


# the lane with a host share, against the float64 MoE

def lane_with_host(slots: int, share: float, max_tokens: int = 4, dtype=torch.float32,
                   idle_ms: float = 0.0):
    w13, w2 = experts(dtype=dtype)
    cache = ExpertCache({"w13": w13, "w2": w2}, slots, "cpu")
    cache.trace = []
    host = HostExperts({0: cache.host}, H, K, max_tokens, "cpu", dtype, idle_ms=idle_ms)
    host.out.fill_(float("nan"))  # poisoned: the worker writes every row it is asked for
    policy = HostPolicy({t: share for t in range(1, max_tokens + 1)}, "test")
    lane = ExpertLane({0: cache}, {0: TorchCompute()}, host=host, host_policy=policy)
    return lane, cache, host, w13, w2


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_every_split_from_all_copy_to_all_cpu_equals_the_float64_moe(share):
    lane, cache, host, w13, w2 = lane_with_host(slots=2 * K, share=share)
    g = torch.Generator().manual_seed(11)
    try:
        for s, tokens in enumerate([1, 1, 2, 1, 2, 1, 1, 2]):
            ids, weights = routing(60 + s, tokens)
            hidden = torch.randn(tokens, H, generator=g)
            held = cache.holding()
            start = len(cache.trace)
            out = lane.forward(0, hidden, weights, ids)
            torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                                       rtol=1e-5, atol=1e-5)
            step = cache.trace[start:]
            check_expert_step(held, set(ids.flatten().tolist()), step, cache.slots)
            kinds = [op.kind for op in step]
            if share:  # staged and posted before the copies, so the host overlaps them
                assert kinds.index("stage") < kinds.index("install") < kinds.index("sum")
        handed = int(cache.host_computed)
        assert handed == host.describe(0)["computed"]
        [row] = lane.report()
        assert row["host_computed"] == handed and row["host_share"]["computed"] == handed
        report = row["host_share"]
        assert report["runs"] == (8 if share else 0) and report["shares"][1] == share
        assert (handed == 0) == (share == 0) and (share < 1 or int(cache.misses) == handed)
    finally:
        lane.close()


def test_a_parked_host_worker_computes_the_next_steps_as_the_float64_moe():
    """RINGFLOW_HOST_IDLE_MS's worker (Note [An idle worker parks]): idle between steps long
    enough to park, each step's share still computed, once, equal to the float64 MoE."""
    lane, cache, host, w13, w2 = lane_with_host(slots=2 * K, share=0.5, idle_ms=1.0)
    g = torch.Generator().manual_seed(12)
    try:
        parked = host.node.parks
        for s, tokens in enumerate([1, 2, 1, 1]):
            # idle until it parks: a fixed 20 ms sleep parked only 3 of 4 times on a loaded
            # 2-CPU CI machine, where the worker's thread was not scheduled in time
            deadline = time.monotonic() + 5.0
            while host.node.parks <= parked and time.monotonic() < deadline:
                time.sleep(0.005)
            parked = host.node.parks
            if s % 2:
                host.wake()  # as vLLM's execute_model does, before the step
            ids, weights = routing(80 + s, tokens)
            hidden = torch.randn(tokens, H, generator=g)
            out = lane.forward(0, hidden, weights, ids)
            torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                                       rtol=1e-5, atol=1e-5)
        report = host.describe(0)
        assert report["runs"] == 4 and report["parks"] >= 4, report
        assert report["computed"] == int(cache.host_computed) > 0
    finally:
        lane.close()
    assert not host.node._thread.is_alive()


def test_the_host_takes_the_misses_with_the_fewest_tokens_and_leaves_hits_alone():
    w13, w2 = experts()
    cache = ExpertCache({"w13": w13, "w2": w2}, 2 * K, "cpu")
    ids = torch.tensor([[5, 1, 2], [5, 1, 3]])  # 5 and 1 have two tokens, 2 and 3 one
    for _ in cache.serve(ids, 0.5):  # nothing cached: 4 misses, 2 to the host
        pass
    assert cache.host_mine[:E].nonzero().flatten().tolist() == [2, 3]
    assert sorted(cache.holding().values()) == [1, 5]  # only the copied ones are installed
    ids = torch.tensor([[5, 1, 7], [5, 1, 8]])  # 5 and 1 now hit: the host shares the misses
    for _ in cache.serve(ids, 1.0):
        pass
    assert cache.host_mine[:E].nonzero().flatten().tolist() == [7, 8]
    assert int(cache.host_computed) == 4 and int(cache.misses) == 6 and int(cache.hits) == 2


def test_a_host_share_is_refused_for_steps_of_several_passes():
    lane, cache, host, *_ = lane_with_host(slots=K, share=0.5)
    try:
        ids, weights = routing(3, 2)  # 6 choices through 3 slots: two passes
        with pytest.raises(KernelError, match="fit the slots"):
            next(cache.serve(ids, 0.5))
        out = lane.forward(0, torch.randn(2, H), weights, ids)  # the lane copies them all
        assert torch.isfinite(out).all() and int(cache.host_computed) == 0
    finally:
        lane.close()


# the proof: the host's share (Note [Expert lane hazards]) and its mutants

def host_step(join: bool = True, stage_first: bool = True):
    ops = [ExpertOp("install", "lane", ((0, 0),)), ExpertOp("read", "lane", ((0, 0),))]
    if stage_first:
        ops += [ExpertOp("stage", "lane"), ExpertOp("wait", "host", on="lane")]
    else:
        ops += [ExpertOp("wait", "host", on="lane"), ExpertOp("stage", "lane")]
    ops.append(ExpertOp("cpu", "host", ((1, 1), (2, 2))))
    if join:
        ops.append(ExpertOp("wait", "lane", on="host"))
    ops.append(ExpertOp("sum", "lane"))
    return ops


def test_the_proof_accepts_the_host_protocol_and_refuses_its_mutants():
    assert check_expert_step({}, {0, 1, 2}, host_step(), slots=2) == {0: 0}
    with pytest.raises(HazardError, match="no join") as err:  # host-join-dropped
        check_expert_step({}, {0, 1, 2}, host_step(join=False), slots=2)
    assert err.value.kind == "unjoined-host"
    with pytest.raises(HazardError, match="staged inputs"):  # posted before its inputs landed
        check_expert_step({}, {0, 1, 2}, host_step(stage_first=False), slots=2)
    never = host_step()[:-2]  # the step ends without the host's rows
    with pytest.raises(HazardError, match="never summed"):
        check_expert_step({}, {0, 1, 2}, never, slots=2)
    restaged = host_step()[:5] + [ExpertOp("stage", "lane")] + host_step()[5:]
    with pytest.raises(HazardError, match="rewrites the host's inputs"):
        check_expert_step({}, {0, 1, 2}, restaged, slots=2)
    aside = [ExpertOp("sum", "side") if op.kind == "sum" else op for op in host_step()]
    with pytest.raises(HazardError, match="not the lane's"):  # summed where no step waits
        check_expert_step({}, {0, 1, 2}, aside, slots=2)
    twice = host_step()[:2] + [ExpertOp("read", "lane", ((1, 0),))]
    with pytest.raises(HazardError):
        check_expert_step({0: 1}, {0, 1, 2}, twice + host_step()[2:], slots=2)


def test_a_lane_whose_join_is_dropped_reads_a_poisoned_output_and_fails_the_proof(monkeypatch):
    """The mutant ``host-join-dropped`` at run time: the host's worker is held until the step
    has read its output, which is the poison, and the step's trace fails the proof."""
    lane, cache, host, w13, w2 = lane_with_host(slots=2 * K, share=1.0)
    ring = host.node.post

    def held_post():  # the doorbell rings only when the test lets it
        monkeypatch.setattr(host.node, "pending", True, raising=False)

    def join_without_waiting(tokens, trace=None):
        if trace is not None:
            trace.append(ExpertOp("sum", "cpu"))
        return host._out[:tokens].copy_(host.out[:tokens])

    monkeypatch.setattr(host.node, "post", held_post)
    monkeypatch.setattr(host, "join", join_without_waiting)
    try:
        ids, weights = routing(5, 1)
        hidden = torch.randn(1, H)
        out = lane.forward(0, hidden, weights, ids)
        assert out.isnan().all()  # the poison, not the experts
        with pytest.raises(HazardError, match="no join"):
            check_expert_step({}, set(ids.flatten().tolist()), cache.trace, cache.slots)
    finally:
        ring()  # let the held step run, and wait for it before closing
        HostNode.join(host.node)
        lane.close()


# the measurement and the model's use of it

def test_host_rates_tool_writes_what_the_model_and_place_experts_read(tmp_path, capsys):
    import subprocess
    import sys

    from ringflow.cli import main
    out = tmp_path / "rates.json"
    run = subprocess.run([sys.executable, "tools/host_rates.py", "--quick", "--threads", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "read GB/s" in run.stdout and "handoff" in run.stdout
    rates = HostRates.load(out)
    assert set(rates.expert_ms) == {1, 2, 4, 8, 16} and rates.handoff_ms > 0
    assert main(["place-experts", "--hit-rate", "0.25", "--host-rates", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 misses per layer" in printed and "predicted step, host split" in printed
    assert main(["place-experts", "--host-rates", str(tmp_path / "missing.json")]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and "tools/host_rates.py" in refused.err  # before any work


def test_the_fp8_sums_tool_measures_against_exact_block_sums():
    """tools/fp8_dot_accuracy.py (Note [fp8 sums on Hopper]) compares the GPU's block-fp8
    GEMM with exact block sums: those equal the float64 GEMM of the dequantized values, an
    error of 0.1% moves most elements' bf16 rounding and none toward zero by chance, and on
    a machine without a GPU the tool says so and does nothing."""
    import subprocess
    import sys
    from pathlib import Path
    tools = str(Path(__file__).resolve().parents[2] / "tools")
    sys.path.insert(0, tools)
    try:
        import fp8_dot_accuracy as tool
    finally:
        sys.path.remove(tools)
    g = torch.Generator().manual_seed(3)
    b, b_scale = tool.weight_codes(256, 384, g)
    a, a_scale = tool.block_codes(5, 384, g)
    exact = tool.exact_block_gemm(a, a_scale, b, b_scale)
    values = (tool.dequantized(a, a_scale, 1).double()
              @ tool.dequantized(b, b_scale, tool.BLOCK).double().T)
    torch.testing.assert_close(exact, values, rtol=1e-6, atol=1e-6 * exact.abs().max().item())
    same = tool.compare(exact.float(), exact)
    assert same["bf16_elements_apart"] == 0.0 and same["max_abs_rel_error"] < 1e-7
    shrunk = tool.compare((exact * (1 - 1e-3)).float(), exact)
    assert shrunk["bf16_elements_apart"] > 0.1 and shrunk["share_toward_zero"] == 1.0
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, f"{tools}/fp8_dot_accuracy.py"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr, run.stderr


# on a GPU: the host node inside captured graphs (pytest -m cuda)

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


class Ranges:
    """A host node's ranges context that records where and when it was entered and left."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __call__(self):
        return self

    def __enter__(self):
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.events.append(("enter", device))
        return self

    def __exit__(self, *exc):
        self.events.append(("exit", None))
        return False


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_the_workers_ranges_are_entered_on_its_thread_and_left_when_it_stops():
    events: list = []
    node = HostNode(torch.jit.script(doubler), (torch.ones(2), torch.zeros(2),
                                                torch.zeros((), dtype=torch.int64)),
                    "cpu", "ringflow/test/ranges", ranges=Ranges(events))
    node.post()
    node.join()
    node.close()
    assert [kind for kind, _ in events] == ["enter", "exit"]


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_worker_closed_during_a_capture_leaves_its_ranges_to_keep_the_capture():
    """Note [Host work in NVTX]: torch's NVTX profiler syncs the GPU as it ends. A lane dropped
    (its node closed by a finalizer) while a graph is being captured must not end it then: the
    capture completes and replays; the worker entered its ranges on the node's GPU."""
    dev = _gpu()
    events: list = []
    src, dst = torch.ones(4, pin_memory=True), torch.zeros(4, pin_memory=True)
    node = HostNode(torch.jit.script(doubler), (src, dst, torch.zeros((), dtype=torch.int64)),
                    dev, "ringflow/test/capture-close", ranges=Ranges(events))
    x = torch.arange(4.0, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            y = x * 2
            node.close()  # a finalizer, mid-capture
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.arange(4.0) * 2)
    assert events == [("enter", dev.index or 0)], events  # entered on its GPU, never left


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("parking", [False, True])
def test_a_replayed_graph_rings_the_host_node_at_every_replay(parking):
    """D2H of a device tensor, the host doubles it, H2D back, all captured once (the doorbell
    and the wait as memory-operation nodes) and replayed with new inputs: each replay's
    output is its own input doubled (poisoned before), and the worker ran once per replay;
    with ``parking``, the worker parked before each replay (Note [An idle worker parks]) and
    the stream's doorbell alone brought it back."""
    from ringflow.graphs.host_node import idle_polls_for
    dev = _gpu()
    src = torch.zeros(64, device=dev)
    staged = torch.empty(64).pin_memory()
    answer = torch.empty(64).pin_memory()
    out = torch.empty(64, device=dev)
    runs = torch.zeros((), dtype=torch.int64)
    node = HostNode(torch.jit.script(doubler),
                    (staged, answer, runs, idle_polls_for(1.0) if parking else 0), dev,
                    "ringflow/test/host")
    try:
        def step():
            staged.copy_(src, non_blocking=True)
            node.post()
            src.add_(0)  # the GPU's own work between the two
            node.join()
            out.copy_(answer, non_blocking=True)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # eager once
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        before = int(runs)
        for i in range(5):
            values = torch.randn(64, generator=torch.Generator().manual_seed(i))
            src.copy_(values)
            out.fill_(float("nan"))
            answer.fill_(float("nan"))
            if parking:
                time.sleep(0.02)  # idle: the worker parks
            parks = node.parks
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.cpu(), 2 * values)
            assert not parking or parks > 0, parks
        assert int(runs) == before + 5
        assert (node.parks >= 5) == parking, node.parks
    finally:
        torch.cuda.synchronize()
        node.close()


@pytest.mark.cuda
@pytest.mark.parametrize("nvtx", [False, True])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_captured_lane_step_computes_new_routings_on_the_host_at_every_replay(share, nvtx,
                                                                               monkeypatch):
    """A lane decode step of 2 tokens with a host share, captured once and replayed with new
    routings: each replay equals the float64 MoE (slots and the host's output poisoned), and
    the host computed experts at every replay; with ``nvtx``, as under Nsight, the worker's
    thread runs under torch's NVTX profiler (Note [Host work in NVTX])."""
    from ringflow.graphs import nvtx_ranges
    made = []
    real = nvtx_ranges.host_thread_ranges

    def ranges():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(nvtx_ranges, "tool_attached", lambda: nvtx)
    monkeypatch.setattr(nvtx_ranges, "host_thread_ranges", ranges)
    dev = _gpu()
    w13, w2 = experts()
    cache = ExpertCache({"w13": w13.pin_memory(), "w2": w2.pin_memory()}, 2 * K, dev)
    host = HostExperts({0: cache.host}, H, K, 2, dev, torch.float32)
    lane = ExpertLane({0: cache}, {0: TorchCompute()}, host=host,
                      host_policy=HostPolicy({1: share, 2: share}, "test"))
    ids_in = torch.zeros(2, K, dtype=torch.int64, device=dev)
    weights_in = torch.zeros(2, K, device=dev)
    hidden_in = torch.zeros(2, H, device=dev)
    out = torch.empty(2, H, device=dev)

    def forward():
        out.copy_(lane.forward(0, hidden_in, weights_in, ids_in))

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ids, w = routing(0, 2)
            ids_in.copy_(ids)
            weights_in.copy_(w)
            forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        runs = host.describe(0)["runs"]
        g = torch.Generator().manual_seed(4)
        for s in range(6):
            ids, w = routing(70 + s, 2)
            hidden = torch.randn(2, H, generator=g)
            ids_in.copy_(ids)
            weights_in.copy_(w)
            hidden_in.copy_(hidden)
            out.fill_(float("nan"))
            host.out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.cpu().double(), moe_ref(hidden, w13, w2, w, ids),
                                       rtol=1e-4, atol=1e-4)
        assert host.describe(0)["runs"] == runs + 6 and int(cache.host_computed) > 0
        assert [type(m).__name__ for m in made] == ["emit_nvtx" if nvtx else "nullcontext"]
    finally:
        torch.cuda.synchronize()
        lane.close()


def test_vllms_cpu_build_keeps_the_host_share_off_and_says_why(caplog):
    from ringflow.integrations.vllm.expert_host import host_shares
    from ringflow.orchestrator.sections import experts_section
    w13, w2 = experts()
    cache = ExpertCache({"w13": w13, "w2": w2}, K, "cpu")
    off = experts_section({"layers": "all"}, None)
    assert host_shares(off, {0: cache}, {0: object()}, None) == (None, None)
    assert "host_share" not in caplog.text  # off by default: nothing to say
    auto = experts_section({"layers": "all", "host_share": "auto"}, None)
    with caplog.at_level("INFO", logger="ringflow"):
        assert host_shares(auto, {0: cache}, {0: object()}, None) == (None, None)
    assert "already compute on the CPU" in caplog.text


def test_the_host_split_takes_the_slot_count_of_the_layers_that_miss(caplog):
    """Slots per layer (Note [Host split]): whole layers miss only lent rows, so the split
    is sized from the other layers' one count; every layer whole leaves nothing to share
    (off, said once); layers that miss with different counts are refused by name."""
    from ringflow.errors import ProfileError
    from ringflow.integrations.vllm.expert_host import host_shares, shared_slots
    from ringflow.orchestrator.sections import experts_section
    w13, w2 = experts()
    store = {"w13": w13, "w2": w2}

    def caches(*counts):
        return {q: ExpertCache(store, n, "cpu") for q, n in enumerate(counts)}

    assert shared_slots(caches(E, K, E, K)) == K
    assert shared_slots(caches(K, K)) == K
    assert shared_slots(caches(E, E)) is None
    with pytest.raises(ProfileError, match=rf"have \[{K}, {K + 1}\] slots.*host_share: off"):
        shared_slots(caches(E, K, K + 1))
    auto = experts_section({"layers": "all", "host_share": "auto"}, None)
    with caplog.at_level("INFO", logger="ringflow"):
        assert host_shares(auto, caches(E, E), {0: object(), 1: object()}, None) == (None, None)
    assert "every chosen layer keeps all its experts" in caplog.text
    with pytest.raises(ProfileError, match="one slot count"):
        host_shares(auto, caches(K, K + 1), {0: object(), 1: object()}, None)


def test_block_fp8_host_rows_are_refused_where_vllm_takes_deepgemms_power_of_two_scales():
    """vLLM with DeepGEMM's E8M0 scales skips the fused activation the host's block-fp8 rows
    follow (Note [Host rows round as the kernel]): the host share says so and stays off
    (auto) or stops the start with the fix (a forced share); bf16 and per-tensor stores are
    unaffected."""
    from ringflow.integrations.vllm.expert_host import host_rows_unlike_vllms
    blocks, tensor = fp8_experts("cpu", True), fp8_experts("cpu", False)
    assert "E8M0" in host_rows_unlike_vllms(blocks, e8m0=True)
    assert host_rows_unlike_vllms(blocks, e8m0=False) is None
    assert host_rows_unlike_vllms(tensor, e8m0=True) is None
    w13, w2 = experts()
    assert host_rows_unlike_vllms({"w13": w13, "w2": w2}, e8m0=True) is None


def _kernel_over(apply, moe_sum, experts: int, top_k: int, w13: tuple, w2: tuple, monkeypatch):
    """ResidentKernel of a layer of ``experts`` experts over a stand-in for vLLM's modular
    kernel: ``apply(impl, **its arguments)`` as its apply, ``moe_sum(rows, out)`` as its
    experts' sum, the tiles' lookup left out."""
    from types import SimpleNamespace

    from ringflow.integrations.vllm.expert_kernel import ResidentKernel

    class Experts:  # vLLM's TritonExperts, as far as the lane touches it
        quant_config = SimpleNamespace(config_name=lambda dtype: None)
        block_shape = None

        def moe_sum(self, rows, out):
            moe_sum(rows, out)

    class Impl:  # its modular kernel
        def __init__(self):
            self.fused_experts = Experts()

        def apply(self, **arguments):
            return apply(self, **arguments)

    layer = SimpleNamespace(quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(
        impl=Impl())), top_k=top_k, activation="silu", global_num_experts=experts)
    kernel = ResidentKernel(layer, (torch.Size((experts, *w13)), torch.Size((experts, *w2))))
    monkeypatch.setattr(kernel, "config", lambda tokens, dtype: {})
    return kernel


def test_vllms_kernel_takes_the_hosts_rows_at_their_choices_and_sums_once(monkeypatch):
    """ResidentKernel with a host share (Note [Host experts], step 3), over a stand-in for
    vLLM's modular kernel: the rows of the choices its map skips (never written: NaN here)
    are the host's, the host is joined once, at the sum, and the one ``moe_sum`` sums them
    with the kernel's own; a step without a map cannot take host rows."""
    pytest.importorskip("vllm")
    sums = []

    def moe_sum(rows, out):
        sums.append(rows.clone())
        out.copy_(rows.sum(1))

    def apply(impl, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, apply_router_weight_on_input):
        slot = expert_map[topk_ids.long()]  # the rows of the choices the map names
        rows = torch.full((*topk_ids.shape, hidden_states.shape[1]), float("nan"))
        for t, j in (slot >= 0).nonzero().tolist():
            rows[t, j] = topk_weights[t, j] * hidden_states[t] * w1[slot[t, j], 0, 0]
        out = torch.empty_like(hidden_states)
        impl.fused_experts.moe_sum(rows, out)
        return out

    kernel = _kernel_over(apply, moe_sum, 6, 3, (4, 5), (5, 2), monkeypatch)
    w13, w2 = torch.rand(2, 4, 5) + 1, torch.rand(2, 5, 2)  # slots 0, 1: experts 0 and 2
    expert_map = torch.tensor([0, -1, 1, -1, -1, -1])  # experts 1 and 3: the host's
    ids = torch.tensor([[0, 1, 2], [3, 0, 1]])
    weights = torch.rand(2, 3)
    x = torch.randn(2, 5)
    host = torch.zeros(2, 3, 5)
    for t, j in ((0, 1), (1, 0), (1, 2)):
        host[t, j] = torch.randn(5)
    joined = []

    def host_rows():
        joined.append(len(sums))  # the kernel's sum has not run yet
        return host

    out = kernel(x, {"w13": w13, "w2": w2}, weights, ids, expert_map, True, host_rows)
    want = host.sum(1).clone()
    for t, j in ((0, 0), (0, 2), (1, 1)):
        want[t] += weights[t, j] * x[t] * w13[expert_map[ids[t, j]], 0, 0]
    assert joined == [0] and len(sums) == 1
    torch.testing.assert_close(out, want)
    with pytest.raises(KernelError, match="one pass over the slots"):
        kernel(x, {"w13": w13, "w2": w2}, weights, ids, None, True, host_rows)


def test_a_pass_over_more_rows_than_experts_keeps_its_map(monkeypatch):
    """Note [Same bits as resident], rule 4: a one-pass step over the slots (fewer rows than
    the layer's experts) names the slots as its choices and passes no map; over an arena of
    more rows than experts (a large step's map onto any of them) the choices stay the
    layer's experts and the map goes to vLLM's kernel, whose sort counts only the layer's
    experts as buckets (vLLM 0.26)."""
    pytest.importorskip("vllm")
    calls = []

    def apply(impl, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, apply_router_weight_on_input):
        calls.append((topk_ids.clone(), None if expert_map is None else expert_map.clone(),
                      global_num_experts))
        row = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
        rows = topk_weights.unsqueeze(-1) * hidden_states.unsqueeze(1) * w1[row, 0, 0, None]
        out = torch.empty_like(hidden_states)
        impl.fused_experts.moe_sum(rows, out)
        return out

    kernel = _kernel_over(apply, lambda rows, out: out.copy_(rows.sum(1)), 4, 2, (3, 5), (5, 2),
                          monkeypatch)
    weights, x = torch.rand(2, 2), torch.randn(2, 5)
    # 3 slots (every choice in one), an arena of 10 rows
    for rows, where, chosen in ((3, [2, 0, 1, -1], [[0, 2], [2, 1]]),
                                (10, [7, 9, 0, 4], [[0, 3], [2, 1]])):
        w13, w2 = torch.rand(rows, 3, 5) + 1, torch.rand(rows, 5, 2)
        expert_map, ids = torch.tensor(where), torch.tensor(chosen)
        out = kernel(x, {"w13": w13, "w2": w2}, weights, ids, expert_map)
        given, mapped, experts = calls[-1]
        want = (weights.unsqueeze(-1) * x.unsqueeze(1) * w13[expert_map[ids], 0, 0, None]).sum(1)
        torch.testing.assert_close(out, want)
        assert experts == 4
        if rows == 3:
            assert mapped is None and torch.equal(given, expert_map[ids])
        else:
            assert torch.equal(mapped, expert_map) and torch.equal(given, ids)


@pytest.mark.cuda
def test_the_copy_load_copies_on_a_stream_of_ringflows_own():
    """The start-up's host-rate measurement loads the host link on a dedicated stream (Note
    [Dedicated streams]), never one of torch's pool that vLLM may capture on, and the copies
    run at a host link's rate while it measures."""
    device = _gpu()
    from ringflow.integrations.torch.host_experts import CopyLoad

    pool = {torch.cuda.Stream(device).cuda_stream for _ in range(64)}  # every pooled stream
    with CopyLoad(device, 64) as load:
        time.sleep(0.3)
    assert load.stream.cuda_stream not in pool
    assert load.stream.cuda_stream != torch.cuda.current_stream(device).cuda_stream
    assert load.bytes >= 2 * (64 << 20) and 5 < load.gbps < 200, (load.bytes, load.gbps)
    assert torch.equal(load.dst[:4096].cpu(), load.src[:4096])


# the host share beside the lane's large-step layouts (held layers, the arena)

@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("layout", ["held", "arena"])
def test_a_host_share_beside_held_layers_or_the_arena_equals_the_float64_moe(layout, share):
    """The bench's fastest decode layouts with a host share: held layers (no cache, so no host
    share) or the arena (its carried fills may still write the slots a small step reads).
    Small steps hand the cached layers' misses to the host, large steps take the ring or the
    arena's rows; every step equals the float64 MoE, each cached layer's host ran at every
    small step, and the lane's joint trace, host operations among the caches', proves."""
    from ringflow.orchestrator.expert_hazards import check_lane
    from tests.helpers.expert_lanes import LAYERS, SIZES, run_step
    from tests.unit import test_expert_arena, test_expert_layers
    if layout == "held":
        base, hosts = test_expert_layers.make_lane(2, slots=6, hold=True, from_slots=False)
    else:
        base, hosts = test_expert_arena.make_lane(slots=6)
    cached = sorted(base.caches)
    host = HostExperts({i: base.caches[i].host for i in cached}, H, K, 4, "cpu", torch.float32)
    host.out.fill_(float("nan"))
    policy = HostPolicy({t: share for t in range(1, 5)}, "test")
    lane = ExpertLane(base.caches, base.computes, base.ring, base.layer_tokens, host=host,
                      host_policy=policy)
    ops: list = []
    lane.trace_all(ops)
    lane.forget()  # the held layers carried again, now traced (the proof starts from empty)
    try:
        for s, tokens in enumerate(SIZES):
            got, want = run_step(lane, hosts, tokens, s)
            for i in LAYERS:
                torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
        small = sum(t <= 4 for t in SIZES)
        rows = {r["layer"]: r for r in lane.report()}
        assert sorted(i for i, r in rows.items() if "host_share" in r) == cached
        assert all(rows[i]["host_share"]["runs"] == small for i in cached)
        assert sum(rows[i]["host_share"]["computed"] for i in cached) > 0
        assert {op.kind for op in ops} >= {"stage", "cpu", "sum"}
        check_lane(ops, lane.ring.buffers if layout == "held" else 0)
    finally:
        lane.close()


@pytest.mark.parametrize("raw, ms", [(None, 0.0), ("50", 50.0), ("0.5", 0.5), ("", 0.0)])
def test_the_idle_switch_gives_milliseconds(monkeypatch, raw, ms):
    from ringflow.integrations.vllm.expert_host import idle_ms_switch
    if raw is None:
        monkeypatch.delenv("RINGFLOW_HOST_IDLE_MS", raising=False)
    else:
        monkeypatch.setenv("RINGFLOW_HOST_IDLE_MS", raw)
    assert idle_ms_switch() == ms


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan", "inf"])
def test_an_idle_switch_that_is_no_time_stops_with_the_fix(monkeypatch, raw):
    from ringflow.integrations.vllm.expert_host import idle_ms_switch
    monkeypatch.setenv("RINGFLOW_HOST_IDLE_MS", raw)
    with pytest.raises(ConfigError, match="RINGFLOW_HOST_IDLE_MS=.*a number > 0"):
        idle_ms_switch()
