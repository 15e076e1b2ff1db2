"""Reference models for tests and benchmarks: a Llama-style decoder layer with vLLM's calling
convention (and the math the synthetic workload's decoder compute shares), and a stack of
paged attention layers run the way an engine runs them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringflow.units import ceil_div


def decoder_weights(flat: torch.Tensor, hidden: int, intermediate: int) -> list[torch.Tensor]:
    """Views of one decoder layer's weights in a flat buffer: QKV, O, gate/up, down, norms."""
    h, i = hidden, intermediate
    shapes = [(3 * h, h), (h, h), (2 * i, h), (h, i), (2, h)]
    views, start = [], 0
    flat = flat.reshape(-1)
    for rows, cols in shapes:
        views.append(flat[start: start + rows * cols].view(rows, cols))
        start += rows * cols
    return views


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


def decoder_block(residual: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, norms: torch.Tensor, *,
                  heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama decoder layer over ``residual`` ([tokens, hidden]); returns (hidden, residual).

    RMSNorm, fused QKV projection, causal attention over the tokens (no KV cache), output
    projection, RMSNorm, fused gate/up projection, SiLU, down projection.
    """
    x = _rms(residual, norms[0])
    tokens, width = x.shape
    # [1, heads, tokens, head_dim]: 4-D inputs take the flash kernel (3-D falls back to math,
    # which materialises a tokens x tokens matrix per head)
    q, k, v = (x @ qkv.T).view(1, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    residual = attn[0].transpose(0, 1).reshape(tokens, width) @ o.T + residual
    x = _rms(residual, norms[1])
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.T, residual


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
        per_request = ceil_div(max_tokens_per_request, block_size)
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
        self.before_read: Callable[[], None] | None = None  # e.g. a delay before each read

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
        from ringflow.integrations.torch.kv_prefetch import KVSource
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
                if self.before_read is not None:
                    self.before_read()
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
