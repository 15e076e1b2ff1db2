"""KVPrefetcher on the CPU: slots equal their layer's context KV, outputs equal an engine that
gathers inline, and the lifecycle bugs of hand-written rings (ARCHITECTURE.md) stay fixed."""

import logging
from types import SimpleNamespace as NS

import pytest
import torch

from ringflow import (BudgetError, ConfigError, LifecycleError,
                      SlotPoolExhausted)
from ringflow.integrations.torch.kv_prefetch import KVLayout, KVPrefetcher, KVSource
from ringflow.kernels import reference as ref
from ringflow.testing.models import PagedAttentionStack

MIB = 1 << 20


def _prefetcher(stack, depth, *, verify=True, poison=True, capacity=None, mib=64):
    layout = KVLayout("rows", (stack.row,), stack.dtype, stack.block_size)
    pf = KVPrefetcher(layout, capacity or stack.capacity, max_requests=stack.requests,
                      depth=depth, workspace_bytes=mib * MIB, device=stack.device,
                      verify=verify, poison=poison, name="test-kv")
    pf.plan(stack.layers)
    return pf


def _next_step_matches_inline(stack, pf, seed=1, exact=True):
    """One more step with ``pf``, against a twin of ``stack`` (same caches, table, lengths)
    that gathers inline: bit for bit, or (``exact`` False: ``pf``'s slots hold more rows than
    the inline context, so the attention's matmuls run over a longer, masked dimension, which
    the CPU's BLAS may block and round otherwise: 1.2e-7 on one machine) within 1e-6."""
    inline = PagedAttentionStack(stack.layers)
    inline.caches = [c.clone() for c in stack.caches]
    inline.block_table = stack.block_table.clone()
    inline.context_lens = stack.context_lens.clone()
    for s in (stack, inline):
        s.refill(seed)
    got, want = stack.step(pf), inline.step()
    return torch.equal(got, want) if exact else torch.allclose(got, want, rtol=0, atol=1e-6)


def _twin(seed=0, **kw):
    return PagedAttentionStack(5, seed=seed, **kw), PagedAttentionStack(5, seed=seed, **kw)


def _config(dbo: bool):
    return NS(scheduler_config=NS(max_num_seqs=2), model_config=NS(max_model_len=64,
                                                                   dtype=torch.float32),
              parallel_config=NS(enable_dbo=dbo, decode_context_parallel_size=1),
              device_config=NS(device_type="cpu"), cache_config=NS(block_size=16))


def _dbo_stack(seed):
    """A started step that fits the lanes ``_config`` sizes (2 requests of up to 64 tokens)."""
    stack = PagedAttentionStack(2, row=8, requests=2, max_tokens_per_request=64, seed=seed)
    stack.start([5 + seed, 17])
    stack.refill(seed)
    return stack


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("query_len", [1, 4])
def test_prefetched_steps_equal_inline_gathers_over_many_steps(depth, query_len):
    ours, inline = _twin(query_len=query_len, max_tokens_per_request=64)
    for s in (ours, inline):
        s.start([3, 17, 0])   # different lengths, one request with no context yet
    pf = _prefetcher(ours, depth)
    for step in range(8):
        for s in (ours, inline):
            s.refill(step)
        got, want = ours.step(pf), inline.step()
        assert torch.equal(got, want), f"step {step}: outputs differ"
        for s in (ours, inline):
            s.advance()
    assert pf.verification.checked == 8 * 5 and not pf.verification.mismatches
    assert pf.pool.free_count == pf.pool.slots and pf.steps == 8


def test_verification_catches_a_slot_that_differs_from_the_cache():
    stack = PagedAttentionStack(3, seed=1)
    stack.start([20, 5, 9])
    pf = _prefetcher(stack, 1)
    real = pf._gather

    def late(layer, lane, slot):  # a gather that misses one row, like a torn copy
        real(layer, lane, slot)
        if layer == 2:
            slot[4] += 1
    pf.stepper.executor.gather = late
    pf.stepper.executor._steps = [pf.stepper.executor._bind(n) for n in pf.dag.nodes]
    stack.refill(0)
    stack.step(pf)
    assert [layer for layer, _ in pf.verification.mismatches] == [2]


def test_pages_layout_gathers_whole_pages():
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(12, 3, 8, 4, generator=gen) for _ in range(3)]  # opaque pages
    table = torch.randperm(12, generator=gen)[:8].view(2, 4)
    lens = torch.tensor([9, 30])
    layout = KVLayout("pages", (3, 8, 4), torch.float32, block_size=8)
    pf = KVPrefetcher(layout, 64, max_requests=2, depth=1, workspace_bytes=MIB, device="cpu",
                      verify=True)
    pf.plan(3)
    seen = []
    for layer in range(3):
        pf.begin(layer, lambda j: KVSource(caches[j], table, lens, max_tokens=39))
        seen.append(pf.gathered(layer).clone())
        pf.end(layer)
    for layer in range(3):
        want = ref.page_gather_ref(caches[layer], table, lens, 8, pf.capacity)
        assert torch.equal(seen[layer], want)
    assert pf.verification.checked == 3 and not pf.verification.mismatches


def test_kv_cache_replacement_mid_step_never_reads_the_old_cache():
    """ARCHITECTURE.md: 'state keyed on freed tensors surviving a KV-cache replacement'."""
    stack = PagedAttentionStack(4, seed=2)
    stack.start([10, 30, 2])
    pf = _prefetcher(stack, 2)
    stack.refill(0)
    pf.begin(0, stack.source)                     # gathers of layers 0..2 are in flight

    # the engine replaces every cache (vLLM re-binds caches after memory profiling)
    old = stack.caches
    pf.retire("KV cache replaced")
    stack.caches = [torch.randn_like(c) for c in old]
    for c in old:
        c.fill_(float("nan"))                     # freed memory: any read of it shows
    assert pf.pool.free_count == pf.pool.slots    # the abandoned step's slots came back
    assert pf.gathered(0) is None
    for layer in range(1, 4):                     # the rest of the abandoned step: inert
        pf.begin(layer, stack.source)
        assert pf.gathered(layer) is None
        pf.end(layer)
    assert _next_step_matches_inline(stack, pf)
    assert not pf.verification.mismatches and pf.retired == 1
    assert not torch.isnan(stack.step(pf)).any()


class _MLALayer:
    """What the attention hook reads of vLLM's MLAAttention."""

    kv_lora_rank, qk_rope_head_dim, kv_cache_dtype = 24, 8, "auto"

    def __init__(self, name):
        self.layer_name = name


def test_a_ring_requested_after_the_worker_sizes_its_kv_cache_is_refused():
    """ARCHITECTURE.md: 'buffers allocated lazily after the KV cache was sized'. The worker hook that
    allocates the KV cache ends the time in which a model may allocate its ring."""
    from ringflow.integrations.vllm import attention, weights
    from ringflow.integrations.vllm.state import PluginState
    from ringflow.orchestrator.profile import Profile
    profile = Profile.from_mapping({"kv_prefetch": {"depth": 1, "workspace_mib": 4}})
    config = _config(False)
    state = PluginState()            # the process's state, as the installed hooks receive it
    state.model_group.set(1)
    target = _MLALayer("target.0")  # built before the KV cache: allocates a ring (kept alive)
    attention.attach(state, target, profile, config)
    result = weights.on_initialize_from_config(state, lambda worker: "caches",
                                               NS(vllm_config=config, model_runner=_MLALayer("runner")))
    assert result == "caches"
    state.model_group.set(2)         # a model built after it (a late draft model)
    with pytest.raises(LifecycleError, match="'model group 2'.*after the KV cache was sized"):
        attention.attach(state, _MLALayer("late.0"), profile, config)
    assert list(state.models) == [1]
    assert state.lifecycle == ["kv-ring-allocated", "kv-cache-initialized"]


def test_exhaustion_is_typed_and_hands_every_slot_back():
    stack = PagedAttentionStack(4, seed=3)
    stack.start([8, 8, 8])
    pf = _prefetcher(stack, 1)
    pf.pool.acquire(1)                       # someone holds the slot layer 1 needs
    stack.refill(0)
    with pytest.raises(SlotPoolExhausted):
        stack.step(pf)
    assert pf.pool.free_count == pf.pool.slots    # the failed step reclaimed the whole ring
    assert _next_step_matches_inline(stack, pf)


def test_a_step_larger_than_a_slot_runs_without_prefetch_and_says_so(caplog):
    stack = PagedAttentionStack(2, seed=4)
    layout = KVLayout("rows", (stack.row,), stack.dtype, stack.block_size)
    pf = KVPrefetcher(layout, 16, max_requests=3, depth=1, workspace_bytes=MIB, device="cpu")
    pf.plan(2)
    with caplog.at_level(logging.WARNING, "ringflow"):
        pf.begin(0, lambda j: KVSource(stack.caches[j], stack.block_table,
                                       torch.tensor([10, 10, 10]), max_tokens=30))
    assert pf.gathered(0) is None and "does not fit a slot of 16" in caplog.text
    assert pf.skipped == {"capacity": 1}
    pf.end(0)


def test_rebinding_the_kv_cache_first_retires_every_lane_of_every_model():
    """ARCHITECTURE.md: 'per-instance state reset only once per class'. The hook on vLLM's
    initialize_kv_cache resets each lane of each model, before the old caches go."""
    from ringflow.integrations.vllm import attention
    from ringflow.integrations.vllm.state import PluginState
    from ringflow.orchestrator.profile import Profile
    state = PluginState()
    profile = Profile.from_mapping({"kv_prefetch": {"depth": 1, "workspace_mib": 1}})
    layout = KVLayout("rows", (8,), torch.float32, 16)
    models = [attention.ModelLanes(state, key, profile, layout, lambda c: c, _config(True),
                                   name=f"m{key}") for key in (1, 2)]
    for model in models:
        state.models[model.key] = model
    lanes = [lane for model in models for lane in model.lanes]  # two models x two micro-batches
    for seed, lane in enumerate(lanes):
        stack = _dbo_stack(seed)
        lane.plan(stack.layers)
        lane.begin(0, stack.source)
        assert lane.gathered(0) is not None       # a step in flight holds slots

    seen = []

    def initialize_kv_cache(runner, *args):      # vLLM's own: re-binds the caches
        seen.append([(lane.retired, lane.gathered(0) is None,
                      lane.pool.free_count == lane.pool.slots) for lane in lanes])
        return "bound"

    assert attention.on_initialize_kv_cache(state, initialize_kv_cache, object(),
                                            "config") == "bound"
    assert seen == [[(1, True, True)] * len(lanes)]


def test_bad_arguments_are_typed_errors_that_name_the_arguments():
    """A Python API that never saw a profile names its own arguments, not profile fields."""
    layout = KVLayout("rows", (8,), torch.float32, 16)
    with pytest.raises(BudgetError, match=r"smaller than one full-KV slot \(1,048,576 tokens"
                                          r"\).*fewer capacity tokens") as caught:
        KVPrefetcher(layout, 1 << 20, max_requests=1, depth=1, workspace_bytes=1024,
                     device="cpu")
    assert caught.value.budget_bytes == 1024 and "kv_prefetch" not in str(caught.value)
    with pytest.raises(ConfigError, match="capacity_tokens=0"):
        KVPrefetcher(layout, 0, max_requests=1, depth=1, workspace_bytes=MIB, device="cpu")
    with pytest.raises(ConfigError, match="layout"):
        KVLayout("tiles", (8,), torch.float32, 16)
    pf = KVPrefetcher(layout, 64, max_requests=1, depth=1, workspace_bytes=MIB, device="cpu")
    with pytest.raises(LifecycleError, match="no plan"):
        pf.begin(0, lambda j: None)


def _dcp_prefetch_rank(rank: int, world: int, depth: int, transport: str) -> None:
    """One DCP rank: a 3-layer step whose slots must hold every layer's full (global) KV. On a
    CPU no transport but NCCL's (here gloo) exists: peer and auto fall back to it, and the plan
    says what was asked and what runs."""
    import torch.distributed as dist

    from ringflow.integrations.torch.kv_prefetch import DcpGroup
    lens, row, block_size = [1, 6, 13], 8, 4
    full, shards = [], []
    for layer in range(3):
        gen = torch.Generator().manual_seed(100 + layer)
        rows = [torch.randn(n, row, generator=gen) for n in lens]
        full.append(torch.cat(rows))
        shards.append(ref.dcp_shard_ref(rows, world, 1, block_size, 4)[rank])
    lane_group = dist.new_group(list(range(world)))
    layout = KVLayout("rows", (row,), torch.float32, block_size)
    pf = KVPrefetcher(layout, 32, max_requests=3, depth=depth, workspace_bytes=MIB,
                      device="cpu", dcp=DcpGroup(lane_group, world, rank, transport=transport),
                      verify=True)
    pf.plan(3)
    assert (pf.transport.name, pf.transport.requested, pf.transport.staged) == \
        ("nccl", transport, True)
    assert (pf.transport.fallback != "") == (transport != "nccl")  # why peer is not used
    assert pf.dag.meta["dcp"] == {"size": world, "interleave": 1, "transport": "nccl",
                                  "requested": transport, "staged": True, "measured_ms": {},
                                  "fallback": pf.transport.fallback}
    context = torch.tensor(lens)
    starts = pf.request_starts(context).tolist()
    assert starts == [0, -(-1 // world) * world, -(-1 // world) * world + -(-6 // world) * world]
    for layer in range(3):
        pf.begin(layer, lambda j: KVSource(shards[j][0], shards[j][1], context, max_tokens=20))
        got = pf.gathered(layer)
        want = torch.zeros_like(got)
        for start, part in zip(starts, full[layer].split(lens)):
            want[start: start + len(part)] = part
        assert torch.equal(got, want), f"rank {rank} layer {layer}"
        pf.end(layer)
    assert pf.verification.checked == 3 and not pf.verification.mismatches


@pytest.mark.parametrize("world,depth,transport", [(2, 1, "nccl"), (4, 2, "nccl"), (2, 0, "peer"),
                                                   (2, 1, "auto")])
def test_dcp_prefetch_over_gloo_holds_the_full_kv(tmp_path, world, depth, transport):
    from ringflow.testing.spawn import spawn_group
    spawn_group(world, _dcp_prefetch_rank, depth, transport, rendezvous=str(tmp_path / "rdzv"))


def test_an_unknown_dcp_transport_is_refused():
    from ringflow.integrations.torch.kv_prefetch import DcpGroup
    with pytest.raises(ConfigError, match="nccl, peer, auto"):
        DcpGroup(None, 2, 0, transport="nvls")


def test_micro_batches_get_lanes_of_their_own(monkeypatch):
    """DBO: two micro-batches run the same layers interleaved; each must own its ring."""
    from ringflow.integrations.vllm import attention
    from ringflow.integrations.vllm.state import PluginState
    from ringflow.orchestrator.profile import Profile
    profile = Profile.from_mapping({"kv_prefetch": {"depth": 1, "workspace_mib": 1}})
    layout = KVLayout("rows", (8,), torch.float32, 16)
    state = PluginState()
    lanes = attention.ModelLanes(state, 1, profile, layout, lambda c: c, _config(True),
                                 name="m")
    assert len(lanes.lanes) == 2
    rings = [(p.storage.data_ptr(), p.storage.data_ptr() + p.reserved_bytes)
             for p in (lane.pool for lane in lanes.lanes)]
    assert rings[0][1] <= rings[1][0] or rings[1][1] <= rings[0][0]  # no byte in common
    running = NS(ubatch=0)
    # what vLLM's dbo_current_ubatch_id says; ringflow's own lookup runs unchanged
    monkeypatch.setattr(state.steps, "ubatch", lambda: running.ubatch)
    layer = _MLALayer("m.0")                     # an attention layer the hook attached
    state.kv_layers[layer] = (lanes, 0)
    stacks = [_dbo_stack(seed) for seed in (0, 1)]
    for ubatch, stack in enumerate(stacks):      # micro-batch 1 starts while 0 is in flight
        running.ubatch = ubatch
        lane = lanes.lane()
        lane.plan(stack.layers)
        lane.begin(0, stack.source)
    for ubatch, stack in enumerate(stacks):
        running.ubatch = ubatch
        got = attention.gathered_kv(layer, state)
        want = ref.paged_gather_ref(stack.caches[0], stack.block_table, stack.context_lens,
                                    len(got))
        assert torch.equal(got, want), f"micro-batch {ubatch} read another one's KV"
        start, end = rings[ubatch]
        assert start <= got.data_ptr() and got.data_ptr() + got.nbytes <= end
    running.ubatch = 2
    assert lanes.lane() is None and attention.gathered_kv(layer, state) is None
    single = attention.ModelLanes(PluginState(), 2, profile, layout, lambda c: c,
                                  _config(False), name="s")
    assert len(single.lanes) == 1


def test_the_vllm_hooks_refuse_a_ring_once_the_kv_cache_is_sized():
    """ARCHITECTURE.md: 'buffers allocated lazily after the KV cache was sized' (an optimistic
    KV budget that later OOMs). The attention hook allocates when a layer is built; after the
    worker sized its KV cache, a new model's ring is an error, not a silent allocation."""
    from ringflow.integrations.vllm import attention
    from ringflow.integrations.vllm.state import PluginState
    from ringflow.orchestrator.profile import Profile
    profile = Profile.from_mapping({"kv_prefetch": {"depth": 1, "workspace_mib": 4}})
    config = _config(False)
    state = PluginState()
    state.new_model_load()
    state.kv_sized = True
    state.model_group.set(9001)
    with pytest.raises(LifecycleError, match="after the KV cache was sized"):
        attention.attach(state, _MLALayer("late.0"), profile, config)
    assert 9001 not in state.models
    state.new_model_load()                      # the next engine's load starts afresh
    first, second = _MLALayer("m.0"), _MLALayer("m.1")
    attention.attach(state, first, profile, config)
    attention.attach(state, second, profile, config)
    model = state.models[9001]
    assert model.names == ["m.0", "m.1"] and model.layout.unit == (32,)
    assert state.kv_layers[second] == (model, 1)


def test_a_workspace_resize_retires_the_step_and_replans_over_the_new_ring():
    stack = PagedAttentionStack(4, seed=8)
    stack.start([12, 40, 3])
    pf = _prefetcher(stack, 1)
    stack.refill(0)
    pf.begin(0, stack.source)                      # a step in flight holds slots of the old ring
    old = pf.pool
    with pytest.raises(BudgetError, match="smaller than one full-KV slot"):
        pf.resize(stack.capacity, 1024)            # too small: refused before anything is lost
    assert pf.pool is old and pf.stepper.in_forward
    pf.resize(2 * stack.capacity, 64 * MIB)
    assert pf.pool is not old and old.storage.numel() == 0      # the old ring is gone
    assert pf.gathered(0) is None and not pf.stepper.in_forward
    new_span = (pf.pool.storage.data_ptr(), pf.pool.storage.data_ptr() + pf.pool.reserved_bytes)
    seen = []
    for layer in range(1, 4):                      # the rest of the retired step: inert
        pf.begin(layer, stack.source)
        pf.end(layer)
    real_begin = pf.begin

    def begin(layer, sources):
        real_begin(layer, sources)
        seen.append(pf.gathered(layer).data_ptr())
    pf.begin = begin
    assert _next_step_matches_inline(stack, pf, exact=False)  # slots of 2x the rows now
    assert all(new_span[0] <= p < new_span[1] for p in seen)
    assert pf.capacity_tokens == 2 * stack.capacity and not pf.verification.mismatches


def test_a_step_cut_short_after_layer_0_does_not_leak_into_the_next():
    """An engine step that ends after layer 0 (an error, a dummy run): the next step's layer 0
    starts afresh with its own sources, not the old step's."""
    stack = PagedAttentionStack(3, seed=11)
    stack.start([9, 20, 4])
    pf = _prefetcher(stack, 1)
    stack.refill(0)
    pf.begin(0, stack.source)
    pf.end(0)                                        # ... and layer 1 never comes
    old = stack.caches
    stack.caches = [torch.randn_like(c) for c in old]
    for c in old:
        c.fill_(float("nan"))
    assert _next_step_matches_inline(stack, pf)
    assert not pf.verification.mismatches


def test_a_step_with_more_requests_than_the_ring_was_sized_for_is_skipped(caplog):
    stack = PagedAttentionStack(2, seed=12, requests=3)
    layout = KVLayout("rows", (stack.row,), stack.dtype, stack.block_size)
    pf = KVPrefetcher(layout, stack.capacity, max_requests=2, depth=1, workspace_bytes=MIB,
                      device="cpu")
    pf.plan(2)
    with caplog.at_level(logging.WARNING, "ringflow"):
        pf.begin(0, stack.source)
    assert pf.gathered(0) is None and "3 requests exceeds the 2" in caplog.text
    assert pf.skipped == {"requests": 1}


def test_an_engine_that_goes_back_mid_step_drops_the_step_without_raising(caplog):
    stack = PagedAttentionStack(4, seed=13)
    stack.start([5, 5, 5])
    pf = _prefetcher(stack, 1)
    stack.refill(0)
    for layer in (0, 1, 2):
        pf.begin(layer, stack.source)
        pf.end(layer)
    with caplog.at_level(logging.WARNING, "ringflow"):
        pf.begin(1, stack.source)                    # back to layer 1: not a new step
    assert "layer 1 came after layer 2" in caplog.text
    assert pf.gathered(1) is None and pf.pool.free_count == pf.pool.slots
    pf.end(1)
    assert _next_step_matches_inline(stack, pf)
