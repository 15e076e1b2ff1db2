"""Verification mode (``kv_prefetch.verify: true``): is what attention reads what it should be?

* Every slot, before its layer's attention reads it, against that layer's paged cache: what the
  slot must hold is computed here on the host (:func:`check_slot`); inside a CUDA graph the layer
  is gathered again and compared on the device instead (nothing may read back to the host).

The engine's own attention output can be checked against a reference over the slot too; for
vLLM's MLA that lives with the vLLM hooks (``integrations/vllm/mla_check.py``).

Host-syncs: for tests and debugging. The expected slot is written here, in a form of its own
(a request's pages in order, cut to its context), not borrowed from the kernels or from the
tests' CPU references (``kernels/reference.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ringflow.kernels import page_gather, paged_gather
from ringflow.units import ceil_div

if TYPE_CHECKING:
    from ringflow.integrations.torch.kv_prefetch import DcpGroup, KVPrefetcher, KVSource

log = logging.getLogger("ringflow")


@dataclass
class Verification:
    """What verification mode saw: slots checked, and the mismatches (layer, detail)."""

    checked: int = 0
    mismatches: list[tuple[int, str]] = field(default_factory=list)
    skipped_capture: int = 0
    #: checks issued inside CUDA graphs (counted on the device at every replay; read back by
    #: :meth:`read_device_counts`)
    captured_checked: int = 0
    captured_mismatches: int = 0
    #: [checks, mismatches] counted on the device by captured checks (no host sync); None when
    #: verification is off
    device_counts: torch.Tensor | None = field(default=None, repr=False)

    def read_device_counts(self, name: str) -> Verification:
        """Fold the device-side counts of captured checks into this record (host sync)."""
        if self.device_counts is not None:
            checked, bad = self.device_counts.tolist()
            self.captured_checked, self.captured_mismatches = checked, bad
            if bad:
                log.error("'%s': verification inside CUDA graphs: %d of %d slot(s) differed "
                          "from their layer's cache", name, bad, checked)
        return self


def check_slot(lane: KVPrefetcher, layer: int, source: KVSource) -> None:
    """Compare ``layer``'s slot with its cache (``source``) and record the result on
    ``lane.verification``; a mismatch is logged too."""
    got = lane.gathered(layer)
    if lane.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _check_slot_captured(lane, got, source)
        return
    if lane.dcp is not None:
        detail = _check_own_shard(got, source, lane.dcp)
    else:
        want = _expected_slot(source, lane.layout.kind, lane.layout.block_size, lane.capacity)
        got = got.cpu().view(want.shape)  # a flat page slot, shaped like the cache's pages
        detail = None if torch.equal(got, want) else _first_difference(got, want)
    lane.verification.checked += 1
    if detail is not None:
        lane.verification.mismatches.append((layer, detail))
        log.error("'%s': verification: the slot of layer %d differs from its cache: %s",
                  lane.name, layer, detail)


def _expected_slot(source: KVSource, kind: str, block_size: int, capacity: int) -> torch.Tensor:
    """What a slot holds, on the host: each request's pages in batch order (``rows``: cut to its
    context tokens), then zeros up to ``capacity``."""
    cache, table = source.cache.cpu(), source.block_table.cpu()
    pages = kind == "pages"
    block = block_size if pages else cache.shape[1]
    out = torch.zeros((capacity, *cache.shape[1 if pages else 2:]), dtype=cache.dtype)
    row = 0
    for r, n in enumerate(source.context_lens.tolist()):
        held = cache[table[r, : ceil_div(n, block)]]
        part = held if pages else held.flatten(0, 1)[:n]
        out[row: row + part.shape[0]] = part
        row += part.shape[0]
    return out


def _check_slot_captured(lane: KVPrefetcher, got: torch.Tensor, source: KVSource) -> None:
    """Inside a CUDA graph nothing may read back to the host: gather the layer again on the
    compute stream, after the wait, and count on the device whether the slot the attention
    reads differs (every replay adds one check). This checks the ordering and lifecycle of the
    slot; the kernels themselves are checked against CPU references eagerly."""
    record = lane.verification
    if lane.dcp is not None:  # the reference needs the other ranks' shards
        record.skipped_capture += 1
        if record.skipped_capture == 1:
            log.info("'%s': verification of DCP slots is skipped inside a CUDA graph capture",
                     lane.name)
        return
    want = torch.empty_like(got)  # from the graph's pool, at capture
    if lane.layout.kind == "rows":
        paged_gather(source.cache, source.block_table, source.context_lens, want)
    else:
        page_gather(source.cache, source.block_table, source.context_lens,
                    lane.layout.block_size, want)
    record.device_counts[0].add_(1)
    record.device_counts[1].add_((got != want).any().to(torch.int64))  # NaN counts as a miss


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want)) if got.is_floating_point() \
        else got != want
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten()
    return f"{len(rows)} row(s) differ, first at row {int(rows[0])}"


def _check_own_shard(got: torch.Tensor, source: KVSource, dcp: DcpGroup) -> str | None:
    """Under DCP a rank holds only its own tokens: check those rows of the gathered KV.

    Token t lives on rank ``(t // interleave) % size``; request r's tokens start at a multiple
    of ``size * interleave`` rows (Note [DCP layout] in kv_gathers.py).
    """
    cache, table = source.cache.cpu(), source.block_table.cpu()
    got = got.cpu()
    block_size, stride = cache.shape[1], dcp.interleave * dcp.size
    row, wrong = 0, 0
    for r, n in enumerate(source.context_lens.tolist()):
        for t in range(n):
            if (t // dcp.interleave) % dcp.size == dcp.rank:
                p = (t // stride) * dcp.interleave + t % dcp.interleave  # position on this rank
                if not torch.equal(got[row + t], cache[table[r, p // block_size], p % block_size]):
                    wrong += 1
        row += ceil_div(n, stride) * stride
    return f"{wrong} own-shard row(s) differ" if wrong else None
