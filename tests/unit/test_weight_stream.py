"""WeightStreamer on the CPU: streamed layers compute exactly what resident ones did."""

import re

import pytest
import torch
from torch import nn

from ringflow import BudgetError, ConfigError, UnsupportedModelError
from ringflow.integrations.torch import layer_ops as ops
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.testing.models import decoder_stack, run_stack

SMALL = dict(hidden=64, intermediate=96, heads=4, dtype=torch.float32)


def stack(n=6):
    return decoder_stack(n, **SMALL)


@pytest.mark.parametrize("offload,depth", [([0, 1, 2, 3, 4, 5], 1), ([1, 2, 4], 1),
                                           ([0, 1, 2, 3, 4], 2), ([2, 5], 3), ([1, 3], 0)])
def test_streamed_layers_compute_exactly_what_resident_ones_did(offload, depth):
    layers = stack()
    x = torch.randn(5, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, offload, depth=depth, workspace_bytes=1 << 22, poison=True)
    for _ in range(3):
        assert torch.equal(run_stack(layers, x), want)
    assert ws.stepper.forwards == 3
    assert ws.pool.free_count + len(ws.pool.carried) == ws.pool.slots
    assert ws.pool.depth == min(depth, 10)


def test_offloaded_parameters_view_their_slot_and_resident_ones_do_not_move():
    layers = stack(4)
    resident = layers[0].qkv.data_ptr()
    ws = WeightStreamer(layers, [1, 2, 3], depth=1, workspace_bytes=1 << 22)
    base, end = ws.pool.storage.data_ptr(), ws.pool.storage.data_ptr() + ws.reserved_bytes
    for i in (1, 2, 3):
        for p in layers[i].parameters():
            assert base <= p.data_ptr() < end
    assert layers[0].qkv.data_ptr() == resident
    assert {ws.slot_of[i] for i in (1, 2, 3)} == {0, 1} and ws.slot_of[1] == ws.slot_of[3]


def test_views_of_one_storage_are_copied_once_and_keep_their_layout():
    # MLA's W_UV / W_UK_T are strided views of kv_b_proj.weight: one storage, two params
    class Mla(nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.kv_b = nn.Parameter(torch.randn(64, 48, generator=g), requires_grad=False)
            self.w_uv = nn.Parameter(self.kv_b.data[8:40].t(), requires_grad=False)

        def forward(self, positions, hidden, residual=None):
            z = (hidden @ self.kv_b) @ self.w_uv  # [t, 48] @ [48, 32]
            return torch.cat([z, z], -1) * 1e-2, hidden if residual is None else hidden + residual

    layers = nn.ModuleList(Mla(i) for i in range(3))
    x = torch.randn(4, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, [0, 1, 2], depth=1, workspace_bytes=1 << 20, poison=True)
    assert ws.layer_bytes[0] == 64 * 48 * 4  # once, not twice
    w = layers[1].w_uv
    assert w.untyped_storage().data_ptr() == layers[1].kv_b.untyped_storage().data_ptr()
    assert w.stride() == (1, 48)
    for _ in range(2):
        assert torch.equal(run_stack(layers, x), want)


def test_a_forward_abandoned_midway_hands_its_slots_back_and_the_next_is_right():
    layers = stack(5)
    x = torch.randn(3, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, [1, 2, 3, 4], depth=1, workspace_bytes=1 << 22, poison=True)
    original = layers[2].forward

    def broken(*args, **kwargs):
        raise RuntimeError("layer failed")

    layers[2].forward = broken  # replaces the streamer's wrapper too: the layer never ends
    with pytest.raises(RuntimeError):
        run_stack(layers, x)
    assert ws.stepper.in_forward
    layers[2].forward = original
    assert torch.equal(run_stack(layers, x), want)  # layer 0 again: a new forward
    assert ws.pool.free_count + len(ws.pool.carried) == ws.pool.slots and not ws.stepper.in_forward


def test_bad_requests_say_what_to_change():
    with pytest.raises(ConfigError, match="layers \\[7\\] do not exist: the stack has 4"):
        WeightStreamer(stack(4), [1, 7], depth=1, workspace_bytes=1 << 22)
    with pytest.raises(BudgetError, match="smaller than one offloaded layer's weights.*depth d "
                                          "needs d \\+ 1") as caught:
        WeightStreamer(stack(4), [1, 2], depth=1, workspace_bytes=1000)
    assert caught.value.budget_bytes == 1000 and "offload." not in str(caught.value)
    shared = stack(3)
    shared[2].qkv = shared[1].qkv
    with pytest.raises(UnsupportedModelError, match="shared by decoder layers 1 and 2"):
        WeightStreamer(shared, [1, 2], depth=1, workspace_bytes=1 << 22)


def test_the_layer_ops_are_real_custom_ops_that_declare_their_mutation():
    begin = str(torch.ops.ringflow.layer_begin.default._schema)
    end = str(torch.ops.ringflow.layer_end.default._schema)
    assert re.search(r"Tensor\(a\d*!\) anchor", begin), begin
    assert re.search(r"Tensor\(a\d*!\)\[\] tensors", end), end
    assert set(ops.OP_NAMES) == {"ringflow::layer_begin", "ringflow::layer_end"}


class _SandwichLayer(nn.Module):
    """A Gemma2-style layer: it returns (hidden, residual), and the residual is a cheap
    pointwise function of a streamed norm weight (what Inductor recomputed after the release)."""

    def __init__(self, hidden, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
                                 requires_grad=False)
        self.post_norm = nn.Parameter(0.1 * torch.randn(hidden, generator=g), requires_grad=False)

    def forward(self, positions, hidden, residual=None):
        residual = hidden if residual is None else hidden + residual
        residual = torch.tanh(hidden @ self.proj) * (1.0 + self.post_norm) + residual
        return torch.tanh(residual), residual


def test_the_release_anchors_every_tensor_a_streamed_layer_returns():
    """Note [Release boundary under torch.compile]: both outputs enter layer_end, so no
    compiler may compute either of them after the slot is released."""
    layers = nn.ModuleList(_SandwichLayer(16, i) for i in range(3))
    ws = WeightStreamer(layers, [0, 1, 2], depth=1, workspace_bytes=1 << 20)  # noqa: F841 (alive)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def run(h):
        r, positions = None, torch.arange(h.shape[0])
        for layer in layers:
            h, r = layer(positions, h, r)
        return h + r

    torch._dynamo.reset()
    torch.compile(run, backend=capture, fullgraph=True)(torch.randn(4, 16))
    [gm] = graphs
    end = torch.ops.ringflow.layer_end
    ends = [n for n in gm.graph.nodes if n.target in (end, end.default)]
    assert len(ends) == 3
    for node in ends:
        anchored = node.args[0]
        assert len(anchored) == 2, f"layer_end anchors {len(anchored)} of the layer's 2 outputs"
        assert {a.meta["example_value"].shape for a in anchored} == {torch.Size([4, 16])}


def test_a_sandwich_norm_stack_compiled_by_inductor_reads_only_its_own_weights():
    layers = nn.ModuleList(_SandwichLayer(32, i) for i in range(4))
    x = torch.randn(5, 32)
    r = None
    h = x
    for layer in layers:
        h, r = layer(None, h, r)
    want = h + r
    ws = WeightStreamer(layers, [1, 2, 3], depth=1, workspace_bytes=1 << 22, poison=True)

    def run(h):
        r = None
        for layer in layers:
            h, r = layer(None, h, r)
        return h + r

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True)
    for _ in range(2):
        assert torch.allclose(compiled(x), want, atol=1e-5, rtol=1e-5)


def test_streaming_under_torch_compile_keeps_the_layer_order():
    layers = stack(4)
    x = torch.randn(3, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, [1, 2, 3], depth=1, workspace_bytes=1 << 22, poison=True)
    compiled = torch.compile(lambda h: run_stack(layers, h), backend="eager", fullgraph=True)
    for _ in range(2):
        assert torch.allclose(compiled(x), want, atol=1e-5, rtol=1e-5)
    assert ws.stepper.forwards == 2


def test_close_unhooks_the_layers_and_frees_the_ring():
    layers = stack(3)
    ws = WeightStreamer(layers, [1, 2], depth=1, workspace_bytes=1 << 22)
    assert "forward" in layers[1].__dict__
    ws.close()
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert ws.pool.storage.numel() == 0


def test_the_next_forwards_first_layers_are_copied_during_this_forwards_last_layers(
        monkeypatch):
    from ringflow.integrations.torch import weight_stream

    layers = stack(8)
    x = torch.randn(5, 64)
    want = run_stack(layers, x)
    events = []
    ws = WeightStreamer(layers, [0, 1, 2, 5, 6], depth=1, workspace_bytes=1 << 22, poison=True)
    owner = {ws.host[i].data_ptr(): i for i in ws.offloaded}
    real = weight_stream.copy_host_to_device

    def copy(src, out):
        events.append(("copy", owner[src.data_ptr()]))
        return real(src, out)

    monkeypatch.setattr(weight_stream, "copy_host_to_device", copy)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("layer", i)))
    assert [layer for _, layer, _ in ws.dag.carried] == [0, 1]  # slots 0, 1 are read again later
    for _ in range(3):
        assert torch.equal(run_stack(layers, x), want)
    first = events[: events.index(("layer", 7)) + 1]
    # primes layers 0 and 1, copies 2, 5 and 6 in the forward, then the next forward's 1 and 0
    assert [e[1] for e in first if e[0] == "copy"] == [0, 1, 2, 5, 6, 1, 0]
    # the next forward's layer 0 is copied after layer 6 (its slot's last reader), before layer 7
    assert first.index(("layer", 6)) < first.index(("copy", 0), 2) < first.index(("layer", 7))
    assert sum(e[0] == "copy" for e in events) == 2 + 3 * 5  # one prime, five copies a forward
    assert ws.pool.free_count == 0 and len(ws.pool.carried) == 2


def test_an_abandoned_forward_makes_the_next_one_prime_again(monkeypatch):
    layers = stack(6)
    x = torch.randn(5, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, [0, 2, 3, 5], depth=1, workspace_bytes=1 << 22, poison=True)
    assert ws.dag.carried
    assert torch.equal(run_stack(layers, x), want)
    boom = layers[3].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_stack(layers, x)
    boom.remove()
    # the next layer 0 finds the forward abandoned: every slot comes back, then it primes
    for _ in range(2):
        assert torch.equal(run_stack(layers, x), want)
    assert len(ws.pool.carried) == len(ws.dag.carried)
    assert ws.pool.free_count + len(ws.pool.carried) == ws.pool.slots


@pytest.mark.parametrize("offload,depth,cross,sync", [
    ([1, 5, 9, 13], 0, True, False), ([3, 7, 11, 15], 1, True, False),
    ([0, 1, 15], 0, False, False), ([14, 15], 1, True, False), ([2, 6], 0, True, True),
    ([0, 4, 8, 12], 2, True, False), ([5], 0, False, False)])
def test_stepping_only_the_boundary_layers_issues_every_node_when_stepping_all_would(
        offload, depth, cross, sync):
    """Note [Boundary layers]: an engine that calls before/after only around the stepper's
    boundaries issues every node of two forwards (the second adopts the first's carried slots)
    at the same moment of its layer loop as one that calls them around every layer."""
    from ringflow.graphs.slots import SlotPool
    from ringflow.graphs.stepped import LayerStepper, engine_computes
    from ringflow.graphs.sync import SyncExecutor
    from ringflow.orchestrator.dag import NodeKind
    from ringflow.orchestrator.planner import Planner

    layers = 16

    def plan():
        pool = SlotPool("weights", (4,), torch.float32, depth=depth, workspace_bytes=1 << 12)
        return pool, Planner(layers, [pool.layout], gathered=offload, synchronous=sync,
                             cross_forward=["weights"] if cross else ()).plan()

    def moments(stepped):
        pool, dag = plan()  # a pool of its own: carried slots stay with their executor
        executor = SyncExecutor(dag, [pool], lambda layer, lane, slot: slot.fill_(layer),
                                engine_computes)
        stepper = LayerStepper(executor)
        seen, now = [], [None]
        issue = executor.issue_steps

        def recording(start, stop):
            seen.extend((forward, i, now[0]) for i in range(start, stop))
            issue(start, stop)

        executor.issue_steps = recording
        for forward in range(2):
            for layer in range(layers):
                if layer in stepped:  # the moment: layers of this forward computed so far
                    now[0] = layer
                    stepper.before(layer)
                    now[0] = layer + 1
                    stepper.after(layer)
        assert not stepper.in_forward and stepper.forwards == 2
        return {(f, i): m for f, i, m in seen if dag.nodes[i].kind is not NodeKind.COMPUTE}

    pool, dag = plan()
    boundaries = LayerStepper(SyncExecutor(dag, [pool], lambda *a: None,
                                           engine_computes)).boundaries
    assert set(boundaries) == {0, layers - 1, *offload}
    assert moments(set(boundaries)) == moments(set(range(layers)))


def test_the_streamer_wraps_only_its_boundary_layers():
    layers = stack(8)
    ws = WeightStreamer(layers, [2, 5], depth=0, workspace_bytes=1 << 22)
    wrapped = [i for i, layer in enumerate(layers) if "forward" in vars(layer)]
    assert wrapped == [0, 2, 5, 7] == list(ws.stepper.boundaries)
    ws.close()
    assert not any("forward" in vars(layer) for layer in layers)


def test_a_layer_whose_own_wait_precedes_its_compute_is_a_boundary_whatever_follows_it():
    """The rule the planner's plans never exercise alone (a streamed layer is also followed by
    its release): a wait issued at the next boundary would come after the read."""
    from types import SimpleNamespace as N

    from ringflow.graphs.stepped import boundary_layers
    from ringflow.orchestrator.dag import COMPUTE_STREAM, NodeKind

    def node(kind, layer, stream=COMPUTE_STREAM):
        return N(kind=kind, layer=layer, stream=stream)

    nodes = [node(NodeKind.COMPUTE, 0), node(NodeKind.WAIT, 1), node(NodeKind.COMPUTE, 1),
             node(NodeKind.COMPUTE, 2), node(NodeKind.COMPUTE, 3)]
    assert boundary_layers(N(nodes=nodes)) == (0, 1, 3)
    nodes[1] = node(NodeKind.WAIT, 1, stream="g0")  # a gather stream's wait: layer 0's end
    assert boundary_layers(N(nodes=nodes)) == (0, 3)


def test_an_engine_that_skips_a_boundary_layer_is_refused_before_the_read():
    """A compiled graph cached for another plan could lack an offloaded layer's ops: the next
    boundary's begin names the skipped layer instead of letting it read an unfilled slot."""
    from ringflow.errors import PlanError
    layers = stack(8)
    ws = WeightStreamer(layers, [2, 5], depth=0, workspace_bytes=1 << 22, wrap=False)
    ws.stepper.before(0)
    ws.stepper.after(0)
    with pytest.raises(PlanError, match="without layer 2's begin and end"):
        ws.stepper.before(5)
    ws.stepper.abandon("test")
    ws.stepper.before(0)
    ws.stepper.after(0)
    ws.stepper.before(1)  # a resident layer stepped too: still no skipping layer 2
    ws.stepper.after(1)
    with pytest.raises(PlanError, match="without layer 2's begin and end"):
        ws.stepper.before(3)
    ws.stepper.abandon("test")
    for layer in ws.stepper.boundaries:  # the boundaries alone are a whole forward
        ws.stepper.before(layer)
        ws.stepper.after(layer)
    assert ws.stepper.forwards == 1 and not ws.stepper.in_forward
    ws.close()
