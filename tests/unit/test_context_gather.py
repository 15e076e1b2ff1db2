"""MLA context prefetch without vLLM: what each layer's attention reads from the workspace is
exactly what vLLM's own gather would have put there, whether it came from a slot or not."""

import logging
import weakref
from types import SimpleNamespace

import torch

from ringflow.integrations.vllm import context_gather as cg
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.profile import Profile

ROWS, W, BLOCKS, BLOCK = 16, 4, 6, 4
#: (block table, tokens) of each context chunk of a step
CHUNKS = [([0, 1], 7), ([3, 5, 2], 10)]


class FakeLayer(SimpleNamespace):
    """An MLA layer as the fill sees it (a subclass: SimpleNamespace itself takes no weakref)."""


def fake_gather(src_cache, dst, block_table, cu_seq_lens):
    """vLLM's context gather: the block table's rows of the paged cache, in order, into dst."""
    rows = src_cache[block_table].reshape(-1, src_cache.shape[-1])
    n = int(cu_seq_lens[-1])
    dst[:n].copy_(rows[:n])


def make_model(verify=False, layers=3, seed=0):
    profile = Profile.from_mapping({"name": "t", "kv_prefetch": {
        "depth": 1, "workspace_mib": 1, "verify": verify}})
    model = cg.ContextModel(PluginState(), key=1, profile=profile, shape=(ROWS, W),
                            dtype=torch.float32, device=torch.device("cpu"), name="t")
    g = torch.Generator().manual_seed(seed)
    fakes = [FakeLayer(kv_cache=torch.randn(BLOCKS, BLOCK, W, generator=g),
                       _k_scale=torch.tensor(1.0)) for _ in range(layers)]
    for layer in fakes:
        model.layers.append(weakref.ref(layer))
    return model, fakes  # the caller keeps the layers alive


def metadata(chunks=CHUNKS):
    """One step's attention metadata and its per-chunk gather arguments (made once)."""
    md = SimpleNamespace(prefill=SimpleNamespace(chunked_context=SimpleNamespace(
        workspace=torch.empty(ROWS, W))))
    args = [(torch.tensor(table), torch.tensor([0, toks]), toks) for table, toks in chunks]
    return md, args


def want(layer, table, toks):
    return layer.kv_cache[table].reshape(-1, W)[:toks]


def run_layer(model, index, layer, md, chunk_args):
    """One layer's context attention as vLLM runs it; returns its session and its reads."""
    ws = md.prefill.chunked_context.workspace
    ptr = ws.data_ptr()
    session = cg.Session(model, index, md)
    token = cg._SESSION.set(session)
    reads = []
    try:
        for table, cu, toks in chunk_args:
            dst = md.prefill.chunked_context.workspace[:toks]  # sliced after the last call
            session.gather("fake_gather", fake_gather, dict(
                src_cache=layer.kv_cache, dst=dst, block_table=table, cu_seq_lens=cu))
            reads.append(md.prefill.chunked_context.workspace[:toks].clone())
    finally:
        cg._SESSION.reset(token)
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
        assert run_step(model, fakes, md, args) == ["record", "consume", "consume"]
        assert len(model.calls) == 2 and [c.rows for c in model.calls] == [7, 10]
        assert model.ring.consumed == 4 * step and model.ring.steps == step
        assert not model.ring.in_step and model.ring.pool.leases() == []
    assert model.ring.abandoned == {}


def test_another_chunking_in_a_later_layer_falls_back_to_vllms_own_gather(caplog):
    model, fakes = make_model(seed=1)
    md, args = metadata()
    run_step(model, fakes, md, args)
    md, args = metadata()
    other = [(torch.tensor([4, 1]), torch.tensor([0, 6]), 6), args[1]]
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        modes = run_step(model, fakes, md, args, per_layer={2: other})
    assert modes == ["record", "consume", "pass"]
    assert len(model.ring.abandoned) == 1 and list(model.ring.abandoned.values()) == [1]
    (reason,) = model.ring.abandoned
    assert "layer 2" in reason
    named = [r for r in caplog.records if reason in r.getMessage()]
    assert len(named) == 1 and named[0].levelno == logging.WARNING
    assert not model.ring.in_step and model.ring.pool.leases() == []
    md, args = metadata()  # the next step is prefetched again
    assert run_step(model, fakes, md, args) == ["record", "consume", "consume"]


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
    assert session.mode == "pass" and model.ring.consumed == 0
    for (table, _, toks), got in zip(other_args, reads):
        assert torch.equal(got, want(fakes[1], table, toks))


def test_the_gather_hook_binds_positional_calls_into_the_session_and_is_inert_without_one():
    model, fakes = make_model(seed=4)
    md, args = metadata()
    hook = cg._gather_hook("fake_gather")
    out = torch.empty(ROWS, W)
    table, cu, toks = args[0]
    hook(model.state, fake_gather, fakes[0].kv_cache, out, table, cu)  # no session: vLLM's op
    assert torch.equal(out[:toks], want(fakes[0], table, toks))
    session = cg.Session(model, 0, md)
    token = cg._SESSION.set(session)
    try:
        ws = md.prefill.chunked_context.workspace
        hook(model.state, fake_gather, fakes[0].kv_cache, ws[:toks], table, cu_seq_lens=cu)
    finally:
        cg._SESSION.reset(token)
    (call,) = model.calls
    assert session.calls == 1 and set(call.args) == {"block_table", "cu_seq_lens"}
    assert call.args["block_table"] is table and call.args["cu_seq_lens"] is cu
    assert torch.equal(ws[:toks], want(fakes[0], table, toks))
