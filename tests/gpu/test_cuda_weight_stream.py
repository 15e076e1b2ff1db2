"""The vLLM plugin's CUDA paths on a GPU, with torch modules of real 7B decoder-layer shapes
(vLLM itself cannot be installed on the GPU machine): weights streamed from pinned host memory
on a side stream, eagerly and inside an outer CUDA graph capture like vLLM's graph wrapper."""

import gc

import pytest
import torch

from ringflow import AllocationError, CaptureError
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.testing.models import decoder_stack, run_stack

pytestmark = pytest.mark.cuda
LAYERS, TOKENS = 6, 16
SLEEP = 500_000  # ~0.25 ms on the copy stream before every gather: widens race windows


def model():
    torch.manual_seed(0)
    layers = decoder_stack(LAYERS, device="cuda")  # 7B shapes, bf16: ~405 MB per layer
    inputs = [torch.randn(TOKENS, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        want = [run_stack(layers, x) for x in inputs]
    return layers, inputs, want


def layer_bytes(layer):
    return sum(p.untyped_storage().nbytes() for p in layer.parameters())


@torch.no_grad()
@pytest.mark.parametrize("offload,depth", [([1, 2, 4, 5], 1), ([0, 1, 2, 3, 4], 2)])
def test_eager_streaming_is_bit_identical_and_frees_the_offloaded_weights(offload, depth):
    layers, inputs, want = model()
    per_layer = layer_bytes(layers[0])
    gc.collect()  # an earlier test's streamed model is cyclic garbage (layer <-> its wrapper)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ws = WeightStreamer(layers, offload, depth=depth, workspace_bytes=4 << 30, poison=True)
    after = torch.cuda.memory_allocated()
    # the device keeps the resident layers and the ring only
    assert before - after == len(offload) * per_layer - ws.reserved_bytes
    assert ws.pool.slots == depth + 1
    ws.gather_hook = lambda: torch.cuda._sleep(SLEEP)
    for _ in range(2):
        for x, w in zip(inputs, want):
            assert torch.equal(run_stack(layers, x), w)
    torch.cuda.synchronize()
    assert ws.pool.free_count + len(ws.pool.carried) == ws.pool.slots
    ws.close()


@torch.no_grad()
@pytest.mark.parametrize("policy", ["join", "sync"])
def test_streaming_inside_an_outer_capture_like_vllms_graph_wrapper(policy):
    layers, inputs, want = model()
    ws = WeightStreamer(layers, [1, 2, 4, 5], depth=1, workspace_bytes=4 << 30, poison=True,
                        capture=policy)
    ws.gather_hook = lambda: torch.cuda._sleep(SLEEP)
    static_in = inputs[0].clone()
    run_stack(layers, static_in)  # warm-up outside the capture, as vLLM's profile run is
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()  # vLLM captures on a dedicated stream of its own
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        static_out = run_stack(layers, static_in)
    assert ws.pool.free_count + len(ws.pool.carried) == ws.pool.slots
    for _ in range(3):
        for x, w in zip(inputs, want):
            static_in.copy_(x)
            graph.replay()
            assert torch.equal(static_out, w)
    torch.cuda.synchronize()
    assert torch.equal(run_stack(layers, inputs[1]), want[1])  # eager again after capture
    ws.close()


@torch.no_grad()
@pytest.mark.parametrize("policy", ["join", "sync"])
def test_a_replay_right_after_a_weight_write_reads_the_new_weights(policy):
    """Note [Prime at the write]: an engine's captured graph (a vLLM FULL decode step) is
    replayed right after a reload, with no forward of ringflow's in between: its first layers
    read the carried slots, which must already hold the new weights (mutant
    skip-prime-at-write: they hold the old ones)."""
    layers, inputs, _ = model()
    gen = torch.Generator("cuda").manual_seed(5)
    new = {n: p + 0.05 * torch.randn(p.shape, device="cuda", generator=gen, dtype=p.dtype)
           for n, p in layers.named_parameters()}
    fresh = [copy_layer(layer) for layer in layers]
    for name, param in torch.nn.ModuleList(fresh).named_parameters():
        param.copy_(new[name])
    want = [run_stack(fresh, x) for x in inputs]
    del fresh
    ws = WeightStreamer(layers, [0, 1, 3, 4], depth=1, workspace_bytes=4 << 30, poison=True,
                        capture=policy)
    ws.gather_hook = lambda: torch.cuda._sleep(SLEEP)
    static_in = inputs[0].clone()
    run_stack(layers, static_in)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        static_out = run_stack(layers, static_in)
    graph.replay()  # the tail re-fills the carried slots from the old weights
    assert ws.dag.carried
    with ws.writing_weights("a test reload"):
        for name, param in layers.named_parameters():
            param.data.copy_(new[name])
    for x, w in zip(inputs, want):  # replays only: no forward of ringflow's runs
        static_in.copy_(x)
        graph.replay()
        assert torch.equal(static_out, w)
    ws.close()


def copy_layer(layer):
    import copy
    return copy.deepcopy(layer)


@torch.no_grad()
def test_the_error_policy_refuses_an_outer_capture():
    layers, inputs, _ = model()
    ws = WeightStreamer(layers, [1, 2], depth=1, workspace_bytes=4 << 30, capture="error")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with pytest.raises(CaptureError, match="capture policy is 'error'"):
        with torch.cuda.graph(graph):
            run_stack(layers, inputs[0])
    ws.close()


def test_pinned_memory_refused_is_one_clear_error(monkeypatch):
    layers = decoder_stack(2, hidden=256, intermediate=512, heads=4, device="cuda")
    real_empty = torch.empty

    def refuse(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(AllocationError, match="pinning .* MiB of host memory .* failed"):
        WeightStreamer(layers, [1], depth=1, workspace_bytes=1 << 26)
