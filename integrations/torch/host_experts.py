"""HostExperts: the expert lane's host share of a step, computed on the CPU beside the GPU's own.

Note [Host experts]
    A decode step hands part of each chosen layer's misses to the host (Note [Host split]);
    per layer, on the layer's stream (``launch`` then ``join``):

    1. ``stage``: the step's token count and layer, rows, choices, router weights and the
       experts marked for the host (``ExpertCache.host_mine``) are copied into pinned buffers
       sized for ``max_tokens`` tokens (small device-to-host copies, stream-ordered). The
       cache marks them before it installs the step's other misses, so staging and the
       host's work overlap the copies, not just the GPU's MoE;
    2. the stream rings the host node's doorbell (Note [Host node]); its worker (compiled
       ``kernels/host_moe.serve_experts``) computes the marked experts' rows from that
       layer's host store into a pinned output, one row per (token, choice) in the model's
       dtype, times its router weight (zeros at the GPU's choices), while the stream goes on
       with the installs and the GPU's pass;
    3. ``join``, called by the lane's compute at its sum (after the GPU's products): the
       stream waits for the worker and copies the rows to the device; the compute puts them
       at their choices among its own rows and sums each token's rows once (``sum``), as the
       resident layer does; the rows are rounded as the kernel rounds its own (Note [Host
       rows round as the kernel] in kernels/host_moe.py). A separate float32 sum of the
       host's rows added to the GPU's (the first design) rounded every output element
       otherwise than the resident layer; one sum leaves only the rows' own rounding.

    One worker and one set of buffers serve every chosen layer: the layers run one after
    another on one stream, so a layer's ``stage`` follows the previous layer's ``join`` (a
    launch before the last one's join, or a join without its launch, whose wait no run would
    ever answer, raises instead of reaching the stream), and
    one thread keeps its CPU thread pool warm from layer to layer. The worker counts, per
    layer, its runs and the experts it computed (``counts``), replays included. The token
    count and the layer travel with the rows (copied from a device table of both, a fixed
    address per step shape and layer, so a replayed graph stages its own), and the worker
    computes only those rows, from that layer's store. The host store is read where it lies:
    pinned host tensors, or the host memory behind a CUDA view of pinned memory (vLLM's UVA
    offloader), which the CPU reads at the same address.

    A worker that raises logs once, marks its outputs NaN from then on and makes the next
    eager step raise (Note [Host node]); under a replayed CUDA graph no Python runs to raise,
    so the rows it returns are NaN and the report names the error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from ringflow.errors import ConfigError, KernelError
from ringflow.graphs import nvtx_ranges
from ringflow.graphs.host_node import HostNode, idle_polls_for
from ringflow.graphs.streams import dedicated_streams
from ringflow.kernels.host_moe import scripted
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
    """The lane's host share (Note [Host experts]): computes, for each chosen layer of
    ``stores`` (layer → its cache's host store: ``w13``, ``w2`` and, for fp8, their scales),
    steps of at most ``max_tokens`` tokens of ``hidden`` columns, ``top_k`` choices each, on
    ``device``, with ``threads`` CPU threads (0: torch's default); its worker parks after
    about ``idle_ms`` milliseconds without a doorbell (0: never; Note [An idle worker parks]
    in graphs/host_node.py)."""

    def __init__(self, stores: Mapping[int, Mapping[str, torch.Tensor]], hidden: int,
                 top_k: int, max_tokens: int, device: torch.device | str, dtype: torch.dtype,
                 threads: int = 0, idle_ms: float = 0.0) -> None:
        if idle_ms < 0:
            raise ConfigError(f"the host share's idle time before its worker parks is >= 0 "
                              f"ms (0: never), got {idle_ms}")
        if max_tokens < 1:
            raise ConfigError(f"the host share needs max_tokens >= 1, got {max_tokens}")
        if not stores:
            raise ConfigError("the host share needs at least one layer's host store")
        self.stores = {layer: host_store(host) for layer, host in sorted(stores.items())}
        counts = {layer: s["w13"].shape[0] for layer, s in self.stores.items()}
        if len(set(counts.values())) != 1:
            raise ConfigError(f"the host share's layers must have one expert count: {counts}")
        self.experts = next(iter(counts.values()))
        for layer, store in self.stores.items():  # Note [Host rows round as the kernel]
            for name in ("w13", "w2"):
                scale = store.get(f"{name}_scale")
                if scale is not None and scale.dim() == 3 and store[name].shape[2] % scale.shape[2]:
                    raise ConfigError(
                        f"layer {layer}'s {name} has {store[name].shape[2]} input columns in "
                        f"{scale.shape[2]} fp8 blocks: the host quantizes its inputs per whole "
                        f"block, as vLLM's kernel does; set experts.host_share to off")
        self.layers = tuple(self.stores)
        self._position = {layer: p for p, layer in enumerate(self.layers)}
        self.device = torch.empty(0, device=device).device
        self.max_tokens = max_tokens
        pin = self.device.type == "cuda"

        def buffer(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.rows = buffer(max_tokens, hidden, dtype=dtype)
        self.ids = buffer(max_tokens, top_k, dtype=torch.int64)
        self.weights = buffer(max_tokens, top_k)
        self.mine = buffer(self.experts, dtype=torch.bool)
        self.meta = buffer(2, dtype=torch.int64)  # the step's tokens, its layer's position
        self.out = buffer(max_tokens, top_k, hidden, dtype=dtype).fill_(float("nan"))
        # (tokens, position) for every step size and layer: one row is staged per step
        self._metas = torch.tensor([[[t, p] for t in range(max_tokens + 1)]
                                    for p in range(len(self.layers))], device=self.device)
        self._out = torch.full((max_tokens, top_k, hidden), float("nan"), dtype=dtype,
                               device=self.device)
        self.counts = torch.zeros(len(self.layers), 2, dtype=torch.int64)  # runs, experts
        stores = list(self.stores.values())
        self.node = HostNode(
            scripted("serve_experts"),
            (self.meta, self.rows, self.ids, self.weights, self.mine, self.out,
             [s["w13"] for s in stores], [s["w2"] for s in stores],
             [s.get("w13_scale") for s in stores], [s.get("w2_scale") for s in stores],
             self.counts, [f"ringflow/experts/host/L{layer}" for layer in self.layers],
             idle_polls_for(idle_ms)),
            self.device, "ringflow/experts/host", fail=lambda: self.out.fill_(float("nan")),
            threads=threads, ranges=nvtx_ranges.host_thread_ranges)
        self.stream_name = "host"
        self._launched: int | None = None  # the layer launched and not yet joined

    @property
    def bytes(self) -> int:
        """Device bytes of the output it copies back and its table (the pinned buffers are
        host memory)."""
        return sum(t.numel() * t.element_size() for t in (self._out, self._metas))

    def launch(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, mine: torch.Tensor, trace: list | None = None) -> None:
        """Stage layer ``layer``'s step and ring the host's doorbell (steps 1 and 2), on the
        current stream."""
        if self._launched is not None:
            raise KernelError(f"layer {layer}'s host share was launched before layer "
                              f"{self._launched}'s was joined: the worker has one set of "
                              f"buffers, so each launch needs its join first")
        t = x.shape[0]
        if t > self.max_tokens:
            raise KernelError(f"a step of {t} tokens is larger than the host share's "
                              f"{self.max_tokens}")
        lane = _stream(self.device)
        for dst, src in ((self.meta, self._metas[self._position[layer], t]),
                         (self.rows[:t], x), (self.ids[:t], topk_ids),
                         (self.weights[:t], topk_weights), (self.mine, mine[:self.experts])):
            dst.copy_(src, non_blocking=True)
        if trace is not None:
            trace.append(ExpertOp("stage", lane))
        self.node.post()
        self._launched = layer
        if trace is not None:
            picked = mine[:self.experts].nonzero().flatten().tolist()
            trace += [ExpertOp("wait", self.stream_name, on=lane),
                      ExpertOp("cpu", self.stream_name, tuple((e, e) for e in picked))]

    def join(self, tokens: int, trace: list | None = None) -> torch.Tensor:
        """The host's rows [tokens, top_k, hidden] on the device, each choice's row times its
        weight, zeros at the choices it was not handed; read after the worker finished (step
        3), on the current stream. Once per launch: a second join would wait for a run that
        never comes (the stream for good), so it is refused."""
        if self._launched is None:
            raise KernelError("the host share was joined without a launch: its stream would "
                              "wait for the worker for good")
        self._launched = None
        self.node.join()
        if trace is not None:
            lane = _stream(self.device)
            trace += [ExpertOp("wait", lane, on=self.stream_name), ExpertOp("sum", lane)]
        return self._out[:tokens].copy_(self.out[:tokens], non_blocking=True)

    def close(self) -> None:
        self.node.close()

    def describe(self, layer: int) -> dict:
        """Layer ``layer``'s share of the host's work: its runs and the experts it computed
        (counted by the worker, replays included)."""
        runs, computed = self.counts[self._position[layer]].tolist()
        return {"max_tokens": self.max_tokens, "computed": computed, "runs": runs,
                "parks": self.node.parks,
                "error": repr(self.node.error) if self.node.error is not None else None}

    def wake(self) -> None:
        """A step is about to start: a parked worker enters its loop again now (Note [An
        idle worker parks])."""
        self.node.wake()


def _stream(device: torch.device) -> object:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else "cpu"


def measure_expert_ms(host: Mapping[str, torch.Tensor], tokens=(1, 2, 4, 8, 16),
                      repeats: int = 3, hidden_dtype: torch.dtype | None = None,
                      threads: int = 0) -> dict[int, float]:
    """Milliseconds the host share takes for one expert of ``host`` (a layer's store) with
    ``t`` tokens, for each ``t`` of ``tokens``: a step staged, rung and joined through the
    host share's own worker with ``threads`` CPU threads (0: torch's default), on the CPU's
    side (so with the handoff's few microseconds of polling), each run on another expert (so
    its weights come from memory, not the CPU's caches); the median of ``repeats`` rounds
    over the layer's experts (at most 16 per round)."""
    import statistics
    store = host_store(host)
    w13 = store["w13"]
    experts, width = w13.shape[0], w13.shape[2]
    dtype = hidden_dtype or (w13.dtype if "w13_scale" not in store else torch.bfloat16)
    share = HostExperts({0: store}, width, 1, max(tokens), "cpu", dtype, threads)
    g = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    order = torch.randperm(experts, generator=g).tolist()
    masks = torch.eye(experts, dtype=torch.bool)
    try:
        for t in tokens:
            rows = torch.randn(t, width, generator=g).to(dtype)
            weights = torch.ones(t, 1)
            rounds = []
            for _ in range(repeats):
                picks = order[:min(16, experts)]
                order = order[len(picks):] + picks
                ids = [torch.full((t, 1), e) for e in picks]
                start = time.perf_counter()
                for e, chose in zip(picks, ids):
                    share.launch(0, rows, weights, chose, masks[e])
                    share.join(t)
                rounds.append(1e3 * (time.perf_counter() - start) / len(picks))
            out[t] = statistics.median(rounds)
    finally:
        share.close()
    return out


class CopyLoad:
    """Pinned host-to-device copies of ``mib`` MiB in a loop on a side stream of ``device``
    while the host measures: the memory bus as a step has it, the lane's copies running beside
    the host's work. On the H200 machine an expert took 0.35 ms under such copies against 0.25
    alone (tools/host_rates.py); the copies kept their 55 GB/s."""

    def __init__(self, device: torch.device | str, mib: int) -> None:
        self.src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty_like(self.src, device=device)
        # ringflow's own stream (Note [Dedicated streams]): torch's pool may hand out the
        # stream vLLM captures on
        self.stream = dedicated_streams(self, self.dst.device, ["host-rates-copy-load"],
                                        priority=0)["host-rates-copy-load"]
        self.bytes, self.seconds, self._stop = 0, 0.0, threading.Event()

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            start = time.perf_counter()
            while not self._stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.bytes += self.src.numel()
            self.seconds = time.perf_counter() - start

    def __enter__(self) -> CopyLoad:
        self._thread = threading.Thread(target=self._run, name="ringflow/copy-load",
                                        daemon=True)
        self._thread.start()
        time.sleep(0.05)  # copying before the measurement starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def fastest_threads(host: Mapping[str, torch.Tensor], counts) -> tuple[int, dict[int, float]]:
    """Of the thread counts ``counts``, the one with which the host share's worker computes an
    expert of ``host`` for one token fastest (the fewest on a tie), and its times by tokens
    (``measure_expert_ms``). More threads are not always faster: on the H200 machine's 16
    cores an expert took 0.25 ms with 8 threads and 0.34 ms with 16 (tools/host_rates.py),
    each of a GEMV's few ops waiting for its slowest thread."""
    measured = {n: measure_expert_ms(host, threads=n) for n in sorted(set(counts))}
    best = min(measured, key=lambda n: (measured[n][1], n))
    return best, measured[best]


def measure_handoff_ms(host: Mapping[str, torch.Tensor], device: torch.device | str,
                       repeats: int = 20) -> float:
    """Milliseconds the host share adds to a stream for a step that hands the host nothing
    (its staging, the doorbell, the worker's poll and done, the join, the copy back), over a
    layer's store ``host``: timed with CUDA events on a GPU, on the host's clock on the CPU."""
    import statistics
    store = host_store(host)
    width = store["w13"].shape[2]
    dtype = store["w13"].dtype if "w13_scale" not in store else torch.bfloat16
    share = HostExperts({0: store}, width, 1, 1, device, dtype)
    x = torch.empty(0, width, dtype=dtype, device=share.device)
    weights = torch.empty(0, 1, device=share.device)
    ids = torch.empty(0, 1, dtype=torch.int64, device=share.device)
    mine = torch.zeros(share.experts, dtype=torch.bool, device=share.device)
    try:
        times = []
        for _ in range(repeats + 3):
            if share.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                share.launch(0, x, weights, ids, mine)
                share.join(0)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                start = time.perf_counter()
                share.launch(0, x, weights, ids, mine)
                share.join(0)
                times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times[3:])
    finally:
        share.close()
