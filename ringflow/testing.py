"""Test helpers users can reuse to check their own plans and executors.

:class:`TracingWorkload` makes every gather write a value that names its (lane, layer), and
every compute record what it actually read, on the device, without a host sync (so it also
works inside a CUDA graph). After a forward, :meth:`TracingWorkload.check` says whether every
read saw exactly the write the plan intended.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ringflow.workload import decoder_block


class TracingWorkload:
    """Gathers write ``tag(layer, lane)``; computes record the min and max of what they read.

    Args:
        lanes: lane names, in plan order.
        layers: layers per forward.
        slot_shape: shape of one slot (small: the values are what matter).
        device: where slots live.
        gathered: layers that gather (None: all); others read resident data tagged negative.
        epoch: added to every tag so consecutive forwards write different values.
    """

    def __init__(self, lanes: Sequence[str], layers: int, slot_shape: Sequence[int] = (4,),
                 device: torch.device | str = "cpu", gathered: Iterable[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.lanes = list(lanes)
        self.layers = layers
        self.device = torch.device(device)
        self.gathered = set(range(layers)) if gathered is None else set(gathered)
        self.dtype = dtype
        self.epoch = 0
        n = (len(self.lanes), layers)
        self.seen_min = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self.seen_max = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self.resident = torch.empty(tuple(slot_shape), dtype=dtype, device=self.device)
        self.gather_hook = None  # called before each gather (e.g. a sleep kernel)

    def tag(self, layer: int, lane: str) -> float:
        """The value the plan intends layer ``layer`` of ``lane`` to read (exact in fp32)."""
        sign = 1 if layer in self.gathered else -1
        return float(sign * (1 + self.epoch * 4096 + layer * 16 + self.lanes.index(lane)))

    def new_forward(self) -> None:
        """Next forward writes new values; recorded reads are poisoned with NaN."""
        self.epoch = (self.epoch + 1) % 1000
        self.seen_min.fill_(float("nan"))
        self.seen_max.fill_(float("nan"))

    def gather(self, layer: int, lane: str, out: torch.Tensor) -> None:
        if self.gather_hook is not None:
            self.gather_hook()
        out.fill_(self.tag(layer, lane))

    def compute(self, layer: int, lane: str, slot: torch.Tensor | None) -> None:
        if slot is None:
            slot = self.resident.fill_(self.tag(layer, lane))
        i = self.lanes.index(lane)
        flat = slot.reshape(-1).to(torch.float64)
        self.seen_min[i, layer].copy_(flat.amin())
        self.seen_max[i, layer].copy_(flat.amax())

    def expected(self) -> torch.Tensor:
        return torch.tensor([[self.tag(layer, lane) for layer in range(self.layers)]
                             for lane in self.lanes], dtype=torch.float64)

    def mismatches(self) -> list[tuple[str, int, float, float, float]]:
        """``(lane, layer, expected, seen_min, seen_max)`` for every read that saw another write."""
        want = self.expected()
        lo, hi = self.seen_min.cpu(), self.seen_max.cpu()
        bad = []
        for i, lane in enumerate(self.lanes):
            for layer in range(self.layers):
                w, a, b = float(want[i, layer]), float(lo[i, layer]), float(hi[i, layer])
                if not (a == w and b == w):
                    bad.append((lane, layer, w, a, b))
        return bad

    def check(self) -> None:
        """Raise AssertionError listing the reads that did not see their intended write."""
        bad = self.mismatches()
        assert not bad, f"{len(bad)} read(s) saw the wrong data, e.g. {bad[:3]}"


class DecoderLayer(torch.nn.Module):
    """A Llama-style decoder layer with vLLM's calling convention, for tests and benchmarks.

    ``forward(positions, hidden_states, residual) -> (hidden_states, residual)``: RMSNorm, fused
    QKV projection, causal attention over the tokens, output projection, RMSNorm, fused gate/up
    projection, SiLU, down projection. Shapes are real (7B: hidden 4096, intermediate 11008,
    32 heads); the attention has no KV cache, which is not what weight streaming is about.
    """

    def __init__(self, hidden: int, intermediate: int, heads: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        super().__init__()
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn where it lives: fast

        def weight(rows: int, cols: int) -> torch.nn.Parameter:
            w = torch.randn(rows, cols, generator=gen, device=device) / cols ** 0.5
            return torch.nn.Parameter(w.to(dtype), requires_grad=False)

        self.heads = heads
        self.qkv = weight(3 * hidden, hidden)
        self.o = weight(hidden, hidden)
        self.gate_up = weight(2 * intermediate, hidden)
        self.down = weight(hidden, intermediate)
        norm = (1 + 0.1 * torch.randn(2, hidden, generator=gen, device=device)).to(dtype)
        self.norms = torch.nn.Parameter(norm, requires_grad=False)

    def forward(self, positions, hidden_states, residual=None):
        residual = hidden_states if residual is None else hidden_states + residual
        return decoder_block(residual, self.qkv, self.o, self.gate_up, self.down, self.norms,
                             heads=self.heads)


def decoder_stack(layers: int, hidden: int = 4096, intermediate: int = 11008, heads: int = 32,
                  dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cpu") -> torch.nn.ModuleList:
    """``layers`` decoder layers with distinct random weights (7B-class shapes by default)."""
    return torch.nn.ModuleList(DecoderLayer(hidden, intermediate, heads, dtype, device, seed=i)
                               for i in range(layers))


def run_stack(layers: torch.nn.ModuleList, hidden: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """The model loop an engine runs: every layer in order, as vLLM's LlamaModel does."""
    residual = None
    for layer in layers:
        hidden, residual = layer(positions, hidden, residual)
    return hidden + residual


def _group_entry(rank: int, world: int, init: str, backend: str, fn, args) -> None:
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_group(world: int, fn, *args, backend: str = "gloo", rendezvous: str) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in one process group.

    ``fn`` must be importable (module level). Any failure in any rank raises here. ``rendezvous``
    is a path for a file-based init (a fresh one per call), so no port is ever taken.
    """
    import torch.multiprocessing as mp
    mp.spawn(_group_entry, args=(world, f"file://{rendezvous}", backend, fn, args),
             nprocs=world, join=True)


class PagedAttentionStack:
    """A stack of attention layers over paged caches, the way an engine runs them.

    Each step every request adds ``query_len`` tokens: per layer, the step's new KV rows are
    written into the layer's cache (the KV update) and a single-head attention reads the
    request's context KV plus its new rows (causal). With a :class:`KVPrefetcher` the context
    KV comes from the prefetched slot (what a consuming backend would read); without one it is
    gathered inline, which is the reference. All inputs live in fixed tensors updated in place,
    so a step can be captured into a CUDA graph and replayed.
    """

    def __init__(self, layers: int, *, row: int = 64, block_size: int = 16, requests: int = 3,
                 max_tokens_per_request: int = 96, query_len: int = 1, device="cpu",
                 dtype=torch.float32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layers, self.row, self.block_size, self.requests = layers, row, block_size, requests
        self.query_len, self.device, self.dtype = query_len, torch.device(device), dtype
        per_request = -(-max_tokens_per_request // block_size)
        blocks = requests * per_request + 2
        self.caches = [torch.randn(blocks, block_size, row, generator=gen).to(device, dtype)
                       for _ in range(layers)]
        table = torch.randperm(blocks, generator=gen)[: requests * per_request]
        self.block_table = table.view(requests, per_request).to(device, torch.int32)
        self.context_lens = torch.zeros(requests, dtype=torch.int32, device=device)
        tokens = requests * query_len
        self.queries = torch.zeros(layers, tokens, row, dtype=dtype, device=device)
        self.new_rows = torch.zeros(layers, tokens, row, dtype=dtype, device=device)
        self.capacity = requests * max_tokens_per_request
        self._token_request = torch.arange(requests, device=device).repeat_interleave(query_len)
        self._token_offset = torch.arange(query_len, device=device).repeat(requests)

    def start(self, context_lens: list[int]) -> None:
        """Set each request's tokens already cached (the caches' random rows stand for them)."""
        self.context_lens.copy_(torch.tensor(context_lens, dtype=torch.int32))

    def refill(self, seed: int) -> None:
        """Fresh queries and new KV rows for the next step, written in place."""
        gen = torch.Generator().manual_seed(seed)
        self.queries.copy_(torch.randn(self.queries.shape, generator=gen).to(self.dtype))
        self.new_rows.copy_(torch.randn(self.new_rows.shape, generator=gen).to(self.dtype))

    def advance(self) -> None:
        self.context_lens.add_(self.query_len)

    def source(self, layer: int):
        from ringflow.integrations.vllm.kv_prefetch import KVSource
        return KVSource(self.caches[layer], self.block_table, self.context_lens)

    def step(self, prefetcher=None, outputs: torch.Tensor | None = None,
             snapshots: torch.Tensor | None = None) -> torch.Tensor:
        """One step over all layers; returns ``[layers, tokens, row]`` attention outputs.

        ``snapshots`` (``[layers, capacity, row]``), when given, receives the context KV each
        layer's attention read: the exact thing to compare between a prefetched and an inline
        run (outputs may round differently when a matmul is captured).
        """
        from ringflow.kernels import paged_gather
        out = outputs if outputs is not None else torch.empty_like(self.queries)
        for layer in range(self.layers):
            if prefetcher is not None:
                prefetcher.begin(layer, self.source)
                context = prefetcher.gathered(layer)
            else:
                context = torch.empty(self.capacity, self.row, dtype=self.dtype,
                                      device=self.device)
                paged_gather(self.caches[layer], self.block_table, self.context_lens, context)
            if snapshots is not None:
                snapshots[layer].copy_(context)
            self._write_new_rows(layer)
            out[layer] = self._attend(layer, context)
            if prefetcher is not None:
                prefetcher.end(layer)
        return out

    def _write_new_rows(self, layer: int) -> None:
        pos = self.context_lens.to(torch.int64)[self._token_request] + self._token_offset
        block = self.block_table.to(torch.int64)[self._token_request, pos // self.block_size]
        flat = self.caches[layer].view(-1, self.row)
        flat.index_copy_(0, block * self.block_size + pos % self.block_size, self.new_rows[layer])

    def _attend(self, layer: int, context: torch.Tensor) -> torch.Tensor:
        q, new = self.queries[layer].float(), self.new_rows[layer].float()
        lens = self.context_lens.to(torch.int64)
        ends = torch.cumsum(lens, 0)
        rows = torch.arange(context.shape[0], device=self.device)
        owner = torch.searchsorted(ends, rows, right=True)
        ctx_mask = owner.unsqueeze(0) == self._token_request.unsqueeze(1)
        same = self._token_request.unsqueeze(0) == self._token_request.unsqueeze(1)
        causal = self._token_offset.unsqueeze(0) <= self._token_offset.unsqueeze(1)
        scale = self.row ** -0.5
        scores = torch.cat([(q @ context.float().T) * scale, (q @ new.T) * scale], dim=1)
        mask = torch.cat([ctx_mask, same & causal], dim=1)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
        values = torch.cat([context.float(), new], dim=0)
        return (weights @ values).to(self.dtype)
