"""HostExperts: one MoE layer's host share of a step, computed on the CPU beside the GPU's own.

Note [Host experts]
    A decode step hands part of a layer's misses to the host (Note [Host split]); per step, on
    the layer's stream (``launch`` then ``join``):

    1. ``stage``: the step's token count, rows, choices, router weights and the experts marked
       for the host (``ExpertCache.host_mine``) are copied into pinned buffers sized for
       ``max_tokens`` tokens (a small device-to-host copy, stream-ordered);
    2. the host node is posted (Note [Host node]); its worker computes the marked experts'
       rows from the host store with ``kernels/host_moe.moe_on_host`` into a pinned float32
       output, while the stream goes on with the GPU's passes over the slots;
    3. ``join``: the stream waits for the worker, copies the output to the device and the
       lane adds it to the GPU's sum (``sum``), in float32, cast once.

    The token count travels with the rows (a fill of the step's count, a constant of its
    shape, so a replayed graph stages its own), and the worker computes only those rows. The
    output buffers are the host's alone between ``launch`` and ``join``: a step's ``stage``
    follows the previous step's ``join`` on the same stream. The host store is read where it
    lies: pinned host tensors, or the host memory behind a CUDA view of pinned memory (vLLM's
    UVA offloader), which the CPU reads at the same address.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ringflow.errors import ConfigError, KernelError
from ringflow.graphs.host_node import HostNode
from ringflow.kernels.host_moe import moe_on_host
from ringflow.orchestrator.expert_hazards import ExpertOp


def cpu_view(t: torch.Tensor, copy_device: bool = False) -> torch.Tensor:
    """``t`` as a CPU tensor: itself on the CPU; for a CUDA view of pinned host memory, a CPU
    tensor over the same bytes (the host's address of them); a tensor in device memory is
    copied when ``copy_device`` (fp8 scales: a few KiB), else refused."""
    if t.device.type == "cpu":
        return t
    import ctypes

    from ringflow import cudart
    if not t.is_contiguous() or not cudart.in_host_memory(t.data_ptr()):
        if copy_device:
            return t.detach().cpu()
        raise ConfigError(f"the host computes experts from host memory; a {tuple(t.shape)} "
                          f"tensor on {t.device} is device memory (or not contiguous)")
    nbytes = t.numel() * t.element_size()
    raw = (ctypes.c_byte * nbytes).from_address(cudart.host_address(t.data_ptr()))
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)


def host_store(host: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's host store as the CPU reads it: the weights where they lie, the fp8 scales
    copied where they are in device memory."""
    return {name: cpu_view(t, copy_device=name.endswith("_scale")) for name, t in host.items()}


class HostExperts:
    """Layer ``layer``'s host share (Note [Host experts]): computes from ``host`` (the cache's
    host store: ``w13``, ``w2`` and, for fp8, their scales) for steps of at most
    ``max_tokens`` tokens of ``hidden`` columns, ``top_k`` choices each, on ``device``."""

    def __init__(self, host: Mapping[str, torch.Tensor], hidden: int, top_k: int,
                 max_tokens: int, device: torch.device | str, dtype: torch.dtype,
                 layer: int, threads: int = 0) -> None:
        if max_tokens < 1:
            raise ConfigError(f"the host share needs max_tokens >= 1, got {max_tokens}")
        self.host = host_store(host)
        self.experts = self.host["w13"].shape[0]
        self.device = torch.empty(0, device=device).device
        self.max_tokens, self.layer = max_tokens, layer
        pin = self.device.type == "cuda"

        def buffer(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.rows = buffer(max_tokens, hidden, dtype=dtype)
        self.ids = buffer(max_tokens, top_k, dtype=torch.int64)
        self.weights = buffer(max_tokens, top_k)
        self.mine = buffer(self.experts, dtype=torch.bool)
        self.count = buffer(1, dtype=torch.int64)
        self.out = buffer(max_tokens, hidden).fill_(float("nan"))
        self._count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._out = torch.full((max_tokens, hidden), float("nan"), device=self.device)
        self.computed = 0  # experts the host computed, counted by the worker
        self.node = HostNode(self._work, self.device, f"ringflow/experts/host/L{layer}",
                             fail=lambda: self.out.fill_(float("nan")), threads=threads)
        self.stream_name = f"host/L{layer}"

    @property
    def bytes(self) -> int:
        """Device bytes of the output it copies back (the pinned buffers are host memory)."""
        return self._out.numel() * self._out.element_size()

    def _work(self) -> None:
        t = int(self.count[0])
        if not 0 <= t <= self.max_tokens:
            raise KernelError(f"the host was staged {t} tokens; it holds {self.max_tokens}")
        self.computed += moe_on_host(
            self.rows[:t], self.host["w13"], self.host["w2"], self.weights[:t], self.ids[:t],
            self.mine, self.out[:t], self.host.get("w13_scale"), self.host.get("w2_scale"))

    def launch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               mine: torch.Tensor, trace: list | None = None) -> None:
        """Stage the step and post the host node (steps 1 and 2), on the current stream."""
        t = x.shape[0]
        if t > self.max_tokens:
            raise KernelError(f"a step of {t} tokens is larger than the host share's "
                              f"{self.max_tokens}")
        self._count.fill_(t)
        for dst, src in ((self.count, self._count), (self.rows[:t], x),
                         (self.ids[:t], topk_ids), (self.weights[:t], topk_weights),
                         (self.mine, mine[:self.experts])):
            dst.copy_(src, non_blocking=True)
        if trace is not None:
            trace.append(ExpertOp("stage", _stream(self.device)))
            trace.append(ExpertOp("wait", self.stream_name, on=_stream(self.device)))
            picked = mine[:self.experts].nonzero().flatten().tolist()
            trace.append(ExpertOp("cpu", self.stream_name, tuple((e, e) for e in picked)))
        self.node.post()

    def join(self, tokens: int, trace: list | None = None) -> torch.Tensor:
        """The host's rows [tokens, hidden] in float32 on the device, read after the worker
        finished (step 3), on the current stream."""
        self.node.join()
        if trace is not None:
            trace.append(ExpertOp("wait", _stream(self.device), on=self.stream_name))
            trace.append(ExpertOp("sum", _stream(self.device)))
        return self._out[:tokens].copy_(self.out[:tokens], non_blocking=True)

    def close(self) -> None:
        self.node.close()

    def describe(self) -> dict:
        return {"max_tokens": self.max_tokens, "computed": self.computed,
                **self.node.describe()}


def _stream(device: torch.device) -> object:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else "cpu"


def measure_expert_ms(host: Mapping[str, torch.Tensor], tokens=(1, 2, 4, 8, 16),
                      repeats: int = 3, hidden_dtype: torch.dtype | None = None
                      ) -> dict[int, float]:
    """Milliseconds the host takes for one expert of ``host`` (a layer's store) with ``t``
    tokens, for each ``t`` of ``tokens``: ``moe_on_host`` as a step runs it, each run on
    another expert (so its weights come from memory, not the CPU's caches), the median of
    ``repeats`` rounds over the layer's experts (at most 16 per round)."""
    import statistics
    import time
    store = host_store(host)
    w13 = store["w13"]
    experts, width = w13.shape[0], w13.shape[2]
    dtype = hidden_dtype or (w13.dtype if "w13_scale" not in store else torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    order = torch.randperm(experts, generator=g).tolist()
    for t in tokens:
        rows = torch.randn(t, width, generator=g).to(dtype)
        weights = torch.ones(t, 1)
        result = torch.empty(t, width)
        rounds = []
        for _ in range(repeats):
            picks = order[:min(16, experts)]
            order = order[len(picks):] + picks
            start = time.perf_counter()
            for e in picks:
                mine = torch.zeros(experts, dtype=torch.bool)
                mine[e] = True
                moe_on_host(rows, w13, store["w2"], weights, torch.full((t, 1), e), mine,
                            result, store.get("w13_scale"), store.get("w2_scale"))
            rounds.append(1e3 * (time.perf_counter() - start) / len(picks))
        out[t] = statistics.median(rounds)
    return out


def measure_handoff_ms(device: torch.device | str, repeats: int = 20,
                       join_by: str = "host_function") -> float:
    """Milliseconds a host node with no work adds to a stream (post, the worker's wake-up and
    its done, the join): timed with CUDA events on a GPU, on the host's clock on the CPU."""
    import statistics
    import time
    node = HostNode(lambda: None, device, "ringflow/experts/host/handoff", join_by=join_by)
    try:
        times = []
        for _ in range(repeats + 3):
            if node.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                node.post()
                node.join()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                start = time.perf_counter()
                node.post()
                node.join()
                times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times[3:])
    finally:
        node.close()
