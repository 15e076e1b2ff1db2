"""Verification mode for vLLM's MLA attention: the backend's output against a float64 attention
over the prefetched slot (the context) plus the step's new rows. Host-syncs: for tests and
debugging. It reads vLLM's ``MLAAttention`` weights and the step's metadata, so it lives here,
beside the hooks that call it, not with the engine-neutral slot check."""

from __future__ import annotations

import logging

import torch

from ringflow.integrations.torch.kv_prefetch import KVPrefetcher

log = logging.getLogger("ringflow")


def check_mla_output(lane: KVPrefetcher, index: int, layer, slot: torch.Tensor, common, q,
                     kv_cache: torch.Tensor, output: torch.Tensor) -> float:
    """A float64 attention over the slot (context) plus the step's new rows, against the
    backend's output; returns the worst relative error (a mismatch is recorded on
    ``lane.verification`` and logged).

    Args:
        layer: vLLM's ``MLAAttention`` (``kv_lora_rank``, ``W_UK_T``, ``W_UV``, ``impl.scale``).
        slot: the layer's prefetched context rows.
        common: the step's backend-neutral metadata (block table, lengths).
        q, kv_cache, output: of ``forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata,
            output=...)``: q is ``[tokens, heads, nope + rope]``, the output
            ``[tokens, heads * v_head_dim]``.
    """
    n, latent = common.num_reqs, layer.kv_lora_rank
    starts = common.query_start_loc[: n + 1].cpu().tolist()
    seq = common.seq_lens[:n].cpu().tolist()
    table = common.block_table_tensor.cpu()
    cache = kv_cache.cpu().double()
    slot = slot.cpu().double()
    w_uk_t, w_uv = layer.W_UK_T.cpu().double(), layer.W_UV.cpu().double()   # [N,P,L], [N,L,V]
    nope = w_uk_t.shape[1]
    scale = layer.impl.scale
    block = cache.shape[1]
    worst, offset = 0.0, 0
    for r in range(n):
        q_len = starts[r + 1] - starts[r]
        ctx = seq[r] - q_len
        new = torch.stack([cache[table[r, p // block], p % block] for p in range(ctx, seq[r])]) \
            if q_len else cache.new_zeros(0, cache.shape[-1])
        rows = torch.cat([slot[offset: offset + ctx], new])
        offset += ctx
        for i in range(q_len):
            token = starts[r] + i
            keys = rows[: ctx + i + 1]
            qt = q[token].cpu().double()                                       # [N, P + R]
            q_latent = torch.einsum("np,npl->nl", qt[:, :nope], w_uk_t)
            scores = (q_latent @ keys[:, :latent].T + qt[:, nope:] @ keys[:, latent:].T) * scale
            o_latent = torch.softmax(scores, dim=-1) @ keys[:, :latent]       # [N, L]
            want = torch.einsum("nl,nlv->nv", o_latent, w_uv).reshape(-1)
            got = output[token].cpu().double().reshape(-1)
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp(min=1e-6)))
    # the backend computes in the model dtype; the reference in float64
    if worst > (1e-3 if output.dtype == torch.float32 else 3e-2):
        lane.verification.mismatches.append((index, f"attention output off by {worst:.2e}"))
        log.error("'%s': the backend's attention output for layer %d differs from a reference "
                  "attention over the prefetched slot (relative error %.2e)", lane.name, index,
                  worst)
    return worst
