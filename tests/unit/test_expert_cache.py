"""The expert cache (Note [Expert cache]) against a float64 MoE, on CPU and (marked cuda) on a GPU
inside a captured graph: random routings, repeated and fresh experts, caches smaller than one
step's experts."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import ConfigError, KernelError
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.kernels.moe import moe_from_slots
from ringflow.kernels.reference import moe_ref

E, H, I, K = 12, 16, 8, 3


def experts(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return w13, w2


def routing(seed: int, tokens: int, pool: int = E):
    """top-K distinct experts per token drawn from the first ``pool`` experts, softmax weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    return ids, weights


def step(cache: ExpertCache, hidden, ids, weights):
    out = torch.zeros_like(hidden)
    maps = []
    for source, expert_map in cache.serve(ids):
        maps.append(expert_map.clone())
        out += moe_from_slots(hidden, source["w13"], source["w2"], weights, ids, expert_map)
    return out, maps


def make(slots: int, device="cpu", dtype=torch.float32, in_place_tokens: int = 0):
    """A cache over seeded experts: pinned host copies on a GPU, or (in place) copies the
    GPU's kernel reads where they are, as vLLM's CUDA view of pinned memory is read."""
    w13, w2 = experts(dtype=dtype)
    host = {"w13": w13, "w2": w2}
    if device != "cpu":
        host = {k: v.to(device) if in_place_tokens else v.pin_memory() for k, v in host.items()}
    cache = ExpertCache(host, slots, device, in_place_tokens=in_place_tokens)
    return cache, w13, w2


@pytest.mark.parametrize("in_place_tokens", [0, 4])
@pytest.mark.parametrize("slots", [E, 7, K, 2, 1])
def test_every_step_equals_the_float64_moe_for_random_routings(slots, in_place_tokens):
    cache, w13, w2 = make(slots, in_place_tokens=in_place_tokens)
    g = torch.Generator().manual_seed(1)
    for s, tokens in enumerate([1, 1, 2, 5, 1, 3, 8, 1]):
        ids, weights = routing(100 + s, tokens, pool=6 if s % 2 else E)  # repeats, then fresh
        hidden = torch.randn(tokens, H, generator=g)
        out, maps = step(cache, hidden, ids, weights)
        assert len(maps) == cache.passes(tokens, K)
        torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                                   rtol=1e-5, atol=1e-5)
        served = torch.stack([m >= 0 for m in maps]).sum(0)  # each needed expert exactly once
        needed = torch.zeros(E, dtype=torch.long).index_fill_(0, ids.reshape(-1), 1)
        assert torch.equal(served, needed)


def test_slots_hold_exactly_the_host_experts_the_maps_name():
    cache, w13, w2 = make(5)
    ids, weights = routing(3, 4)
    hidden = torch.randn(4, H)
    for _, expert_map in cache.serve(ids):
        for e in torch.nonzero(expert_map >= 0).flatten().tolist():
            s = int(expert_map[e])
            assert torch.equal(cache.weights["w13"][s], w13[e])
            assert torch.equal(cache.weights["w2"][s], w2[e])
        moe_from_slots(hidden, cache.weights["w13"], cache.weights["w2"], weights, ids,
                       expert_map)
    held = cache.expert_in[:5]
    assert torch.equal(cache.slot_of[:E][held[held >= 0]], torch.nonzero(held >= 0).flatten())


def test_a_repeated_routing_hits_and_fetches_nothing():
    cache, _, _ = make(6)
    ids, weights = routing(5, 2)  # up to 6 distinct experts: all fit
    hidden = torch.randn(2, H)
    step(cache, hidden, ids, weights)
    distinct = ids.unique().numel()
    assert (int(cache.hits), int(cache.misses)) == (0, distinct)
    for name in cache.weights:  # a second step must not write: poison what is not cached
        held = cache.expert_in[:6] >= 0
        cache.weights[name][~held] = float("nan")
    out, _ = step(cache, hidden, ids, weights)
    assert (int(cache.hits), int(cache.misses)) == (distinct, distinct)
    assert cache.hit_rate() == 0.5
    assert torch.isfinite(out).all()


def test_least_recently_used_expert_is_evicted_first():
    cache, _, _ = make(2)
    hidden = torch.randn(1, H)
    one = lambda e: (torch.tensor([[e]]), torch.ones(1, 1))  # noqa: E731  top-1 steps
    for e in (0, 1, 0, 2):  # 1 is older than 0 when 2 arrives
        list(cache.serve(one(e)[0]))
    assert int(cache.slot_of[1]) == -1
    assert int(cache.slot_of[0]) >= 0 and int(cache.slot_of[2]) >= 0


def test_passes_grow_with_the_step_and_stop_at_the_layer():
    cache, _, _ = make(4)
    assert [cache.passes(t, K) for t in (1, 2, 3, 4, 64)] == [1, 2, 3, 3, 3]
    in_place, _, _ = make(4, in_place_tokens=3)  # up to 3 tokens: pass 0, then one in place
    assert [in_place.passes(t, K) for t in (1, 2, 3, 4, 64)] == [1, 2, 2, 3, 3]


def test_a_step_in_place_installs_what_pass_0_can_and_reads_the_rest_from_the_host():
    """Step 5 of Note [Expert cache]: the cache still learns (the next step hits what pass 0
    installed), the second pass names only host experts no slot holds, and the counters say
    which steps went in place."""
    cache, w13, w2 = make(2, in_place_tokens=8)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    weights = torch.softmax(torch.randn(2, K), -1)
    hidden = torch.randn(2, H)
    (first, map0), (second, map1) = [(src, m.clone()) for src, m in cache.serve(ids)]
    assert first is cache.weights and second is cache.host
    assert int((map0 >= 0).sum()) == 2 and int((map1 >= 0).sum()) == 4
    in_place = torch.nonzero(map1 >= 0).flatten()
    assert torch.equal(map1[in_place], in_place)  # host experts by their own index
    assert (cache.slot_of[in_place] < 0).all()
    out, _ = step(cache, hidden, ids, weights)
    torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    assert cache.describe()["in_place_steps"] == 2
    hits = int(cache.hits)
    list(cache.serve(torch.tensor([[int(e) for e in torch.nonzero(map0 >= 0).flatten()]
                                   + [6]])))  # one token, two of its experts in the slots
    assert int(cache.hits) == hits + 2 and cache.describe()["in_place_steps"] == 3


def test_bad_inputs_are_typed_errors():
    w13, w2 = experts()
    with pytest.raises(ConfigError, match="1 to 12 slots"):
        ExpertCache({"w13": w13, "w2": w2}, 0, "cpu")
    with pytest.raises(ConfigError, match="share their first dimension"):
        ExpertCache({"w13": w13, "w2": w2[:5]}, 2, "cpu")
    cache = ExpertCache({"w13": w13, "w2": w2}, 2, "cpu")
    with pytest.raises(KernelError, match=r"\[tokens, top_k\]"):
        next(cache.serve(torch.zeros(3)))
    with pytest.raises(ConfigError, match="in_place_tokens must be >= 0"):
        ExpertCache({"w13": w13, "w2": w2}, 2, "cpu", in_place_tokens=-1)


@pytest.mark.cuda
@pytest.mark.parametrize("slots,in_place_tokens", [(7, 0), (2, 0), (2, 3)])
def test_a_captured_step_replays_any_routing_exactly(slots, in_place_tokens):
    """One graph captured for 3 tokens, replayed with new routings written into its input:
    the output equals the float64 MoE each time, with poisoned slots before the capture (and,
    in place, its second pass reading the host store inside the graph)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    cache, w13, w2 = make(slots, dev, in_place_tokens=in_place_tokens)
    ids_in = torch.zeros(3, K, dtype=torch.int64, device=dev)
    weights_in = torch.zeros(3, K, device=dev)
    hidden_in = torch.zeros(3, H, device=dev)
    out = torch.empty(3, H, device=dev)

    def forward():
        out.zero_()
        for source, expert_map in cache.serve(ids_in):
            out.add_(moe_from_slots(hidden_in, source["w13"], source["w2"], weights_in, ids_in,
                                    expert_map))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ids, w = routing(0, 3)
        ids_in.copy_(ids)
        weights_in.copy_(w)
        forward()  # warm-up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    g = torch.Generator().manual_seed(9)
    for s in range(6):
        ids, w = routing(50 + s, 3, pool=5 if s % 2 else E)
        hidden = torch.randn(3, H, generator=g)
        ids_in.copy_(ids)
        weights_in.copy_(w)
        hidden_in.copy_(hidden)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().double(), moe_ref(hidden, w13, w2, w, ids),
                                   rtol=1e-4, atol=1e-4)
    assert 0 < cache.hit_rate() < 1
    assert cache.describe()["in_place_steps"] == (7 if in_place_tokens else 0)  # and warm-up


def test_fetch_copies_only_the_first_count_pairs_and_checks_its_inputs():
    from ringflow.kernels.expert_fetch import fetch_experts
    host = torch.randn(6, 4, 2)
    cache = torch.full((3, 4, 2), float("nan"))
    ids, slots = torch.tensor([4, 1, 5]), torch.tensor([2, 0, 1])
    fetch_experts(host, cache, ids, slots, torch.tensor([2]))
    assert torch.equal(cache[2], host[4]) and torch.equal(cache[0], host[1])
    assert cache[1].isnan().all()
    with pytest.raises(KernelError, match="exceeds"):
        fetch_experts(host, cache, ids, slots, torch.tensor([4]))
    with pytest.raises(KernelError, match="trailing dimensions"):
        fetch_experts(host, cache[:, :3], ids, slots, torch.tensor([1]))
    with pytest.raises(KernelError, match="1-D of one length"):
        fetch_experts(host, cache, ids, slots[:2], torch.tensor([1]))


@pytest.mark.cuda
def test_fetch_reads_pinned_host_memory_by_device_ids_and_refuses_pageable():
    from ringflow.kernels.expert_fetch import fetch_experts
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        host = torch.randn(9, 64, 48).to(dtype).pin_memory()
        cache = torch.full((4, 64, 48), float("nan"), device="cuda").to(dtype)
        ids = torch.tensor([8, 0, 3, 5], device="cuda")
        slots = torch.tensor([1, 3, 0, 2], device="cuda")
        fetch_experts(host, cache, ids, slots, torch.tensor([3], device="cuda"))
        torch.cuda.synchronize()
        for e, s in zip([8, 0, 3], [1, 3, 0]):
            assert torch.equal(cache[s].cpu().view(torch.uint8), host[e].view(torch.uint8))
        assert cache[2].float().isnan().all()
    with pytest.raises(KernelError, match="pageable"):
        fetch_experts(torch.randn(9, 4), torch.empty(4, 4, device="cuda"), ids, slots,
                      torch.tensor([1], device="cuda"))


def test_a_choice_of_minus_one_contributes_nothing():
    """vLLM writes -1 for a choice another rank serves: it must not wrap to the last expert."""
    w13, w2 = experts()
    hidden = torch.randn(1, H)
    expert_map = torch.arange(E)
    alone = moe_from_slots(hidden, w13, w2, torch.tensor([[0.5]]), torch.tensor([[E - 1]]),
                           expert_map)
    with_minus_one = moe_from_slots(hidden, w13, w2, torch.tensor([[0.5, 0.5]]),
                                    torch.tensor([[E - 1, -1]]), expert_map)
    torch.testing.assert_close(with_minus_one, alone)


def fp8_experts(device: str, blocks: bool):
    """fp8 experts with their scales as vLLM's fp8 MoE keeps them (Note [fp8 experts]): per
    expert and weight ([E, 1] in the store), or per 4x4 block ([E, n/4, k/4])."""
    w13, w2 = experts(seed=5)
    g = torch.Generator().manual_seed(6)
    shapes = ((E, 2 * I // 4, H // 4), (E, H // 4, I // 4)) if blocks else ((E, 1), (E, 1))
    host = {"w13": w13.to(torch.float8_e4m3fn), "w2": w2.to(torch.float8_e4m3fn),
            "w13_scale": 0.5 + torch.rand(shapes[0], generator=g),
            "w2_scale": 0.5 + torch.rand(shapes[1], generator=g)}
    if device != "cpu":
        host = {k: v.pin_memory() for k, v in host.items()}
    return host


def dequantized(weights: dict, name: str) -> torch.Tensor:
    """A layer's fp8 weights times their scales: one per expert, or one per block (its size
    from the shapes)."""
    w, scale = weights[name].float(), weights[f"{name}_scale"].float()
    if scale.dim() == 2:  # one per expert
        return w * scale[:, :, None]
    rows, cols = w.shape[1] // scale.shape[1], w.shape[2] // scale.shape[2]
    return w * scale.repeat_interleave(rows, 1).repeat_interleave(cols, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_experts_move_with_their_scales(device, blocks):
    """Each pass's slots hold the fp8 weights and the scales of the experts its map names, bit
    for bit; computed from them (dequantized per slot) every step equals the float64 MoE of
    the dequantized layer: a scale left in another expert's slot would not."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    host = fp8_experts(device, blocks)
    cache = ExpertCache(host, 5, device)
    layer = {k: v.cpu() for k, v in host.items()}
    w13, w2 = dequantized(layer, "w13"), dequantized(layer, "w2")
    g = torch.Generator().manual_seed(7)
    for s in range(4):
        ids, weights = routing(20 + s, 3)
        hidden = torch.randn(3, H, generator=g)
        out = torch.zeros(3, H)
        for source, expert_map in cache.serve(ids.to(cache.device)):
            got = {k: v.cpu() for k, v in source.items()}
            expert_map = expert_map.cpu()
            for e in torch.nonzero(expert_map >= 0).flatten().tolist():
                slot = int(expert_map[e])
                for name, t in got.items():
                    assert torch.equal(t[slot].view(torch.uint8), layer[name][e].view(torch.uint8))
            out += moe_from_slots(hidden, dequantized(got, "w13"), dequantized(got, "w2"),
                                  weights, ids, expert_map)
        torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                                   rtol=1e-5, atol=1e-5)


def test_whole_in_place_computes_a_step_beyond_the_slots_in_one_pass_from_the_host():
    """Note [Expert cache], step 6: a step needing more experts than the slots is one pass over
    the host store (nothing installed, no hit or miss counted); a step that fits the slots
    goes through them as always. Both equal the float64 MoE."""
    w13, w2 = experts()
    cache = ExpertCache({"w13": w13, "w2": w2}, 4, "cpu", whole_in_place=True)
    assert cache.passes(3, K) == 1 and cache.passes(1, K) == 1
    g = torch.Generator().manual_seed(3)
    for tokens, want_sources in ((3, ["host"]), (1, ["slots"]), (5, ["host"])):
        ids, weights = routing(40 + tokens, tokens)
        hidden = torch.randn(tokens, H, generator=g)
        before = cache.expert_in.clone()
        served = list(cache.serve(ids))
        assert [("host" if source is cache.host else "slots") for source, _ in served] == \
            want_sources
        out = sum(moe_from_slots(hidden, source["w13"], source["w2"], weights, ids, m)
                  for source, m in served)
        torch.testing.assert_close(out.double(), moe_ref(hidden, w13, w2, weights, ids),
                                   rtol=1e-5, atol=1e-5)
        if want_sources == ["host"]:
            assert torch.equal(cache.expert_in, before)
    assert cache.describe()["in_place_steps"] == 2 and int(cache.misses) == K


def test_device_ints_on_the_cpu_are_the_values():
    from ringflow.integrations.torch.expert_cache import device_ints
    got = device_ints([(3, 7), (0, 2**31 - 1)], torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [[3, 7], [0, 2**31 - 1]]


@pytest.mark.cuda
def test_device_ints_land_while_bulk_copies_are_queued_on_another_stream():
    """Note [Small writes beside bulk copies]: the values are right (flat and in pairs, over
    300 calls), out of int32 is refused, and the compute
    stream's write finishes while 2 GB of host-to-device copies queued before it on a side
    stream are still landing (40 ms at the H100's 55 GB/s; checked after 5 ms)."""
    import time

    from ringflow.integrations.torch.expert_cache import device_ints
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run `pytest -m cuda` on one")
    dev = torch.device("cuda")
    for n in (1, 7, 300):  # more calls than any one step makes, each checked
        values = [(i * 31) % 1000 - 500 for i in range(n)]
        assert device_ints(values, dev).tolist() == values
    assert device_ints([(1, 2), (3, 4)], dev).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(KernelError, match="int32"):
        device_ints([2**31], dev)
    host = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    side, landed, written = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for k in range(16):
            part = slice(k * (128 << 20), (k + 1) * (128 << 20))
            dst[part].copy_(host[part], non_blocking=True)
        landed.record()
    out = device_ints(list(range(256)), dev)
    written.record()
    time.sleep(0.005)
    assert written.query() and not landed.query()
    assert out.tolist() == list(range(256))
    torch.cuda.synchronize()
