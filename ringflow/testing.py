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
