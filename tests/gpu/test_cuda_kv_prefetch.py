"""Full-KV prefetch on a GPU: the gather kernels, and KVPrefetcher's eager and captured paths
over MLA-shaped paged caches (576 bf16 per token), with a sleep kernel before every gather and
slots poisoned after every layer; the DCP all-gather over a real NCCL group (one GPU here)."""

import pytest
import torch
import torch.distributed as dist

from helpers.rings import symmetric_view
from ringflow.integrations.torch.kv_prefetch import DcpGroup, KVLayout, KVPrefetcher
from ringflow.kernels import dcp_all_gather, page_gather, paged_gather
from ringflow.kernels import reference as ref
from ringflow.testing.models import PagedAttentionStack

pytestmark = pytest.mark.cuda
SLEEP = 200_000            # ~0.1 ms on the gather stream before every gather
MLA = dict(row=576, block_size=64, requests=4, max_tokens_per_request=4096,
           dtype=torch.bfloat16, device="cuda")
CONTEXTS = [4000, 17, 1500, 0]   # different lengths, one request with no context yet


def stacks(layers=8, query_len=1, seed=0):
    ours = PagedAttentionStack(layers, query_len=query_len, seed=seed, **MLA)
    inline = PagedAttentionStack(layers, query_len=query_len, seed=seed, **MLA)
    for s in (ours, inline):
        s.start(CONTEXTS)
    return ours, inline


def prefetcher(stack, depth, *, dcp=None, verify=False, capture="join"):
    layout = KVLayout("rows", (stack.row,), stack.dtype, stack.block_size)
    pf = KVPrefetcher(layout, stack.capacity, max_requests=stack.requests, depth=depth,
                      workspace_bytes=1 << 30, device="cuda", dcp=dcp, verify=verify,
                      capture=capture, poison=True, name="mla")
    pf.plan(stack.layers)
    pf.gather_hook = lambda: torch.cuda._sleep(SLEEP)
    return pf


def snapshots(stack):
    return torch.full((stack.layers, stack.capacity, stack.row), float("nan"),
                      dtype=stack.dtype, device="cuda")


def steps_agree(ours, inline, pf, steps, seed=0, *, outputs=True):
    """Run ``steps`` steps on both stacks; every layer must read the same context KV."""
    for step in range(steps):
        for s in (ours, inline):
            s.refill(seed + step)
        got_kv, want_kv = snapshots(ours), snapshots(inline)
        got, want = ours.step(pf, snapshots=got_kv), inline.step(snapshots=want_kv)
        assert torch.equal(got_kv, want_kv), f"step {step}: a slot differs from its context KV"
        if outputs:
            assert torch.equal(got, want), f"step {step}: attention outputs differ"
        for s in (ours, inline):
            s.advance()


@pytest.mark.parametrize("lens", [[5, 0, 300], [64, 128, 1]])
def test_page_and_strided_row_gathers_match_their_references_on_the_gpu(lens):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(40, 2, 64, 128, generator=gen).cuda()
    table = torch.randperm(40, generator=gen)[:30].view(3, 10).cuda()
    seq = torch.tensor(lens, device="cuda")
    out = torch.full((20, 2, 64, 128), float("nan"), device="cuda")
    page_gather(cache, table, seq, 64, out)
    assert torch.equal(out.cpu(), ref.page_gather_ref(cache, table, seq, 64, 20))
    rows = cache.permute(0, 2, 1, 3)                  # [blocks, tokens, heads, content]: strided
    out = torch.full((512, 2, 128), float("nan"), device="cuda")
    paged_gather(rows, table, seq, out)
    assert torch.equal(out.cpu(), ref.paged_gather_ref(rows.contiguous(), table, seq, 512))


@torch.no_grad()
@pytest.mark.parametrize("depth,query_len", [(0, 1), (1, 1), (2, 1), (1, 8)])
def test_eager_prefetch_feeds_attention_the_exact_context_kv(depth, query_len):
    ours, inline = stacks(query_len=query_len)
    pf = prefetcher(ours, depth, verify=True)
    steps_agree(ours, inline, pf, 4)
    torch.cuda.synchronize()
    assert pf.verification.checked == 4 * ours.layers and not pf.verification.mismatches
    assert pf.pool.free_count == pf.pool.slots


def _capture(stack, pf, out, kv):
    stack.refill(100)
    stack.step(pf, outputs=out, snapshots=kv)           # warm-up, eagerly
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack.step(pf, outputs=out, snapshots=kv)
    return graph


@torch.no_grad()
@pytest.mark.parametrize("depth", [1, 2])
def test_captured_prefetch_replays_with_new_lengths_and_data(depth):
    ours, inline = stacks()
    pf = prefetcher(ours, depth, verify=True)            # verification skips inside capture
    out, kv = torch.empty_like(ours.queries), snapshots(ours)
    inline.refill(100)
    inline.step()                                        # the same two steps the capture took
    inline.step()
    graph = _capture(ours, pf, out, kv)
    for step in range(6):                                # contexts grow between replays
        for s in (ours, inline):
            s.advance()
            s.refill(step)
        out.fill_(float("nan"))
        kv.fill_(float("nan"))
        graph.replay()
        want_kv = snapshots(inline)
        want = inline.step(snapshots=want_kv)
        assert torch.equal(kv, want_kv), f"replay {step}: a slot differs from its context KV"
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    seen = pf.read_captured_verification()               # counted on the device, per replay
    assert seen.captured_checked == 6 * ours.layers      # a capture records, replays run
    assert seen.captured_mismatches == 0


@torch.no_grad()
def test_captured_verification_counts_a_slot_its_gather_did_not_fill():
    ours, _ = stacks(layers=3)
    pf = prefetcher(ours, 1, verify=True)
    real = pf._gather

    def broken(layer, lane, slot):
        real(layer, lane, slot)
        if layer == 1:
            slot.zero_()  # what a stale or unwritten slot looks like to the attention

    pf._gather = broken
    pf.stepper = None  # plan again: the executor binds the gather callable when it is built
    pf.plan(3)
    out, kv = torch.empty_like(ours.queries), snapshots(ours)
    graph = _capture(ours, pf, out, kv)
    graph.replay()
    torch.cuda.synchronize()
    seen = pf.read_captured_verification()
    assert seen.captured_checked == ours.layers and seen.captured_mismatches == 1
    assert seen.mismatches  # the eager warm-up's check found it on the host too


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    """A one-GPU NCCL world and the gather lane's own communicator split from it."""
    rdzv = tmp_path_factory.mktemp("nccl") / "rdzv"
    dist.init_process_group("nccl", init_method=f"file://{rdzv}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    lane = dist.new_group([0])
    yield lane
    dist.destroy_process_group()


class _OneGpuRings:
    """Two 'ranks' of symmetric memory on one GPU: get_buffer hands out the other ring, and the
    barriers are no-ops (the test orders the ranks itself)."""

    def __init__(self, rings):
        self.rings = rings

    def get_buffer(self, rank, shape, dtype, offset):
        return symmetric_view(self.rings[rank], shape, dtype, offset)

    def barrier(self, channel=0, timeout_ms=0):
        pass


@torch.no_grad()
def test_the_peer_exchange_lands_the_peers_rows_in_order_with_2d_copies():
    """Rank 0 of a group of 2 (interleave 2) on one GPU: its own rows by the Triton scatter,
    rank 1's by cudaMemcpy2DAsync from rank 1's ring, eagerly on a side stream and replayed
    from a CUDA graph over a poisoned slot (a copy issued at capture instead of recorded
    would leave the poison)."""
    from ringflow.kernels import dcp_gather, dcp_slot_rows
    from ringflow.kernels.kv_gathers import write_own_rows
    from ringflow.kernels.peer_exchange import PeerExchange
    gen = torch.Generator().manual_seed(5)
    lens, world, interleave = [33, 1, 200], 2, 2
    full = [torch.randn(n, 576, generator=gen).to(torch.bfloat16) for n in lens]
    host = ref.dcp_shard_ref(full, world, interleave, 64, 4)
    shards = [(cache.cuda(), table.cuda()) for cache, table in host]
    rows = dcp_slot_rows(sum(lens), len(lens), world, interleave)
    want = ref.dcp_all_gather_ref(host, lens, world, interleave, rows)
    rings = [torch.full((2, rows, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
             for _ in range(world)]
    seq = torch.tensor(lens, device="cuda")
    write_own_rows(*shards[1], seq, rings[1][1], world, 1, interleave)  # the peer went first
    exchange = PeerExchange(rings[0], _OneGpuRings(rings), world, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        dcp_gather(*shards[0], seq, rings[0][1], None, exchange, interleave=interleave)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(rings[0][1].cpu(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dcp_gather(*shards[0], seq, rings[0][1], None, exchange, interleave=interleave)
    rings[0][1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rings[0][1].cpu(), want)
    assert torch.isnan(rings[0][0].cpu()).all(), "the gather wrote the ring's other slot"


@torch.no_grad()
def test_dcp_all_gather_on_nccl_eager_and_captured(nccl):
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(n, 576, generator=gen).to(torch.bfloat16) for n in (33, 1, 200)]
    [(cache, table)] = ref.dcp_shard_ref(full, 1, 1, 64, 4)
    cache, table = cache.cuda(), table.cuda()
    lens = torch.tensor([33, 1, 200], device="cuda")
    slot = torch.full((256 + 256 + 3, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, staging = slot[:256], slot[256:].view(1, 259, 576)
    want = torch.zeros(256, 576, dtype=torch.bfloat16)
    want[:234] = torch.cat(full)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                        # on a gather lane, as ringflow runs it
        dcp_all_gather(cache, table, lens, out, staging, nccl)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out.cpu(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dcp_all_gather(cache, table, lens, out, staging, nccl)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)


@torch.no_grad()
def test_dcp_prefetch_on_nccl_feeds_attention_eager_and_captured(nccl):
    ours, inline = stacks(layers=4)
    pf = prefetcher(ours, 1, dcp=DcpGroup(nccl, 1, 0), verify=True)
    steps_agree(ours, inline, pf, 2, outputs=False)
    assert pf.verification.checked == 8 and not pf.verification.mismatches
    out, kv = torch.empty_like(ours.queries), snapshots(ours)
    inline.refill(100)
    inline.step()
    inline.step()
    graph = _capture(ours, pf, out, kv)
    for s in (ours, inline):
        s.advance()
        s.refill(7)
    graph.replay()
    want_kv = snapshots(inline)
    inline.step(snapshots=want_kv)
    assert torch.equal(kv, want_kv)


@torch.no_grad()
def test_resize_and_kv_replacement_on_the_gpu_never_read_a_freed_ring_or_cache():
    ours, inline = stacks(layers=4)
    pf = prefetcher(ours, 2, verify=True)
    ours.refill(0)
    pf.begin(0, ours.source)                   # gathers of layers 0..2 in flight (slept)
    pf.resize(ours.capacity, 1 << 30)          # a new ring while they run
    old = ours.caches
    pf.retire("KV cache replaced")
    ours.caches = [c.clone() for c in old]     # the engine re-binds its caches
    for c in old:
        c.fill_(float("nan"))
    inline.caches = [c.clone() for c in ours.caches]
    for layer in range(1, 4):
        pf.begin(layer, ours.source)
        pf.end(layer)
    steps_agree(ours, inline, pf, 3, seed=10, outputs=False)
    torch.cuda.synchronize()
    assert not pf.verification.mismatches and pf.pool.free_count == pf.pool.slots
