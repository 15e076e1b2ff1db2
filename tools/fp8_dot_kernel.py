"""A block-fp8 GEMM in Triton whose fp8 dot may promote its sums to float32 every few products
(``max_num_imprecise_acc``), for tools/fp8_dot_accuracy.py (Note [fp8 sums on Hopper]): the
same per-block ``acc += dot * a_scale * b_scale`` as vLLM's kernels, with the promotion a knob,
so one run shows whether the tensor cores' own sums are what sets the gap."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _block_gemm(A, B, C, AS, BS, M, N, K, IMPRECISE: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    blocks = K // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, blocks):
        a = tl.load(A + rm[:, None] * K + kb * BK + rk[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(B + rn[None, :] * K + kb * BK + rk[:, None], mask=rn[None, :] < N, other=0.0)
        sa = tl.load(AS + rm * blocks + kb, mask=rm < M, other=0.0)
        sb = tl.load(BS + (rn // BK) * blocks + kb, mask=rn < N, other=0.0)
        if IMPRECISE < 0:  # Triton's default for fp8 on this GPU
            d = tl.dot(a, b)
        else:
            d = tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)
        acc += d * sa[:, None] * sb[None, :]
    tl.store(C + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               imprecise: int = -1, rows_per_tile: int = 64) -> torch.Tensor:
    """float32 [M, N] of ``a`` [M, K] fp8 with ``a_scale`` [M, K/128] times ``b`` [N, K] fp8
    with ``b_scale`` [N/128, K/128], all on the GPU; ``imprecise``: products summed before a
    float32 promotion (-1: Triton's default)."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, rows_per_tile), triton.cdiv(n, 64))
    _block_gemm[grid](a, b, c, a_scale, b_scale, m, n, k, IMPRECISE=imprecise,
                      BM=rows_per_tile, BN=64, BK=BLOCK)
    return c
