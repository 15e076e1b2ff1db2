"""Gather kernels against their CPU references (fresh random data, poisoned outputs)."""

import pytest
import torch

from ringflow import KernelError
from ringflow.kernels import copy_host_to_device, index_gather, paged_gather
from ringflow.kernels import reference as ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # `pytest -m cuda` selects it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_to_device_copy_matches_the_reference(device, dtype):
    src = torch.randn(50, 9).to(dtype)
    if device == "cuda":
        src = src.pin_memory()
    out = torch.full((64, 9), float("nan"), dtype=dtype, device=device)
    copy_host_to_device(src, out)
    want = ref.copy_host_to_device_ref(src, (64, 9), dtype)
    assert torch.equal(out.cpu()[:50], want[:50]) and torch.isnan(out.cpu()[50:].float()).all()


def test_host_to_device_copy_refuses_mismatches():
    with pytest.raises(KernelError, match="match dtype"):
        copy_host_to_device(torch.randn(4, 3), torch.empty(4, 2))
    with pytest.raises(KernelError, match="match dtype"):
        copy_host_to_device(torch.randn(5, 3), torch.empty(4, 3))


@pytest.mark.cuda
def test_host_to_device_copy_refuses_pageable_memory():
    with pytest.raises(KernelError, match="pin it"):
        copy_host_to_device(torch.randn(4, 3), torch.empty(4, 3, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_index_gather_matches_the_reference(device):
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(100, 3, 4, generator=gen).to(device)
    index = torch.randint(0, 100, (37,), generator=gen).to(device)
    out = torch.full((40, 3, 4), float("nan"), device=device)
    index_gather(src, index, out)
    want = ref.index_gather_ref(src, index, 40)
    assert torch.equal(out.cpu()[:37], want[:37]) and torch.isnan(out.cpu()[37:]).all()


def test_index_gather_refuses_bad_indices_and_overflow():
    with pytest.raises(KernelError, match="1-D int32/int64"):
        index_gather(torch.randn(4, 2), torch.tensor([0.0]), torch.empty(4, 2))
    with pytest.raises(KernelError, match="do not fit"):
        index_gather(torch.randn(4, 2), torch.arange(4), torch.empty(3, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens", [[1], [5, 16, 17], [0, 33, 3], [16, 16]])
def test_paged_gather_packs_requests_and_zeroes_the_tail(device, lens):
    gen = torch.Generator().manual_seed(sum(lens))
    bs, width = 16, 6
    max_blocks = max(1, -(-max(lens) // bs))
    cache = torch.randn(40, bs, width, generator=gen).to(device)
    table = torch.randperm(40, generator=gen)[: len(lens) * max_blocks].view(len(lens), -1)
    seq = torch.tensor(lens)
    capacity = sum(lens) + 7
    out = torch.full((capacity, width), float("nan"), device=device)
    paged_gather(cache, table.to(device), seq.to(device), out)
    assert torch.equal(out.cpu(), ref.paged_gather_ref(cache, table, seq, capacity))


def test_paged_gather_refuses_mismatched_shapes():
    with pytest.raises(KernelError, match="block_table must be"):
        paged_gather(torch.randn(4, 2, 3), torch.zeros(3, dtype=torch.long),
                     torch.tensor([1]), torch.empty(4, 3))
    with pytest.raises(KernelError, match="cannot gather pages"):
        paged_gather(torch.randn(4, 2, 3), torch.zeros(1, 1, dtype=torch.long),
                     torch.tensor([1]), torch.empty(4, 5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row", [(576,), (4, 130), (1,)])
def test_the_one_pass_row_gather_equals_index_select_then_zero(dtype, row):
    """Note [One-pass row gather]: the Triton kernel against the CPU torch pair, rows read
    through a strided view (padding between rows) and the unused rows poisoned first."""
    from ringflow.kernels.row_gather import gather_rows, triton
    if triton is None:
        pytest.skip("Triton is not installed")
    gen = torch.Generator().manual_seed(len(row))
    base = torch.randn(300, 2, *row, generator=gen).to(dtype)
    src = base[:, 0]                                   # every other row: a padded view
    index = torch.randint(0, 300, (1000,), generator=gen)
    valid = torch.rand(1000, generator=gen) < 0.8
    want = src[index].clone()
    want[~valid] = 0
    out = torch.full((1000, *row), float("nan"), dtype=dtype, device="cuda")
    gather_rows(src.cuda(), index.cuda(), valid.cuda(), out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_row_scatter_writes_only_the_rows_it_names(device):
    """``gather_rows(..., out_index=)`` (the DCP gather writing a rank's own rows): each named
    row gets its source row or zeros, and every other row keeps its poison. On CUDA the Triton
    kernel runs; the CPU runs the torch pair."""
    from ringflow.kernels.row_gather import gather_rows
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(50, 2, 576, generator=gen).to(torch.bfloat16)[:, 1]   # padded rows
    targets = torch.randperm(400, generator=gen)[:120]
    index = torch.randint(0, 50, (120,), generator=gen)
    valid = torch.rand(120, generator=gen) < 0.7
    want = torch.full((400, 576), float("nan"), dtype=torch.bfloat16)
    want[targets] = torch.where(valid[:, None], src[index], torch.zeros(()).to(torch.bfloat16))
    out = want.clone().fill_(float("nan")).to(device)
    gather_rows(src.to(device), index.to(device), valid.to(device), out,
                out_index=targets.to(device))
    got = out.cpu()
    assert torch.equal(got[targets], want[targets])
    untouched = torch.ones(400, dtype=torch.bool)
    untouched[targets] = False
    assert torch.isnan(got[untouched]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("size,rank,interleave", [(2, 0, 1), (2, 1, 1), (4, 3, 2), (3, 1, 16)])
@pytest.mark.parametrize("lens,table_dtype", [([37, 0, 301, 5], torch.int32),
                                              ([37, 0, 301, 5], torch.int64),
                                              ([301], torch.int32), ([301, 9], torch.int64)])
def test_the_fused_own_rows_kernel_equals_the_torch_ops(size, rank, interleave, lens,
                                                        table_dtype):
    """Note [Own rows in one launch]: the Triton kernel against the torch path it replaces and
    the CPU reference, over requests of odd lengths (one empty), a permuted block table, blocks
    padded in the cache and a slot with rows past the last request; every row the rank does
    not own keeps its poison."""
    from ringflow.kernels import dcp_slot_rows
    from ringflow.kernels.kv_gathers import write_own_rows
    from ringflow.kernels import reference as ref
    gen = torch.Generator().manual_seed(size * 10 + rank)
    full = [torch.randn(n, 576, generator=gen).to(torch.bfloat16) for n in lens]
    shards = ref.dcp_shard_ref(full, size, interleave, 16, 20)
    cache, table = shards[rank]
    rows = dcp_slot_rows(sum(lens) + 40, len(lens), size, interleave)
    want = ref.dcp_all_gather_ref(shards, lens, size, interleave, rows)
    mine = torch.tensor([(p // interleave) % size == rank for p in range(rows)])
    padded = torch.full((cache.shape[0], 19, 576), float("nan"), dtype=torch.bfloat16)
    padded[:, :16] = cache  # blocks of 16 rows, 19 apart: the kernel must use per_block
    outs = []
    for fused in (True, False):
        out = torch.full((rows, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
        write_own_rows(padded.cuda()[:, :16], table.to(table_dtype).cuda(),
                        torch.tensor(lens, device="cuda"), out, size, rank, interleave,
                        fused=fused)
        outs.append(out.cpu())
    assert torch.equal(outs[0][mine], want[mine]), "fused kernel"
    assert torch.equal(outs[1][mine], want[mine]), "torch ops"
    assert torch.isnan(outs[0][~mine]).all() and torch.isnan(outs[1][~mine]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("size,interleave", [(2, 1), (4, 2), (3, 16), (1, 1)])
@pytest.mark.parametrize("lens", [[37, 0, 301, 5], [301]])
def test_the_fused_order_restoring_equals_the_torch_ops(size, interleave, lens):
    """The NCCL path's restore (Note [Own rows in one launch]) in one launch against the torch
    ops and the CPU reference: parts packed per rank (from the CPU shards), a poisoned slot
    with rows past the last request, which must come back zero."""
    from ringflow.kernels import dcp_local_lens, dcp_slot_rows
    from ringflow.kernels.kv_gathers import restore_order
    from ringflow.kernels import reference as ref
    gen = torch.Generator().manual_seed(size + interleave)
    full = [torch.randn(n, 576, generator=gen).to(torch.bfloat16) for n in lens]
    shards = ref.dcp_shard_ref(full, size, interleave, 16, 20)
    rows = dcp_slot_rows(sum(lens) + 40, len(lens), size, interleave)
    local = dcp_local_lens(torch.tensor(lens), size, interleave)
    staging = torch.full((size, rows // size + 3, 576), float("nan"), dtype=torch.bfloat16)
    for rank, (cache, table) in enumerate(shards):
        staging[rank, : int(local[:, rank].sum())] = ref.paged_gather_ref(
            cache, table, local[:, rank], int(local[:, rank].sum()))
    want = ref.dcp_all_gather_ref(shards, lens, size, interleave, rows)
    for fused in (True, False):
        out = torch.full((rows, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
        restore_order(staging.cuda(), local.cuda(), torch.tensor(lens, device="cuda"), out,
                       interleave, fused=fused)
        assert torch.equal(out.cpu(), want), f"fused={fused}"
