"""Full-KV gathers against their CPU references: pages, strided views, and DCP all-gathers
over real 2- and 4-process gloo groups."""

import pytest
import torch
import torch.distributed as dist

from ringflow import KernelError
from ringflow.kernels import (dcp_all_gather, dcp_gather, dcp_local_lens, dcp_slot_rows,
                              dcp_slot_starts, page_gather, paged_gather)
from ringflow.kernels.peer_exchange import PeerExchange
from ringflow.kernels import reference as ref
from ringflow.testing.spawn import spawn_group

from helpers.rings import ThreadRings

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # `pytest -m cuda` selects it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens", [[5, 0, 17], [1], [16, 32, 3]])
def test_page_gather_copies_whole_pages_in_request_order(device, lens):
    gen = torch.Generator().manual_seed(sum(lens))
    block_size, blocks = 8, 20
    cache = torch.randn(blocks, 3, 8, 4, generator=gen).to(device)   # an opaque page interior
    table = torch.randperm(blocks, generator=gen)[: 4 * len(lens)].view(len(lens), 4).to(device)
    seq = torch.tensor(lens, device=device)
    out = torch.full((12, 3, 8, 4), float("nan"), device=device)
    page_gather(cache, table, seq, block_size, out)
    assert torch.equal(out.cpu(), ref.page_gather_ref(cache, table, seq, block_size, 12))


def test_page_gather_refuses_mismatched_pages():
    with pytest.raises(KernelError, match="cannot gather pages"):
        page_gather(torch.zeros(4, 2, 3), torch.zeros(1, 2, dtype=torch.int64),
                    torch.tensor([3]), 2, torch.zeros(4, 2, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_gather_reads_a_strided_view_of_k_and_v_planes(device):
    """FlashAttention-style caches are [2, blocks, block_size, heads, dim]; their token rows
    [blocks, block_size, 2, heads, dim] are a view that cannot be flattened."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 10, 4, 2, 3, generator=gen).to(device)
    rows = kv.permute(1, 2, 0, 3, 4)
    table = torch.randperm(10, generator=gen)[:6].view(2, 3).to(device)
    seq = torch.tensor([9, 5], device=device)
    out = torch.full((16, 2, 2, 3), float("nan"), device=device)
    paged_gather(rows, table, seq, out)
    assert torch.equal(out.cpu(), ref.paged_gather_ref(rows.contiguous(), table, seq, 16))


@pytest.mark.parametrize("size,interleave", [(2, 1), (4, 1), (4, 2), (3, 4)])
def test_dcp_local_lens_follow_the_token_owner_rule(size, interleave):
    lens = [0, 1, 2, 3, 5, 7, 8, 16, 17, 33]
    got = dcp_local_lens(torch.tensor(lens), size, interleave)
    for r, n in enumerate(lens):
        want = [0] * size
        for t in range(n):
            want[ref.dcp_owner(t, size, interleave)[0]] += 1
        assert got[r].tolist() == want


def _aligned(full: list[torch.Tensor], rows: int, align: int) -> torch.Tensor:
    """The DCP slot by hand: request after request, each from a multiple of ``align``."""
    want, start = torch.zeros(rows, full[0].shape[1], dtype=full[0].dtype), 0
    for part in full:
        want[start: start + part.shape[0]] = part
        start += -(-part.shape[0] // align) * align
    return want


def _dcp_rank(rank: int, world: int, lens: list[int], interleave: int, row: int) -> None:
    """One rank: shard a seeded full KV, all-gather it back on a group of its own, compare."""
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(n, row, generator=gen) for n in lens]
    block_size = 4
    blocks_per_request = max(1, -(-max(lens) // block_size))
    shards = ref.dcp_shard_ref(full, world, interleave, block_size, blocks_per_request)
    cache, table = shards[rank]
    capacity = dcp_slot_rows(sum(lens) + 3, len(lens), world, interleave)
    local_capacity = capacity // world
    slot = torch.full((capacity + world * local_capacity, row), float("nan"))
    out, staging = slot[:capacity], slot[capacity:].view(world, local_capacity, row)
    lane_group = dist.new_group(list(range(world)))  # the gather lane's own communicator
    dcp_all_gather(cache, table, torch.tensor(lens), out, staging, lane_group,
                   interleave=interleave)
    want = _aligned(full, capacity, world * interleave)
    assert torch.equal(out, want), f"rank {rank}: all-gathered KV differs from the full KV"
    single = ref.dcp_all_gather_ref(shards, lens, world, interleave, capacity)
    assert torch.equal(out, single)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lens,interleave", [
    ([1, 3, 10, 17], 1),       # shorter than the group, not divisible by it
    ([2, 9, 0, 16], 2),        # an empty request, interleave of 2
    ([5], 4),
])
def test_dcp_all_gather_over_gloo_reproduces_the_full_kv(tmp_path, world, lens, interleave):
    spawn_group(world, _dcp_rank, lens, interleave, 6, rendezvous=str(tmp_path / "rdzv"))


@pytest.mark.parametrize("world,lens,interleave", [(2, [1, 3, 10, 17], 1), (4, [2, 9, 0, 16], 2),
                                                   (3, [5], 4), (2, [7, 64], 4)])
def test_dcp_gather_over_a_peer_exchange_lands_every_row_in_order(world, lens, interleave):
    """The copy-engine exchange (Note [Peer exchange]) gives the all-gather's result on every
    rank with no staging: each writes its own rows into its slot, then pulls each peer's rows
    from the same rows of the peer's slot, in the second slot of a two-slot ring (so an offset
    error reads the wrong slot). A pull before its owner's write reads NaN and fails."""
    from concurrent.futures import ThreadPoolExecutor
    gen = torch.Generator().manual_seed(11)
    row, block_size = 6, 4
    full = [torch.randn(n, row, generator=gen) for n in lens]
    shards = ref.dcp_shard_ref(full, world, interleave, block_size,
                               max(1, -(-max(lens) // block_size)))
    capacity = dcp_slot_rows(sum(lens) + 3, len(lens), world, interleave)
    rings = [torch.full((2, capacity, row), float("nan")) for _ in range(world)]
    handle = ThreadRings(rings)

    def rank(r):
        exchange = PeerExchange(rings[r], handle, world, r)
        dcp_gather(*shards[r], torch.tensor(lens), rings[r][1], None, exchange,
                   interleave=interleave)
        return rings[r][1].clone()

    with ThreadPoolExecutor(world) as pool:
        outs = list(pool.map(rank, range(world)))
    want = _aligned(full, capacity, world * interleave)
    assert torch.equal(want, ref.dcp_all_gather_ref(shards, lens, world, interleave, capacity))
    for r, out in enumerate(outs):
        assert torch.equal(out, want), f"rank {r}"
    assert handle.barriers == 2 * world  # one after the own rows, one after the pulls
    assert torch.isnan(torch.stack(rings)[:, 0]).all(), "something wrote the other slot"


def test_a_rank_writes_only_its_own_rows_before_the_exchange():
    """Rank 1 of 2 with interleave 2: rows 2, 3, 6, 7, ... (its chunks) hold its tokens or
    zeros, every other row is untouched for the peer's pull to fill."""
    from ringflow.kernels.kv_gathers import write_own_rows
    lens, world, interleave = [6, 3], 2, 2
    full = [torch.randn(n, 5, generator=torch.Generator().manual_seed(n)) for n in lens]
    cache, table = ref.dcp_shard_ref(full, world, interleave, 2, 2)[1]
    out = torch.full((12, 5), float("nan"))
    write_own_rows(cache, table, torch.tensor(lens), out, world, 1, interleave)
    want = _aligned(full, 12, 4)
    mine = torch.tensor([(p // interleave) % world == 1 for p in range(12)])
    assert torch.equal(out[mine], want[mine])
    assert torch.isnan(out[~mine]).all()
    assert dcp_slot_starts(torch.tensor(lens), world, interleave).tolist() == [0, 8]


@pytest.mark.parametrize("tokens,requests,size,interleave,rows", [
    (10, 1, 2, 1, 10), (11, 1, 2, 1, 12), (10, 3, 2, 2, 16), (1, 1, 4, 16, 64)])
def test_a_dcp_slot_holds_every_batch_the_ring_admits(tokens, requests, size, interleave, rows):
    """Every split of ``tokens`` over ``requests`` fits ``dcp_slot_rows`` once aligned, and
    the worst one needs all of it."""
    import itertools
    assert dcp_slot_rows(tokens, requests, size, interleave) == rows
    align, ends = size * interleave, []
    for cut in itertools.combinations_with_replacement(range(tokens + 1), requests - 1):
        lens = torch.diff(torch.tensor([0, *cut, tokens]))
        ends.append(int(dcp_slot_starts(lens, size, interleave)[-1] + lens[-1]))
    assert max(ends) <= rows and rows % align == 0
    assert rows - max(ends) < align


def test_the_in_place_gather_checks_the_cache_against_the_slot():
    """A cache of wider rows than the slot would write past each row: refused before any
    write, as the NCCL path refuses it."""
    ring = torch.full((2, 8, 3), float("nan"))
    exchange = PeerExchange(ring, ThreadRings([ring, ring.clone()]), 2, 0)
    with pytest.raises(KernelError, match="cannot gather"):
        dcp_gather(torch.zeros(2, 4, 5), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([3]),
                   ring[0], None, exchange)
    assert torch.isnan(ring).all()


def test_own_rows_of_a_cache_no_stride_reaches_come_from_plain_indexing():
    """A cache whose blocks are not a whole number of rows apart (no row view) still gives the
    rank's rows, through the indexing fallback."""
    from ringflow.kernels.kv_gathers import write_own_rows
    lens = [5, 2]
    full = [torch.randn(n, 3, generator=torch.Generator().manual_seed(n)) for n in lens]
    cache, table = ref.dcp_shard_ref(full, 2, 1, 2, 2)[0]
    skewed = torch.as_strided(torch.full((cache.shape[0] * 7,), float("nan")), cache.shape,
                              (7, 3, 1))  # blocks 7 apart, rows 3: no row view
    skewed.copy_(cache)
    out = torch.full((8, 3), float("nan"))
    write_own_rows(skewed, table, torch.tensor(lens), out, 2, 0, 1)
    want = _aligned(full, 8, 2)
    mine = torch.arange(8) % 2 == 0
    assert torch.equal(out[mine], want[mine]) and torch.isnan(out[~mine]).all()


def test_a_peer_exchange_refuses_a_slot_not_aligned_to_the_group():
    ring = torch.zeros(2, 9, 3)
    exchange = PeerExchange(ring, ThreadRings([ring, ring.clone()]), 2, 0)
    with pytest.raises(KernelError, match="multiple of 2 rows"):
        exchange.exchange(ring[0], None, 1)


def test_a_peer_view_outside_the_exchanges_ring_is_refused():
    ring = torch.zeros(2, 8, 3)
    exchange = PeerExchange(ring, ThreadRings([ring]), 1, 0)
    with pytest.raises(KernelError, match="contiguous part"):
        exchange.remote(0, torch.zeros(4, 3))


def test_dcp_all_gather_refuses_a_staging_buffer_of_the_wrong_group_size(tmp_path):
    spawn_group(1, _wrong_staging, rendezvous=str(tmp_path / "rdzv"))


def _wrong_staging(rank: int, world: int) -> None:
    with pytest.raises(KernelError, match="staging must be"):
        dcp_all_gather(torch.zeros(2, 4, 3), torch.zeros(1, 2, dtype=torch.int64),
                       torch.tensor([3]), torch.zeros(8, 3), torch.zeros(2, 8, 3), dist.group.WORLD)


def _bench_shards(rank: int, world: int) -> None:
    """ringflow.testing.dcp's shards (block tables not the identity) all-gather back to its full KV."""
    from ringflow.testing.dcp import ROW, full_kv, shard
    batch, context = 2, 300
    full = full_kv(batch, context, 1, "cpu")
    cache, table = shard(full, batch, context, rank, world)
    local = batch * context // world
    slot = torch.full((batch * context + world * local, ROW), float("nan"), dtype=torch.bfloat16)
    dcp_all_gather(cache, table, torch.full((batch,), context), slot[: batch * context],
                   slot[batch * context:].view(world, local, ROW), dist.new_group(list(range(world))))
    assert torch.equal(slot[: batch * context], full)


@pytest.mark.parametrize("world", [1, 3])
def test_the_dcp_benchmarks_shards_gather_back_to_its_full_kv(tmp_path, world):
    spawn_group(world, _bench_shards, rendezvous=str(tmp_path / "rdzv"))


def test_paged_gather_reads_padded_blocks_through_a_row_view():
    """Blocks padded past their rows (a block stride that is not block_size rows)."""
    gen = torch.Generator().manual_seed(9)
    padded = torch.randn(6, 5, 3, generator=gen)          # 5 row-slots per block, 4 used
    cache = padded[:, :4]
    table = torch.tensor([[4, 1], [0, 5]])
    seq = torch.tensor([7, 2])
    out = torch.full((12, 3), float("nan"))
    paged_gather(cache, table, seq, out)
    assert torch.equal(out, ref.paged_gather_ref(cache.contiguous(), table, seq, 12))


def test_gathers_of_an_empty_batch_zero_the_slot():
    empty = torch.zeros(0, 2, dtype=torch.int64)
    out = torch.full((4, 3), float("nan"))
    paged_gather(torch.randn(2, 4, 3), empty, torch.zeros(0, dtype=torch.int64), out)
    assert not out.any()
    out.fill_(float("nan"))
    page_gather(torch.randn(2, 3), empty, torch.zeros(0, dtype=torch.int64), 4, out)
    assert not out.any()


def _small_staging(rank: int, world: int) -> None:
    with pytest.raises(KernelError, match="needs 8"):
        dcp_all_gather(torch.zeros(2, 4, 3), torch.zeros(3, 2, dtype=torch.int64),
                       torch.tensor([3, 3, 3]), torch.zeros(8, 3), torch.zeros(1, 4, 3),
                       dist.group.WORLD)


def test_dcp_all_gather_refuses_a_staging_part_too_small_for_the_batch(tmp_path):
    spawn_group(1, _small_staging, rendezvous=str(tmp_path / "rdzv"))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_gather_reads_rows_interleaved_with_other_heads(device):
    """[blocks, heads, tokens, content] read as token rows: a block's rows are spread between
    the heads, so a row view must stop at the last block's last token."""
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(40, 2, 64, 128, generator=gen).to(device)
    rows = cache.permute(0, 2, 1, 3)
    table = torch.randperm(40, generator=gen)[:30].view(3, 10).to(device)
    table[2, 9] = 39                                       # the cache's last block is read
    seq = torch.tensor([5, 0, 640], device=device)
    out = torch.full((700, 2, 128), float("nan"), device=device)
    paged_gather(rows, table, seq, out)
    assert torch.equal(out.cpu(), ref.paged_gather_ref(rows.contiguous(), table, seq, 700))


def test_a_strided_copy_of_no_rows_copies_nothing_and_still_checks_its_views():
    """A context chunk of no tokens gives the peer exchange views of zero rows: nothing to copy
    (no IndexError from looking at a first row that does not exist), mismatches still refused."""
    from ringflow.errors import KernelError
    from ringflow.kernels.peer_exchange import copy_strided

    src, dst = torch.ones(0, 2, 4), torch.full((0, 2, 4), float("nan"))
    copy_strided(dst[:, 1], src[:, 1])
    with pytest.raises(KernelError, match="strided copy"):
        copy_strided(dst[:, 1], torch.ones(0, 3, 4)[:, 1])


def test_a_ring_is_a_symmetric_block_of_its_own_not_carved_from_the_pool(monkeypatch):
    """Note [Peer exchange]: torch's implicit pool would place the ring partway into a block,
    where get_buffer's offsets do not count from; the ring is allocated as its own block, with
    contiguous strides (and through symm_mem.empty only on a torch whose call needs a group)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    from ringflow.kernels import peer_exchange

    calls = []

    def direct(size, stride, dtype, device):
        calls.append((size, stride, dtype, device))
        return torch.empty(size, dtype=dtype)

    monkeypatch.setattr(_SymmetricMemory, "empty_strided_p2p", staticmethod(direct))
    ring = peer_exchange.symmetric_block((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert ring.shape == (3, 5, 7)
    assert calls == [((3, 5, 7), (35, 7, 1), torch.bfloat16, torch.device("cpu"))]

    def needs_a_group(size, stride, dtype, device, group_name):
        raise AssertionError("not called with a group")

    pooled = []
    monkeypatch.setattr(_SymmetricMemory, "empty_strided_p2p", staticmethod(needs_a_group))
    from torch.distributed import _symmetric_memory as symm_mem
    monkeypatch.setattr(symm_mem, "empty",
                        lambda *shape, dtype, device: pooled.append(shape) or torch.empty(shape))
    peer_exchange.symmetric_block((2, 4), torch.float32, torch.device("cpu"))
    assert pooled == [(2, 4)]
