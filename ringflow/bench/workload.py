"""The built-in synthetic layered workload that ``ringflow run``, ``ringflow bench`` and the
tests drive.

Per layer and lane: gather one slot's worth of data (pinned host -> device copy, index gather or
paged gather, per the profile's ``workload.gather``), then a step that reads it. The default,
``compute: attention``, is attention-like::

    x  = inputs[lane] if layer == 0 else state[lane]
    kv = slot viewed as [rows, d]
    state[lane] = 0.5 * x + softmax(x @ kv^T / sqrt(d)) @ kv

``compute: decoder`` treats the slot as one Llama decoder layer's weights (weight streaming) and
runs that layer over ``queries`` tokens.

Every output depends on every layer's slot, in order, so a slot read too early, too late or
after poisoning changes the result. All tensors are allocated once here (static buffers): a
captured graph can replay over fresh data written by :meth:`refresh`.
"""

from __future__ import annotations

import math

import torch

from ringflow.errors import ProfileError
from ringflow.kernels import copy_host_to_device, index_gather, paged_gather
from ringflow.orchestrator.profile import Profile
from ringflow.graphs.slots import torch_dtype
from ringflow.testing.models import decoder_block, decoder_weights
from ringflow.units import ceil_div


class SyntheticWorkload:
    """Data and callables for one profile on one device.

    Args:
        profile: the run description (slot shape and dtype, lanes, workload section).
        device: where slots and compute live (``"cpu"`` or a CUDA device).
        layers: overrides ``profile.layers``.
    """

    def __init__(self, profile: Profile, device: torch.device | str = "cpu", *,
                 layers: int | None = None) -> None:
        profile.require_run_fields()
        if profile.slot.dtype == "uint8":
            raise ProfileError("slot.dtype", "the synthetic workload computes on its slots and "
                               "needs a floating dtype; accepted: float32 | float16 | bfloat16 | "
                               "float64", profile.source)
        self.profile = profile
        self.device = torch.device(device)
        self.layers = profile.layers if layers is None else layers
        self.dtype = torch_dtype(profile.slot.dtype)
        self.shape = profile.slot.shape
        self.rows = self.shape[0]
        self.lanes = profile.lanes
        work = profile.workload
        self.decoder = work.compute == "decoder"
        if self.decoder and work.gather != "h2d":
            raise ProfileError("workload.gather", "decoder compute streams weights: accepted: h2d",
                               profile.source)
        self.width = work.hidden if self.decoder else (
            math.prod(self.shape[1:]) if len(self.shape) > 1 else 1)
        self.work = work
        self.kind = work.gather
        self.store_layers = work.store_layers
        self.scale = 1.0 / math.sqrt(self.width)
        gen = torch.Generator().manual_seed(work.seed)
        pin = self.device.type == "cuda"
        n = self.store_layers
        if self.kind == "h2d":
            host = torch.empty((n, *self.shape), dtype=self.dtype)
            self.store = host.pin_memory() if pin else host
        elif self.kind == "index":
            self.store = torch.empty((n * self.rows, *self.shape[1:]), dtype=self.dtype,
                                     device=self.device)
            self.index = torch.stack([torch.randperm(n * self.rows, generator=gen)[: self.rows]
                                      for _ in range(n)]).to(self.device)
        else:
            bs = work.block_size
            blocks_per_slot = ceil_div(self.rows, bs)
            self.store = torch.empty((n * blocks_per_slot, bs, *self.shape[1:]), dtype=self.dtype,
                                     device=self.device)
            # two requests per slot, lengths that are not multiples of the block size
            first = max(1, self.rows // 3)
            self.seq_lens = torch.tensor([first, self.rows - first], device=self.device) \
                if self.rows > 1 else torch.tensor([1], device=self.device)
            tables = []
            for _ in range(n):
                perm = torch.randperm(n * blocks_per_slot, generator=gen)[: 2 * blocks_per_slot]
                tables.append(perm.view(2, blocks_per_slot))
            self.block_tables = torch.stack(tables).to(self.device)
            if self.rows == 1:
                self.block_tables = self.block_tables[:, :1]
        self.resident = torch.empty((n, *self.shape), dtype=self.dtype, device=self.device)
        q = work.queries
        self.inputs = {lane: torch.empty((q, self.width), dtype=self.dtype, device=self.device)
                       for lane in self.lanes}
        self.state = {lane: torch.empty_like(x) for lane, x in self.inputs.items()}
        self.refresh(work.seed)

    # -- data ---------------------------------------------------------------------------------

    def refresh(self, seed: int, *, sources: bool = True) -> None:
        """Fill the inputs (and, with ``sources``, every gather source) with fresh random data,
        in place: no reallocation, so a captured graph replays over the new data."""
        if self.device.type == "cuda":
            # the host store is written by the CPU below: no copy may still be reading it
            torch.cuda.synchronize(self.device)
        gen = torch.Generator().manual_seed(seed)

        def fill(t: torch.Tensor) -> None:
            scale = self.work.hidden ** -0.5 if self.decoder else 1.0  # weights keep activations sane
            t.copy_((torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale).to(t.dtype))

        if sources:
            fill(self.store)
            fill(self.resident)
        inputs = torch.Generator(device=self.device).manual_seed(seed)  # drawn on the device: fast
        for x in self.inputs.values():
            x.copy_(torch.randn(x.shape, generator=inputs, device=self.device).to(x.dtype))
        for x in self.state.values():
            x.fill_(float("nan"))  # poisoned: an output that skipped a layer shows NaN

    def _source(self, layer: int, lane: str) -> int:
        return (layer * len(self.lanes) + self.lanes.index(lane)) % self.store_layers

    # -- the callables executors run ----------------------------------------------------------

    def gather(self, layer: int, lane: str, out: torch.Tensor) -> None:
        i = self._source(layer, lane)
        if self.kind == "h2d":
            copy_host_to_device(self.store[i], out)
        elif self.kind == "index":
            index_gather(self.store, self.index[i], out)
        else:
            paged_gather(self.store, self.block_tables[i], self.seq_lens, out)

    def compute(self, layer: int, lane: str, slot: torch.Tensor | None) -> None:
        x = self.inputs[lane] if layer == 0 else self.state[lane]
        data = self.resident[self._source(layer, lane)] if slot is None else slot
        if self.decoder:
            w = self.work
            hidden, residual = decoder_block(x, *decoder_weights(data, w.hidden, w.intermediate),
                                             heads=w.heads)
            torch.add(hidden, residual, out=self.state[lane])
            return
        kv = data.view(self.rows, -1)
        scores = (x @ kv.transpose(0, 1)).float().mul_(self.scale)
        attn = torch.softmax(scores, dim=-1).to(self.dtype) @ kv
        torch.add(attn, x, alpha=0.5, out=self.state[lane])

    def outputs(self) -> dict[str, torch.Tensor]:
        return {lane: x.clone() for lane, x in self.state.items()}

    # -- references ---------------------------------------------------------------------------

    def reference(self, gathered: set[int] | None = None) -> dict[str, torch.Tensor]:
        """Straight-line run: per layer gather into a fresh buffer, then compute. No plan."""
        gathered = set(range(self.layers)) if gathered is None else gathered
        for layer in range(self.layers):
            for lane in self.lanes:
                buf = None
                if layer in gathered:
                    buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    self.gather(layer, lane, buf)
                self.compute(layer, lane, buf)
        return self.outputs()

    def reference_float64(self, gathered: set[int] | None = None) -> dict[str, torch.Tensor]:
        """The same function in float64 on the CPU, from the gathers' definitions."""
        gathered = set(range(self.layers)) if gathered is None else gathered
        out = {}
        for lane in self.lanes:
            x = self.inputs[lane].double().cpu()
            for layer in range(self.layers):
                i = self._source(layer, lane)
                if layer in gathered:
                    kv = self._source_rows(i).double().view(self.rows, -1)
                else:
                    kv = self.resident[i].double().cpu().view(self.rows, -1)
                p = torch.softmax((x @ kv.T) * self.scale, dim=-1)
                x = 0.5 * x + p @ kv
            out[lane] = x
        return out

    def _source_rows(self, i: int) -> torch.Tensor:
        from ringflow.kernels import reference as ref

        if self.kind == "h2d":
            return self.store[i].cpu()
        if self.kind == "index":
            return ref.index_gather_ref(self.store, self.index[i], self.rows)
        return ref.paged_gather_ref(self.store, self.block_tables[i], self.seq_lens, self.rows)
