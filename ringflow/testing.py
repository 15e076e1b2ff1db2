"""Test helpers users can reuse to check their own plans and executors.

:class:`TracingWorkload` makes every gather write a value that names its (lane, layer, forward,
bucket), and every compute record what it actually read, on the device, without a host sync
(so it also works inside a CUDA graph and across back-to-back forwards). Afterwards,
:meth:`TracingWorkload.check` says whether every read saw exactly the write the plan intended.

:class:`RaceWindows` widens the windows that a plan's orderings close, with device-side delays
sized from measurement (Note [Sizing race windows]).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from ringflow.errors import RingflowError
from ringflow.orchestrator.dag import Dag, NodeKind
from ringflow.timing import elapsed_ms
from ringflow.workload import decoder_block

_FORWARD_STRIDE = 4096   # tag = sign * (1 + forward * 4096 + layer * 16 + lane + bucket * 2^20)
_FORWARDS = 256          # forward numbers wrap here: every tag stays exact in float32
_BUCKET_STRIDE = 1 << 20


class TracingWorkload:
    """Gathers write a tag; computes record the min and max of what they read.

    Tags live in a device tensor refreshed by :meth:`new_forward`, so a captured graph's
    gathers write the *current* forward's tags at every replay, and the reads of the last
    ``history`` forwards are kept on the device (archived by :meth:`new_forward` on the current
    stream), so forwards can run back to back without a host sync and all be checked after.

    Args:
        lanes: lane names, in plan order.
        layers: layers per forward.
        slot_shape: shape of one slot (small: the values are what matter).
        device: where slots live.
        gathered: layers that gather (None: all); others read resident data tagged negative.
        bucket: 0..7, added to every tag, so graphs of different buckets write different values.
        history: forwards whose reads :meth:`check` covers.
        static: lanes whose sources never change (streamed weights; cross-forward lanes): their
            tags name the layer but not the forward, as a weight's bytes do.
    """

    def __init__(self, lanes: Sequence[str], layers: int, slot_shape: Sequence[int] = (4,),
                 device: torch.device | str = "cpu", gathered: Iterable[int] | None = None,
                 dtype: torch.dtype = torch.float32, bucket: int = 0, history: int = 8,
                 static: Iterable[str] = ()) -> None:
        if not 0 <= bucket < 8:
            raise RingflowError(f"bucket must be in 0..7 (tags stay exact in float32), got "
                                f"{bucket}; number the buckets 0..7")
        self.lanes = list(lanes)
        self.layers = layers
        self.device = torch.device(device)
        self.gathered = set(range(layers)) if gathered is None else set(gathered)
        self.dtype = dtype
        self.bucket = bucket
        self.epoch = 0
        n = (len(self.lanes), layers)
        self._sign = torch.tensor([[1.0 if layer in self.gathered else -1.0
                                    for layer in range(layers)] for _ in self.lanes],
                                  dtype=torch.float64, device=self.device)
        base = [[1 + layer * 16 + i + bucket * _BUCKET_STRIDE for layer in range(layers)]
                for i in range(len(self.lanes))]
        self._base = torch.tensor(base, dtype=torch.float64, device=self.device) * self._sign
        self.static = set(static)
        moving = [[0.0 if lane in self.static else 1.0] for lane in self.lanes]
        self._sign = self._sign * torch.tensor(moving, dtype=torch.float64, device=self.device)
        self._tags = torch.empty(n, dtype=dtype, device=self.device)   # this forward's tags
        self.seen_min = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self.seen_max = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self._history: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque(maxlen=history)
        self.resident = torch.empty(tuple(slot_shape), dtype=dtype, device=self.device)
        self._set_tags()

    def tag(self, layer: int, lane: str, epoch: int | None = None) -> float:
        """The value the plan intends layer ``layer`` of ``lane`` to read (exact in fp32)."""
        sign = 1 if layer in self.gathered else -1
        epoch = 0 if lane in self.static else self.epoch if epoch is None else epoch
        return float(sign * (1 + epoch * _FORWARD_STRIDE + layer * 16 + self.lanes.index(lane)
                             + self.bucket * _BUCKET_STRIDE))

    def _set_tags(self) -> None:  # on the current stream: ordered before the next forward
        self._tags.copy_(self._base + self._sign * (self.epoch * _FORWARD_STRIDE))

    def new_forward(self) -> None:
        """Archive this forward's reads, then make the next forward write new values (all on
        the current stream, no host sync); the next forward's reads start as NaN."""
        self._history.append((self.epoch, self.seen_min.clone(), self.seen_max.clone()))
        self.epoch = (self.epoch + 1) % _FORWARDS
        self.seen_min.fill_(float("nan"))
        self.seen_max.fill_(float("nan"))
        self._set_tags()

    def gather(self, layer: int, lane: str, out: torch.Tensor) -> None:
        out.copy_(self._tags[self.lanes.index(lane), layer])  # read at run (and replay) time

    def compute(self, layer: int, lane: str, slot: torch.Tensor | None) -> None:
        i = self.lanes.index(lane)
        if slot is None:
            slot = self.resident
            slot.copy_(self._tags[i, layer])
        flat = slot.reshape(-1).to(torch.float64)
        self.seen_min[i, layer].copy_(flat.amin())
        self.seen_max[i, layer].copy_(flat.amax())

    def expected(self, epoch: int | None = None) -> torch.Tensor:
        return torch.tensor([[self.tag(layer, lane, epoch) for layer in range(self.layers)]
                             for lane in self.lanes], dtype=torch.float64)

    def mismatches(self, *, all_forwards: bool = False) -> list[tuple]:
        """``(lane, layer, expected, seen_min, seen_max)`` for every read of the current forward
        that saw another write; ``all_forwards`` also checks the archived ones (each entry then
        starts with the forward's number)."""
        forwards = [(self.epoch, self.seen_min, self.seen_max)]
        if all_forwards:
            forwards = [(e, lo, hi) for e, lo, hi in self._history
                        if not torch.isnan(lo).all()] + forwards
        bad = []
        for epoch, lo, hi in forwards:
            want, lo, hi = self.expected(epoch), lo.cpu(), hi.cpu()
            for i, lane in enumerate(self.lanes):
                for layer in range(self.layers):
                    w, a, b = float(want[i, layer]), float(lo[i, layer]), float(hi[i, layer])
                    if not (a == w and b == w):
                        bad.append(((epoch,) if all_forwards else ()) + (lane, layer, w, a, b))
        return bad

    def check(self, *, all_forwards: bool = False) -> None:
        """Raise AssertionError listing the reads that did not see their intended write."""
        bad = self.mismatches(all_forwards=all_forwards)
        assert not bad, f"{len(bad)} read(s) saw the wrong data, e.g. {bad[:3]}"


class RaceWindows:
    """Seeded random device-side delays before gathers (producer) and before computes'
    reads (consumer), long enough to open every window a plan's orderings close.

    Note [Sizing race windows]
        A missing ordering shows only if the two racing operations really overlap on the
        device. Eagerly, the host issues a slot's writer and its reader some nodes apart; the
        device may finish the writer before the host even issues the reader, and then a
        missing READY wait changes nothing. A delay placed on the device before the writer
        (producer side) that is longer than the host's issue time between the two makes the
        reader run first unless it waits; a delay before a reader (consumer side) does the
        same for the next writer of its slot (RETIRE), for the next forward's first gathers
        (FORK) and for a replay on another stream. So the delay is sized as
        ``factor x`` (host issue time per node, measured on the plan's own callables) ``x``
        (the largest number of nodes between a record and its wait in the plan), and converted
        to GPU cycles with the sleep rate measured here. Each gather and compute is delayed
        with probability ``p``, drawn from a seeded generator, so a failing run can be replayed.
        Inside a CUDA graph every branch starts at launch, so the same delays outlast the
        competing kernel instead.

    Args:
        cycles: the delay, in GPU cycles (see :meth:`measured`).
        seed: seeds the per-node draws.
        probability: chance that a given gather or compute is delayed.
    """

    def __init__(self, cycles: int, seed: int, probability: float = 0.5) -> None:
        self.cycles = int(cycles)
        self.probability = probability
        self._rng = random.Random(seed)
        self.delays = 0

    @staticmethod
    def cycles_per_second(device: torch.device | str = "cuda") -> float:
        """GPU sleep rate, timed with events around ``torch.cuda._sleep``."""
        with torch.cuda.device(device):
            torch.cuda._sleep(1000)  # load the kernel
            return 2_000_000 / (elapsed_ms(lambda: torch.cuda._sleep(2_000_000)) / 1e3)

    @staticmethod
    def issue_seconds_per_node(run: Callable[[], None], nodes: int, repeats: int = 5) -> float:
        """Host time per node of ``run()`` (one forward issued with its real callables)."""
        run()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
            torch.cuda.synchronize()
        return best / max(nodes, 1)

    @staticmethod
    def widest_gap(dag: Dag) -> int:
        """The most nodes between a record and a wait on its event (issue order), at least 1."""
        last: dict[str, int] = {}
        gap = 1
        for node in dag.nodes:
            if node.kind is NodeKind.RECORD:
                last[node.event] = node.id
            elif node.kind is NodeKind.WAIT and node.event in last:
                gap = max(gap, node.id - last[node.event])
        return gap

    @classmethod
    def measured(cls, dag: Dag, run: Callable[[], None], *, seed: int, factor: float = 4.0,
                 probability: float = 0.5, floor_seconds: float = 50e-6) -> RaceWindows:
        """Windows for ``dag`` issued by ``run`` (Note [Sizing race windows])."""
        per_node = cls.issue_seconds_per_node(run, len(dag.nodes))
        seconds = max(factor * per_node * cls.widest_gap(dag), floor_seconds)
        return cls(seconds * cls.cycles_per_second(), seed, probability)

    def delay(self) -> None:
        """Maybe sleep on the current stream (a seeded draw)."""
        if self._rng.random() < self.probability:
            self.delays += 1
            torch.cuda._sleep(self.cycles)

    def producer(self, gather):
        """``gather`` with a chance of a delay before it writes (on its own stream)."""
        def delayed(layer, lane, out):
            self.delay()
            return gather(layer, lane, out)
        return delayed

    def consumer(self, compute):
        """``compute`` with a chance of a delay before it reads its slot."""
        def delayed(layer, lane, slot):
            self.delay()
            return compute(layer, lane, slot)
        return delayed


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
