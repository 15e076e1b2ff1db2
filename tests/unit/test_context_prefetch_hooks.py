"""MLA context prefetch without vLLM: what each layer's attention reads from the workspace is
exactly what vLLM's own gather would have put there, whether it came from a slot or not.

vLLM's objects are the stand-ins of ``helpers/vllm_fakes.py``; ringflow's are driven through
the hooks vLLM calls (``context_hooks``) or a layer's session (``context_session``)."""

import functools
import logging
from types import SimpleNamespace

import pytest
import torch

from ringflow.integrations.vllm import context_attach, context_hooks, dcp
from ringflow.integrations.vllm.context_ring import ContextModel, one_rank_left_to_vllm
from ringflow.integrations.vllm.context_session import SESSION, Session, SessionMode
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.profile import Profile

from helpers.rings import ProcessRings, ThreadRings
from helpers.vllm_fakes import (FakeCoordinator, FakeDcpManager, FakeMLAImpl, FakeMLALayer,
                                fake_gather, mla_layers, mla_metadata, vllm_config,
                                vllm_mla_impl)
from helpers.vllm_required import require_vllm

ROWS, W, BLOCKS, BLOCK = 16, 4, 6, 4
#: (block table, tokens) of each context chunk of a step
CHUNKS = [([0, 1], 7), ([3, 5, 2], 10)]
RECORD, CONSUME, PASS = SessionMode.RECORD, SessionMode.CONSUME, SessionMode.PASS


def make_model(verify=False, layers=3, seed=0, min_context=0):
    spec = {"depth": 1, "workspace_mib": 1, "verify": verify}
    if min_context is not None:  # None: the profile omits it (auto)
        spec["min_context_tokens"] = min_context
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": spec})
    model = ContextModel(PluginState(), key=1, profile=profile, shape=(ROWS, W),
                         dtype=torch.float32, device=torch.device("cpu"), name="t")
    fakes = mla_layers(layers, BLOCKS, BLOCK, W, seed=seed)
    for layer in fakes:
        model.add_layer(layer)
    return model, fakes  # the caller keeps the layers alive


def metadata(chunks=CHUNKS):
    """One step's attention metadata and its per-chunk gather arguments (made once)."""
    md = mla_metadata(torch.empty(ROWS, W))
    args = [(torch.tensor(table), torch.tensor([0, toks]), toks) for table, toks in chunks]
    return md, args


def want(layer, table, toks):
    return layer.kv_cache[table].reshape(-1, W)[:toks]


def run_layer(model, index, layer, md, chunk_args):
    """One layer's context attention as vLLM runs it; returns its session and its reads."""
    ws = md.prefill.chunked_context.workspace
    ptr = ws.data_ptr()
    session = Session(model, index, md)
    token = SESSION.set(session)
    reads = []
    try:
        for table, cu, toks in chunk_args:
            dst = md.prefill.chunked_context.workspace[:toks]  # sliced after the last call
            session.gather("fake_gather", fake_gather, dict(
                src_cache=layer.kv_cache, dst=dst, block_table=table, cu_seq_lens=cu))
            reads.append(md.prefill.chunked_context.workspace[:toks].clone())
    finally:
        SESSION.reset(token)
    session.close(failed=False)
    assert ws.data_ptr() == ptr and md.prefill.chunked_context.workspace is ws
    return session, reads


def run_step(model, fakes, md, args, per_layer=None):
    per_layer = per_layer or {}
    modes = []
    for i, layer in enumerate(fakes):
        chunk_args = per_layer.get(i, args)
        session, reads = run_layer(model, i, layer, md, chunk_args)
        modes.append(session.mode)
        for (table, _, toks), got in zip(chunk_args, reads):
            assert torch.equal(got, want(layer, table, toks)), (i, toks)
    return modes


def test_layer_0_records_and_the_others_read_their_rows_from_the_ring():
    model, fakes = make_model()
    for step in (1, 2):  # the second step replays its own recording through the cached plan
        md, args = metadata()
        assert run_step(model, fakes, md, args) == [RECORD, CONSUME, CONSUME]
        assert len(model.calls) == 2 and [c.rows for c in model.calls] == [7, 10]
        assert model.ring.consumed == 4 * step and model.ring.steps == step
        assert not model.ring.in_step and model.ring.pool.leases() == []
    assert model.ring.abandoned == {}


def test_a_step_below_min_context_tokens_is_left_to_vllm_and_said_once(caplog):
    """Note [Short context]: the step's context (7 + 10 rows) against the threshold."""
    model, fakes = make_model(min_context=18)
    with caplog.at_level(logging.INFO, logger="ringflow"):
        for _ in range(2):
            md, args = metadata()
            assert run_step(model, fakes, md, args) == [RECORD, PASS, PASS]
    assert model.ring.steps == model.ring.consumed == 0 and model.short_steps == 2
    assert model.ring.abandoned == {} and model.calls == []
    said = [r.getMessage() for r in caplog.records if "min_context_tokens" in r.getMessage()]
    assert len(said) == 1 and "17 context token" in said[0], said
    model, fakes = make_model(min_context=17)  # at the threshold: prefetched
    md, args = metadata()
    assert run_step(model, fakes, md, args) == [RECORD, CONSUME, CONSUME]
    assert model.ring.consumed == 4 and model.short_steps == 0


@pytest.mark.parametrize("style", ["0.26", "0.32"])
def test_the_threshold_counts_vllms_context_tokens_not_the_workspace_its_gathers_are_given(
        style):
    """vLLM's CUDA gathers are handed the whole workspace (``dst=workspace``, the length in
    ``num_tokens``): the step's count comes from the chunk metadata (0.26 ``seq_tot``, 0.32
    each chunk's ``num_context_tokens``), 17 here, not 2 chunks x 16 rows."""
    for threshold, modes in ((18, [RECORD, PASS, PASS]),
                             (17, [RECORD, CONSUME, CONSUME])):
        model, fakes = make_model(min_context=threshold)
        md, args = metadata()
        chunked = md.prefill.chunked_context
        if style == "0.26":
            chunked.seq_tot = [toks for _, _, toks in args]
        else:
            chunked.chunks = [SimpleNamespace(num_context_tokens=toks) for _, _, toks in args]
        whole = [(table, cu, ROWS) for table, cu, _ in args]  # dst: the whole workspace
        got = []
        for i, layer in enumerate(fakes):
            session, reads = run_layer(model, i, layer, md, whole)
            got.append(session.mode)
            for (table, _, toks), read in zip(args, reads):
                assert torch.equal(read[:toks], want(layer, table, toks)), (i, toks)
        assert got == modes, (threshold, got)
        assert model.short_steps == (threshold == 18)


def test_min_context_tokens_omitted_leaves_one_gpu_to_vllm_in_one_line_and_dcp_prefetches(
        caplog):
    """Note [Short context]: on one rank the omitted threshold attaches no layer and reserves
    nothing (one line, once); under DCP it is 0; a threshold set is kept on one rank."""
    state = PluginState()
    impl = SimpleNamespace(_compute_prefill_context=lambda *a: None)
    layer = SimpleNamespace(kv_lora_rank=W, kv_cache_dtype="auto", impl=impl)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                                             enable_dbo=False))
    omitted = Profile.from_mapping({"name": "t", "kv_prefetch": {"workspace_mib": 1}})
    with caplog.at_level(logging.INFO, logger="ringflow"):
        for _ in range(3):  # three MLA layers built
            assert context_attach.attach(state, layer, omitted, config) is False
    said = [r.getMessage() for r in caplog.records if "without decode context parallelism (one rank)" in r.getMessage()]
    assert len(said) == 1 and "reserves nothing" in said[0] and "min_context_tokens" in said[0]
    assert state.context_models == {} and state.ring_bytes() == 0
    assert one_rank_left_to_vllm(omitted.kv_prefetch, 1)
    assert not one_rank_left_to_vllm(omitted.kv_prefetch, 2)
    zero = Profile.from_mapping({"name": "t", "kv_prefetch": {"workspace_mib": 1,
                                                              "min_context_tokens": 0}})
    assert not one_rank_left_to_vllm(zero.kv_prefetch, 1)
    dcp_model, _ = make_dcp_model()
    assert dcp_model.min_context == 0


def test_another_chunking_in_a_later_layer_falls_back_to_vllms_own_gather(caplog):
    model, fakes = make_model(seed=1)
    md, args = metadata()
    run_step(model, fakes, md, args)
    md, args = metadata()
    other = [(torch.tensor([4, 1]), torch.tensor([0, 6]), 6), args[1]]
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        modes = run_step(model, fakes, md, args, per_layer={2: other})
    assert modes == [RECORD, CONSUME, PASS]
    assert len(model.ring.abandoned) == 1 and list(model.ring.abandoned.values()) == [1]
    (reason,) = model.ring.abandoned
    assert "layer 2" in reason
    named = [r for r in caplog.records if reason in r.getMessage()]
    assert len(named) == 1 and named[0].levelno == logging.WARNING
    assert not model.ring.in_step and model.ring.pool.leases() == []
    md, args = metadata()  # the next step is prefetched again
    assert run_step(model, fakes, md, args) == [RECORD, CONSUME, CONSUME]


def test_verify_checks_every_consumed_chunk_and_catches_a_corrupt_slot(monkeypatch):
    model, fakes = make_model(verify=True, seed=2)
    md, args = metadata()
    run_step(model, fakes, md, args)
    assert model.checked == model.ring.consumed == 4 and model.mismatches == []
    real = model.fill

    def corrupt(unit_layer, chunk, slot):
        real(unit_layer, chunk, slot)
        slot.add_(1)

    monkeypatch.setattr(model, "fill", corrupt)
    md, args = metadata()
    for i, layer in enumerate(fakes):  # the reads are the corrupt slot's: only verify sees it
        run_layer(model, i, layer, md, args)
    assert model.checked == 8 and len(model.mismatches) == 4
    assert "layer 1 chunk 0" in model.mismatches[0]


def test_a_layer_of_another_step_than_the_recorded_one_passes_through():
    model, fakes = make_model(seed=3)
    md, args = metadata()
    run_layer(model, 0, fakes[0], md, args)
    assert model.ring.in_step
    other_md, other_args = metadata()
    session, reads = run_layer(model, 1, fakes[1], other_md, other_args)
    assert session.mode is PASS and model.ring.consumed == 0
    for (table, _, toks), got in zip(other_args, reads):
        assert torch.equal(got, want(fakes[1], table, toks))


def test_the_gather_hook_binds_positional_calls_into_the_session_and_is_inert_without_one():
    model, fakes = make_model(seed=4)
    md, args = metadata()
    hook = context_hooks.gather_hook("fake_gather")
    out = torch.empty(ROWS, W)
    table, cu, toks = args[0]
    hook(model.state, fake_gather, fakes[0].kv_cache, out, table, cu)  # no session: vLLM's op
    assert torch.equal(out[:toks], want(fakes[0], table, toks))
    session = Session(model, 0, md)
    token = SESSION.set(session)
    try:
        ws = md.prefill.chunked_context.workspace
        hook(model.state, fake_gather, fakes[0].kv_cache, ws[:toks], table, cu_seq_lens=cu)
    finally:
        SESSION.reset(token)
    (call,) = model.calls
    assert session.calls == 1 and set(call.args) == {"block_table", "cu_seq_lens"}
    assert call.args["block_table"] is table and call.args["cu_seq_lens"] is cu
    assert torch.equal(ws[:toks], want(fakes[0], table, toks))


def test_the_session_mode_is_typed():
    """A session's mode is a :class:`SessionMode`, never a bare string."""
    model, fakes = make_model(seed=4)
    md, args = metadata()
    session, _ = run_layer(model, 0, fakes[0], md, args)
    assert isinstance(session.mode, SessionMode) and session.mode is RECORD
    assert {m.value for m in SessionMode} == {"record", "consume", "pass"}


# -- under DCP (Note [DCP context exchange]) ----------------------------------------------------

#: a DCP group of two: the workspace is 1/2 larger (vLLM's layout), local chunks of <= 8 rows
DCP, DCP_ROWS = 2, ROWS + ROWS // 2
DCP_CHUNKS = [([0, 1], 7), ([3, 5], 5)]


def peer_rows(local):
    """The other rank's rows of a chunk, in a one-process test: a function of this rank's."""
    return local * -2.0 + 0.5


def exchanged(local, peer=peer_rows):
    return torch.cat([local, peer(local)])


def make_dcp_model(verify=False, layers=3, seed=0, exchange=None):
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {
        "depth": 1, "workspace_mib": 1, "verify": verify}})

    def fill_exchange(gathered, local):
        gathered.copy_(exchanged(local))

    model = ContextModel(PluginState(), key=1, profile=profile, shape=(DCP_ROWS, W),
                         dtype=torch.float32, device=torch.device("cpu"), name="t",
                         dcp_size=DCP, exchange=exchange or fill_exchange)
    fakes = mla_layers(layers, BLOCKS, BLOCK, W, seed=seed, dcp=True)
    for layer in fakes:
        model.add_layer(layer)
    return model, fakes


def dcp_metadata(chunks=DCP_CHUNKS):
    md = mla_metadata(torch.empty(DCP_ROWS, W))
    args = [(torch.tensor(table), torch.tensor([0, toks]), toks) for table, toks in chunks]
    return md, args


def vllm_dcp_context(impl, q, cache, md, k_scale, dcp_world_size, *, state, layer, chunk_args,
                     style, coordinator, reads, shift=0):
    """vLLM's ``_context_parallel_compute_prefill_context`` as it touches the workspace: the
    local gather (through ringflow's op hook), the exchange (0.26: ``all_gather`` and a copy;
    0.32: ``kv_gather``), then the gathered rows are read. ``shift``: the gathered rows start
    that many rows later than vLLM's layout puts them (another vLLM)."""
    gather = context_hooks.gather_hook("fake_gather")
    for table, cu, toks in chunk_args:
        gather(state, fake_gather, src_cache=layer.kv_cache,
               dst=md.prefill.chunked_context.workspace, block_table=table, cu_seq_lens=cu)
        ws = md.prefill.chunked_context.workspace
        offset = ws.shape[0] // (dcp_world_size + 1) + shift
        local, gathered = ws[:toks], ws[offset: offset + toks * dcp_world_size]
        if style == "0.26":
            gathered.copy_(coordinator.all_gather(local, dim=0))
        else:  # 0.32 reads its manager from the step's metadata
            md.prefill.chunked_context.dcp_manager.kv_gather(gathered, local)
        reads.append(gathered.clone())


def run_dcp_step(model, fakes, md, args, style, monkeypatch, per_layer=None, shifted=()):
    """One step of every layer under DCP through ringflow's session hook; returns the modes,
    the exchanges vLLM itself ran, and checks every read against vLLM's own result
    (``shifted``: the layers whose vLLM lays the gathered rows out one row later)."""
    coordinator, manager = FakeCoordinator(exchanged), FakeDcpManager(exchanged)
    monkeypatch.setattr(context_hooks, "dcp_coordinator", lambda: coordinator)
    modes = []
    md.prefill.chunked_context.dcp_manager = manager if style == "0.32" else None
    for i, layer in enumerate(fakes):
        chunk_args = (per_layer or {}).get(i, args)
        reads = []
        original = functools.partial(vllm_dcp_context, state=model.state, layer=layer,
                                     chunk_args=chunk_args, style=style,
                                     coordinator=coordinator, reads=reads,
                                     shift=int(i in shifted))
        sessions = []
        real_session = context_hooks.Session

        def remember(*a, **k):
            sessions.append(real_session(*a, **k))
            return sessions[-1]

        monkeypatch.setattr(context_hooks, "Session", remember)
        context_hooks.on_dcp_prefill_context(model.state, original, layer.impl, torch.zeros(1),
                                             None, md, None, dcp_world_size=DCP)
        monkeypatch.setattr(context_hooks, "Session", real_session)
        modes.append(sessions[0].mode)
        assert "all_gather" not in vars(coordinator) and "kv_gather" not in vars(manager)
        for (table, _, toks), got in zip(chunk_args, reads):
            assert torch.equal(got, exchanged(want(layer, table, toks))), (i, toks)
    return modes, coordinator.calls + manager.calls


@pytest.mark.parametrize("style", ["0.26", "0.32"])
def test_under_dcp_the_exchange_is_prefetched_with_the_gather_and_vllms_own_is_skipped(
        style, monkeypatch):
    model, fakes = make_dcp_model(seed=5)
    for step in (1, 2):
        md, args = dcp_metadata()
        modes, vllm_exchanges = run_dcp_step(model, fakes, md, args, style, monkeypatch)
        assert modes == [RECORD, CONSUME, CONSUME]
        assert vllm_exchanges == len(DCP_CHUNKS)  # the recording layer's only
        assert [c.exchange.kind for c in model.calls] == [
            "all_gather" if style == "0.26" else "kv_gather"] * 2
        assert [c.exchange.target for c in model.calls] == [(8, 14), (8, 10)]
        assert model.ring.consumed == 4 * step and model.ring.abandoned == {}
        assert not model.ring.in_step and model.ring.pool.leases() == []


def test_under_dcp_a_corrupt_exchange_is_read_by_attention_and_caught_by_verify(monkeypatch):
    """The consuming layers read the slot's exchanged rows, not vLLM's: an exchange that
    brings other rows changes what they read, and verify names every such chunk."""
    def wrong(gathered, local):
        gathered.copy_(exchanged(local, peer=lambda x: x + 1.0))

    model, fakes = make_dcp_model(verify=True, seed=6, exchange=wrong)
    md, args = dcp_metadata()
    with pytest.raises(AssertionError):  # the reads are the corrupt rows
        run_dcp_step(model, fakes, md, args, "0.26", monkeypatch)
    model, fakes = make_dcp_model(verify=True, seed=6, exchange=wrong)
    md, args = dcp_metadata()
    coordinator = FakeCoordinator(exchanged)
    monkeypatch.setattr(context_hooks, "dcp_coordinator", lambda: coordinator)
    for layer in fakes:
        context_hooks.on_dcp_prefill_context(
            model.state, functools.partial(vllm_dcp_context, state=model.state, layer=layer,
                                           chunk_args=args, style="0.26",
                                           coordinator=coordinator, reads=[]),
            layer.impl, torch.zeros(1), None, md, None, dcp_world_size=DCP)
    exchanges = [m for m in model.mismatches if "DCP exchange" in m]
    assert len(exchanges) == 4 and "layer 1 chunk 0" in exchanges[0]
    assert len(model.mismatches) == 4  # the local gathers themselves were right


def test_under_dcp_another_exchange_falls_back_to_vllms_own_and_reads_stay_right(
        monkeypatch, caplog):
    model, fakes = make_dcp_model(seed=7)
    md, args = dcp_metadata()
    run_dcp_step(model, fakes, md, args, "0.32", monkeypatch)
    md, args = dcp_metadata()
    with caplog.at_level(logging.WARNING, logger="ringflow"):  # layer 2's exchange fills other rows
        modes, vllm_exchanges = run_dcp_step(model, fakes, md, args, "0.32", monkeypatch,
                                             shifted={2})
    assert modes == [RECORD, CONSUME, PASS]
    assert vllm_exchanges == 2 + 2  # layer 0 records both chunks, layer 2 runs both itself
    (reason,) = model.ring.abandoned
    assert "layer 2's DCP exchange 0" in reason
    assert any(reason in r.getMessage() for r in caplog.records)
    assert not model.ring.in_step and model.ring.pool.leases() == []


def test_a_layer_that_raises_under_dcp_leaves_vllms_objects_and_the_session_as_they_were(
        monkeypatch):
    model, fakes = make_dcp_model(seed=9)
    md, args = dcp_metadata()
    run_dcp_step(model, fakes, md, args, "0.32", monkeypatch)
    coordinator, manager = FakeCoordinator(exchanged), FakeDcpManager(exchanged)
    monkeypatch.setattr(context_hooks, "dcp_coordinator", lambda: coordinator)
    md, args = dcp_metadata()
    md.prefill.chunked_context.dcp_manager = manager

    def raising(impl, *a, layer, **k):
        vllm_dcp_context(impl, *a, state=model.state, layer=layer, chunk_args=args,
                         style="0.32", coordinator=coordinator, reads=[], **k)
        raise RuntimeError("the layer's attention failed")

    ws = md.prefill.chunked_context.workspace
    context_hooks.on_dcp_prefill_context(  # layer 0 records and starts the step's plan
        model.state, functools.partial(vllm_dcp_context, state=model.state, layer=fakes[0],
                                       chunk_args=args, style="0.32", coordinator=coordinator,
                                       reads=[]),
        fakes[0].impl, torch.zeros(1), None, md, None, dcp_world_size=DCP)
    assert model.ring.in_step
    with pytest.raises(RuntimeError):  # layer 1 consumes, then raises
        context_hooks.on_dcp_prefill_context(model.state, functools.partial(raising,
                                                                            layer=fakes[1]),
                                             fakes[1].impl, torch.zeros(1), None, md, None,
                                             dcp_world_size=DCP)
    assert "kv_gather" not in vars(manager) and "all_gather" not in vars(coordinator)
    assert SESSION.get() is None and md.prefill.chunked_context.workspace is ws
    assert ws.untyped_storage().data_ptr() != model.ring.pool.storage.untyped_storage().data_ptr()
    assert list(model.ring.abandoned) == ["a layer's context attention raised"]
    assert not model.ring.in_step and model.ring.pool.leases() == []


def test_a_dcp_recording_without_an_exchange_plans_nothing(caplog):
    """A vLLM whose DCP path gathers without the exchange ringflow hooks: nothing is planned,
    said once, and every layer gathers for itself."""
    model, fakes = make_dcp_model(seed=8)
    md, args = dcp_metadata()
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        for i, layer in enumerate(fakes):
            session = Session(model, i, md, dcp=True)
            token = SESSION.set(session)
            try:
                context_hooks.gather_hook("fake_gather")(
                    model.state, fake_gather, src_cache=layer.kv_cache,
                    dst=md.prefill.chunked_context.workspace, block_table=args[0][0],
                    cu_seq_lens=args[0][1])
            finally:
                SESSION.reset(token)
            session.close(failed=False)
            assert session.mode is PASS
    assert model.ring.steps == 0 and model.calls == []
    assert sum("without the exchange" in r.getMessage() for r in caplog.records) == 1


def test_a_dcp_model_needs_its_exchange():
    from ringflow.errors import ConfigError
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {"workspace_mib": 1}})
    with pytest.raises(ConfigError, match="needs an exchange"):
        ContextModel(PluginState(), 1, profile, (DCP_ROWS, W), torch.float32,
                     torch.device("cpu"), "t", dcp_size=2)


def world_exchanged(local):
    """Every rank's ``local`` over the world group (vLLM's own, in the gloo test)."""
    import torch.distributed as dist
    out = torch.empty(local.shape[0] * dist.get_world_size(), *local.shape[1:])
    dist.all_gather_into_tensor(out, local.contiguous())
    return out


def dcp_rows(world):
    return 6 * world + 6  # vLLM's: 6 rows per rank, and the local gather's 6 before them


def _dcp_rank(rank, world, steps, style, rings=None, depth=1, slow_rank=None):
    """One rank: its own caches, ringflow's fills all-gathered over a group of ringflow's own
    (``rings``: by the copy-engine transport's pulls from every rank's ring, in shared memory
    here); every consuming layer must read every rank's rows, rank after rank."""
    import torch.distributed as dist

    from ringflow.kernels.kv_gathers import all_gather_parts
    from ringflow.kernels.peer_exchange import PeerExchange
    own = dist.new_group(list(range(world)), backend="gloo")
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {"depth": depth,
                                                                "workspace_mib": 1}})
    rows = dcp_rows(world)
    if rings is None:
        handle, storage = None, None
        exchange = lambda gathered, local: all_gather_parts(gathered, local, own)  # noqa: E731
    else:
        handle, storage = ProcessRings(rings, own, slow=rank == slow_rank), rings[rank]
        exchange = PeerExchange(storage, handle, world, rank).gather_parts
    model = ContextModel(PluginState(), 1, profile, (rows, W), torch.float32,
                         torch.device("cpu"), "t", dcp_size=world, exchange=exchange,
                         storage=storage)
    assert storage is None or model.ring.pool.storage is storage
    caches = [[torch.randn(BLOCKS, BLOCK, W, generator=torch.Generator().manual_seed(100 * r + i))
               for i in range(3)] for r in range(world)]  # every rank's, to know the answer
    fakes = [FakeMLALayer(caches[rank][i], torch.tensor(1.0), FakeMLAImpl(dcp=True))
             for i in range(3)]
    for layer in fakes:
        model.add_layer(layer)
    coordinator = FakeCoordinator(world_exchanged)
    manager = FakeDcpManager(world_exchanged)
    context_hooks.dcp_coordinator = lambda: coordinator  # this rank's process only
    chunks = [([0, 1], 6), ([3, 5], 5)]
    for _ in range(steps):
        md = mla_metadata(torch.empty(rows, W),
                          dcp_manager=manager if style == "0.32" else None)
        args = [(torch.tensor(table), torch.tensor([0, toks]), toks) for table, toks in chunks]
        for i, layer in enumerate(fakes):
            reads = []
            context_hooks.on_dcp_prefill_context(
                model.state, functools.partial(vllm_dcp_context, state=model.state, layer=layer,
                                               chunk_args=args, style=style,
                                               coordinator=coordinator, reads=reads),
                layer.impl, torch.zeros(1), None, md, None, dcp_world_size=world)
            for (table, _, toks), got in zip(args, reads):
                expected = torch.cat([caches[r][i][table].reshape(-1, W)[:toks]
                                      for r in range(world)])
                assert torch.equal(got, expected), (rank, i, toks)
    # layer 0's only: the others were prefetched
    assert coordinator.calls + manager.calls == steps * len(chunks)
    assert model.ring.consumed == steps * 2 * len(chunks) and model.ring.abandoned == {}
    if handle is not None:  # two barriers per fill: after the owners' writes, after the pulls
        assert handle.barriers == 2 * model.ring.consumed


@pytest.mark.parametrize("world,style", [(2, "0.26"), (3, "0.26"), (2, "0.32")])
def test_under_dcp_the_fills_all_gather_across_real_ranks_in_vllms_order(tmp_path, world,
                                                                          style):
    """Real collectives (gloo): each rank's fills all-gather over ringflow's own group while
    'vLLM' all-gathers over the world, and every consuming layer reads every rank's rows."""
    from ringflow.testing.spawn import spawn_group
    spawn_group(world, _dcp_rank, 2, style, rendezvous=str(tmp_path / "rdzv"))


@pytest.mark.parametrize("world,style", [(2, "0.26"), (3, "0.32")])
def test_under_dcp_the_peer_transport_pulls_every_ranks_rows_in_vllms_order(tmp_path, world,
                                                                           style):
    """The copy-engine transport (dcp_transport: peer): each rank's ring is one every rank
    maps; a fill writes the local rows into the slot, then copies every rank's from the same
    rows of that rank's slot. Rings start as NaN, so a pull before its owner wrote fails."""
    from ringflow.testing.spawn import spawn_group
    rings = [torch.full((2, dcp_rows(world), W), float("nan")).share_memory_()
             for _ in range(world)]
    spawn_group(world, _dcp_rank, 2, style, rings, rendezvous=str(tmp_path / "rdzv"))


def test_no_rank_refills_a_slot_a_slower_peer_still_pulls_from(tmp_path):
    """The second barrier (Note [Peer exchange]): one slot (depth 0), so each fill writes its
    local rows where the last unit's were; rank 1 is 0.2 s late after every barrier. Without
    the barrier after the pulls (or with it before them), rank 0 would have refilled its slot
    with the next unit's rows and rank 1 would read those."""
    from ringflow.testing.spawn import spawn_group
    rings = [torch.full((1, dcp_rows(2), W), float("nan")).share_memory_() for _ in range(2)]
    spawn_group(2, _dcp_rank, 1, "0.26", rings, 0, 1, rendezvous=str(tmp_path / "rdzv"))


def test_a_peer_all_gather_lays_ranks_out_as_vllms_all_gather_and_checks_its_shapes():
    """PeerExchange.gather_parts with threads for ranks (the kv_gathers tests' stand-in): the
    result is every rank's local rows, rank after rank, in the slot's gathered rows; the other
    slot is untouched; a target of the wrong size is refused before any copy."""
    from concurrent.futures import ThreadPoolExecutor

    from ringflow.errors import KernelError
    from ringflow.kernels.peer_exchange import PeerExchange

    world, rows = 3, 5
    rings = [torch.full((2, rows + rows * world, W), float("nan")) for _ in range(world)]
    handle = ThreadRings(rings)
    mine = [torch.randn(rows, W, generator=torch.Generator().manual_seed(r)) for r in range(world)]

    def rank(r):
        slot = rings[r][1]
        slot[:rows] = mine[r]
        PeerExchange(rings[r], handle, world, r).gather_parts(slot[rows:], slot[:rows])
        return slot[rows:].clone()

    with ThreadPoolExecutor(world) as pool:
        outs = list(pool.map(rank, range(world)))
    for r, out in enumerate(outs):
        assert torch.equal(out, torch.cat(mine)), r
    assert handle.barriers == 2 * world
    assert torch.isnan(torch.stack(rings)[:, 0]).all()
    exchange = PeerExchange(rings[0], ThreadRings([rings[0]] * world), world, 0)
    before = rings[0].clone()
    with pytest.raises(KernelError, match="fills 15 contiguous rows"):
        exchange.gather_parts(rings[0][1][rows: rows + 10], rings[0][1][:rows])
    assert torch.equal(rings[0].nan_to_num(7), before.nan_to_num(7))


def test_under_dcp_the_ring_is_shaped_as_vllms_enlarged_workspace_and_mla_has_a_consumer(
        monkeypatch):
    """vLLM enlarges the DCP workspace by 1/size (the local gather's rows); a slot of the
    plain size would not fit and the consumer would stay off. MLA under DCP has a consumer
    wherever the impl has vLLM's DCP context method."""
    require_vllm()
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
    monkeypatch.setattr(MLACommonMetadataBuilder, "determine_chunked_prefill_workspace_size",
                        staticmethod(lambda config: 64))

    layer = FakeMLALayer(impl=FakeMLAImpl(dcp=True), kv_lora_rank=512, qk_rope_head_dim=64)
    config = vllm_config(dcp_size=2)
    assert context_attach.workspace_shape(layer, config) == (96, 576)
    assert context_attach.no_consumer(layer, config) is None
    layer.impl = FakeMLAImpl(dcp=False)
    assert "no MLA context chunk loop" in context_attach.no_consumer(layer, config)
    config.parallel_config.decode_context_parallel_size = 1
    assert context_attach.workspace_shape(layer, config) == (64, 576)
    assert context_attach.no_consumer(layer, config) is None


def test_vllms_own_dcp_context_method_reads_the_prefetched_exchange(monkeypatch):
    """The installed vLLM's ``_context_parallel_compute_prefill_context`` itself (0.32: the
    manager on the step's metadata, ``cp_gather_cache`` into ``workspace[:toks]``, its own
    reorder and up-projection), run through ringflow's hook for three layers, a stand-in for
    the paged gather and for a DCP group of two: the attention output of every layer is what
    vLLM's own gathers give, and vLLM's exchange runs only in the recording layer."""
    require_vllm()
    from vllm import _custom_ops
    from vllm.model_executor.layers.attention import mla_attention

    from ringflow.integrations.vllm.hooks import wrap, wrap_function
    if "chunks" not in mla_attention.MLACommonBaseImpl._context_parallel_compute_prefill_context\
            .__code__.co_names:  # pragma: no cover - another release's chunk loop
        pytest.skip("this vLLM's DCP context loop is not 0.32's")
    rank_rows, lora, rope, heads, nope, v_dim = 6, 8, 4, 2, 3, 5
    width = lora + rope

    def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts):
        for r in range(batch_size):
            n = int(cu_seq_lens[r + 1] - cu_seq_lens[r])
            rows = src_cache[block_table[r]].reshape(-1, width)
            dst[int(cu_seq_lens[r]): int(cu_seq_lens[r]) + n] = rows[int(seq_starts[r]):][:n]

    state = PluginState()
    monkeypatch.setattr(_custom_ops, "cp_gather_cache", cp_gather_cache, raising=False)
    wrap_function(_custom_ops, "cp_gather_cache", context_hooks.gather_hook("cp_gather_cache"),
                  state)
    original = mla_attention.MLACommonBaseImpl._context_parallel_compute_prefill_context
    monkeypatch.setattr(mla_attention.MLACommonBaseImpl,
                        "_context_parallel_compute_prefill_context", original)
    wrap(mla_attention.MLACommonBaseImpl, "_context_parallel_compute_prefill_context",
         context_hooks.on_dcp_prefill_context, state)
    monkeypatch.setattr(context_hooks, "dcp_coordinator", lambda: None)

    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {"depth": 1, "workspace_mib": 1}})
    rows = rank_rows * DCP + rank_rows
    model = ContextModel(state, 1, profile, (rows, width), torch.float32,
                         torch.device("cpu"), "t", dcp_size=DCP,
                         exchange=lambda gathered, local: gathered.copy_(exchanged(local)))
    g = torch.Generator().manual_seed(12)

    class KvBProj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(heads * (nope + v_dim), lora,
                                                         generator=g))

        def forward(self, x):
            return (x @ self.weight.T,)

    class Backend:
        def run_prefill_context_chunk(self, chunk, q, k, v):  # depends on every key and value
            return (q.sum() * k.sum(0, keepdim=True)[:, :, :v_dim] + v.sum(0, keepdim=True)
                    ).expand(q.shape[0], -1, -1).contiguous(), k.sum(-1).sum(0)

    layers, caches = [], []
    for _ in range(3):
        impl = vllm_mla_impl(kv_cache_dtype="auto", kv_lora_rank=lora, qk_rope_head_dim=rope,
                             num_heads=heads, qk_nope_head_dim=nope, v_head_dim=v_dim,
                             kv_b_proj=KvBProj(), _use_flashinfer_concat_mla_k=False)
        caches.append(torch.randn(BLOCKS, BLOCK, width, generator=g))
        layers.append(FakeMLALayer(caches[-1], None, impl))
        model.add_layer(layers[-1])
    manager = FakeDcpManager(exchanged)
    chunk = SimpleNamespace(
        padded_local_seq_lens=[5], local_context_lens_allranks=[[5, 5]],
        padded_local_cu_seq_lens=torch.tensor([0, 5]),
        padded_local_token_to_seq=torch.zeros(5, dtype=torch.int32),
        local_starts=[0], num_local_context_tokens=5, request_slice=slice(0, 1),
        num_requests=1, starts=torch.tensor([0]), num_context_tokens=10, max_seq_len=10,
        token_slice=slice(0, 3))
    md = mla_metadata(torch.empty(rows, width), chunks=[chunk], dcp_manager=manager,
                      empty_token_slices=[],
                      prefill=dict(prefill_backend=Backend(), q_data_type=torch.float32,
                                   block_table=torch.tensor([[3, 1]])),
                      metadata=dict(num_prefills=1))
    q = torch.randn(3, heads, nope + rope, generator=g)

    def step(on):
        model.enabled = on
        return [mla_attention.MLACommonBaseImpl._context_parallel_compute_prefill_context(
            layer.impl, q, cache, md, None, dcp_world_size=DCP)
            for layer, cache in zip(layers, caches)]

    off = step(False)
    assert manager.calls == 3
    for _ in range(2):
        manager.calls = 0
        on = step(True)
        assert manager.calls == 1  # the recording layer's own; the others read the slot
        for (o, lse), (want_o, want_lse) in zip(on, off):
            assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert model.ring.consumed == 4 and model.ring.abandoned == {}
    assert [c.exchange.kind for c in model.calls] == ["kv_gather"]


@pytest.mark.parametrize("transport,symmetric,chosen", [
    ("nccl", "works", "nccl"), ("peer", "works", "peer"), ("auto", "works", "peer"),
    ("auto", "fails", "nccl"), ("peer", "fails", "nccl")])
def test_the_dcp_exchange_is_the_copy_engines_where_symmetric_memory_works(
        monkeypatch, caplog, transport, symmetric, chosen):
    """``dcp.dcp_exchange`` (CUDA only, so stood in for here): peer and auto take a ring in
    symmetric memory of the pool's own shape, nccl never asks for one, a failure falls back to
    NCCL with a warning; a budget short of one slot is the profile's error."""
    from ringflow.errors import KernelError, ProfileError
    from ringflow.integrations.torch import kv_prefetch

    group = SimpleNamespace(size=2, group=object())
    monkeypatch.setattr(dcp, "dcp_group", lambda config, transport, who: group)
    asked = []

    def allocate(shape, dtype, device, g):
        asked.append(shape)
        if symmetric == "fails":
            raise KernelError("no symmetric memory here")
        return SimpleNamespace(storage=torch.empty(shape), gather_parts=lambda g, loc: None)

    monkeypatch.setattr(kv_prefetch, "symmetric_exchange", allocate)
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {
        "depth": 1, "workspace_mib": 1, "dcp_transport": transport}})
    shape = (DCP_ROWS, W)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        exchange, got, storage = dcp.dcp_exchange(profile, None, shape, torch.float32,
                                                  torch.device("cuda", 0))
    assert got == chosen and callable(exchange)
    assert asked == ([] if transport == "nccl" else [(2, *shape)])
    assert (storage is not None) == (chosen == "peer")
    warned = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warned) == (symmetric == "fails")
    tight = Profile.from_mapping({"name": "t", "kv_prefetch": {
        "depth": 1, "workspace_mib": 0.0001, "dcp_transport": "peer"}})
    with pytest.raises(ProfileError, match="workspace_mib"):
        dcp.dcp_exchange(tight, None, shape, torch.float32, torch.device("cuda", 0))
