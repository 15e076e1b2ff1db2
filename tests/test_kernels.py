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
