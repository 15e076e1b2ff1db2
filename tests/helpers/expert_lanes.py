"""Shared pieces of the expert lane's tests (tests/unit/test_expert_layers.py, the layer ring;
tests/unit/test_expert_arena.py, the arena): small random layers and routings, one step
through every chosen layer against the float64 MoE, a slow GPU reader, and a captured small
step replayed after large steps."""

from __future__ import annotations

import torch

from ringflow.integrations.torch.expert_lane import TorchCompute
from ringflow.kernels.reference import moe_ref

E, H, I, K = 12, 16, 8, 3
LAYERS = (1, 3, 4, 6)  # decoder indices of the chosen MoE layers
SIZES = [8, 1, 2, 9, 12, 1, 6, 5, 7, 7, 1]  # >= 6 tokens: large steps; fewer: the slot cache


def layer_experts(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w13": torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
            "w2": torch.randn(E, H, I, generator=g) / I ** 0.5}


def hosts_on(device) -> dict[int, dict[str, torch.Tensor]]:
    """Each chosen layer's host store, pinned where the lane is on a GPU."""
    hosts = {i: layer_experts(i) for i in LAYERS}
    if str(device) != "cpu":
        hosts = {i: {k: v.pin_memory() for k, v in h.items()} for i, h in hosts.items()}
    return hosts


def on_a_gpu(make_lane, slow: int, **kwargs):
    """``make_lane(device="cuda", stream=..., **kwargs)`` on ringflow's own copy stream, each
    layer's compute a ``SlowCompute(slow)``."""
    from ringflow.graphs.streams import dedicated_streams
    owner = type("Owner", (), {})()
    stream = dedicated_streams(owner, torch.device("cuda", 0), ["copy"], 0)["copy"]
    lane, hosts = make_lane(device="cuda", stream=stream, **kwargs)
    lane.computes = {i: SlowCompute(slow) for i in LAYERS}
    lane._owner = owner  # the stream lives as long as its owner
    return lane, hosts


def routing(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, K, generator=g), -1)


def run_step(lane, hosts, tokens: int, seed: int, device="cpu"):
    """One step through every chosen layer; returns each layer's output and its float64 want."""
    g = torch.Generator().manual_seed(seed)
    got, want = {}, {}
    for i in LAYERS:
        ids, weights = routing(seed * 31 + i, tokens)
        x = torch.randn(tokens, H, generator=g)
        got[i] = lane.forward(i, x.to(device), weights.to(device), ids.to(device))
        want[i] = moe_ref(x, hosts[i]["w13"], hosts[i]["w2"], weights, ids)
    return got, want


def assert_exact(got, want) -> None:
    for i in LAYERS:
        torch.testing.assert_close(got[i].double().cpu(), want[i], rtol=1e-5, atol=1e-5)


class SlowCompute(TorchCompute):
    """The torch MoE after ~``cycles`` GPU clock cycles of sleep on the compute stream: a copy
    that does not wait for the read's retire lands while the read is still to come."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def __call__(self, x, weights, *args, **kwargs):
        torch.cuda._sleep(self.cycles)
        return super().__call__(x, weights, *args, **kwargs)


def replay_small_step_after_large_steps(lane, hosts, steps: int = 4) -> None:
    """Capture a small step of every chosen layer once (two tokens), then ``steps`` times run
    a large step eagerly and replay the graph with a new routing into outputs poisoned
    first: each replay must equal the float64 MoE (what a large step left in flight, its
    carried fills, must be waited for inside the graph)."""
    dev = torch.device("cuda", 0)
    ids_in = torch.zeros(2, K, dtype=torch.int64, device=dev)
    weights_in = torch.zeros(2, K, device=dev)
    hidden_in = torch.zeros(2, H, device=dev)
    outs = {i: torch.empty(2, H, device=dev) for i in LAYERS}

    def small_step():
        for i in LAYERS:
            outs[i].copy_(lane.forward(i, hidden_in, weights_in, ids_in))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        small_step()  # warm: the caches' kernels compiled, their state allocated
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_step()
    g = torch.Generator().manual_seed(8)
    for s in range(steps):
        run_step(lane, hosts, 8, 40 + s, device="cuda")
        ids, w = routing(90 + s, 2)
        hidden = torch.randn(2, H, generator=g)
        ids_in.copy_(ids)
        weights_in.copy_(w)
        hidden_in.copy_(hidden)
        for out in outs.values():
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in LAYERS:
            want = moe_ref(hidden, hosts[i]["w13"], hosts[i]["w2"], w, ids)
            torch.testing.assert_close(outs[i].cpu().double(), want, rtol=1e-5, atol=1e-5)
