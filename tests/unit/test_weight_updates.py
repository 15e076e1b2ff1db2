"""Weights that change after load (Note [Weights that change] in weight_stream.py): the plan's
``sources_changed`` re-gathers carried slots, and ``WeightStreamer.writing_weights`` puts every
write where the gathers read."""

import copy

import pytest
import torch

from ringflow import ConfigError, LifecycleError, Planner, SlotPool, SyncExecutor
from ringflow.errors import UnsupportedModelError
from ringflow.graphs.stepped import LayerStepper, engine_computes
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.testing.models import decoder_stack, run_stack

SMALL = dict(hidden=64, intermediate=96, heads=4, dtype=torch.float32)
LAYERS, GATHERED = 8, [0, 1, 3, 6]


class Sources:
    """A static lane: layer l's gather copies ``data[l]``; computes record what they read."""

    def __init__(self, seed):
        self.data = torch.randn(LAYERS, 4, generator=torch.Generator().manual_seed(seed))
        self.read = {}
        self.gathered = []  # layers, in gather order

    def gather(self, layer, lane, out):
        self.gathered.append(layer)
        out.copy_(self.data[layer])

    def compute(self, layer, lane, slot):
        if slot is not None:
            self.read[layer] = slot.clone()


def plan(depth):
    pool = SlotPool("w", (4,), torch.float32, depth=depth, workspace_bytes=1 << 10)
    dag = Planner(LAYERS, [pool.layout], gathered=GATHERED, cross_forward=["w"]).plan()
    assert dag.carried
    return pool, dag


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_static_lane_whose_sources_change_is_gathered_again_never_read_stale(depth):
    pool, dag = plan(depth)
    src = Sources(0)
    ex = SyncExecutor(dag, [pool], src.gather, src.compute)
    ex.run()
    ex.run()  # steady state: the carried slots were filled in the last forward's tail
    carried = [layer for _, layer, _ in dag.carried]
    old = src.data.clone()
    src.data.copy_(torch.randn(LAYERS, 4, generator=torch.Generator().manual_seed(1)))
    ex.run()  # unannounced: the carried layers read the old data (what the API is for)
    assert all(torch.equal(src.read[l], old[l]) for l in carried)
    ex.sources_changed("w")
    ex.run()
    assert all(torch.equal(src.read[l], src.data[l]) for l in GATHERED)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_sources_changed_refills_the_carried_slots_before_any_forward_runs(depth):
    """Note [Prime at the write]: a graph an engine replays reads the carried slots with no
    Python of ringflow's; so ``sources_changed`` itself leaves them holding the new data (read
    here straight from the slots, no forward issued), and the next forward adopts them."""
    pool, dag = plan(depth)
    src = Sources(0)
    ex = SyncExecutor(dag, [pool], src.gather, src.compute)
    ex.run()
    carried = [layer for _, layer, _ in dag.carried]
    src.data.copy_(torch.randn(LAYERS, 4, generator=torch.Generator().manual_seed(1)))
    assert not any(torch.equal(pool.carried[("w", l)].tensor, src.data[l]) for l in carried)
    ex.sources_changed("w")
    for layer in carried:  # what a replay's first layers would read, before any forward
        assert torch.equal(pool.carried[("w", layer)].tensor, src.data[layer])
    src.gathered.clear()
    ex.run()  # adopts the primed slots: no second prime
    assert sorted(l for l in src.gathered if l in carried) == sorted(carried)  # the tail only
    assert all(torch.equal(src.read[l], src.data[l]) for l in GATHERED)


def test_sources_change_between_forwards_only_and_on_a_lane_the_plan_has():
    pool, dag = plan(1)
    src = Sources(0)
    stepper = LayerStepper(SyncExecutor(dag, [pool], src.gather, engine_computes))
    with pytest.raises(ConfigError, match="no lane 'kv'"):
        stepper.executor.sources_changed("kv")
    stepper.before(0)
    with pytest.raises(LifecycleError, match="between forwards"):
        stepper.sources_changed("w")


def new_weights(layers, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 0.05 + p.detach()
            for name, p in layers.named_parameters()}


def reference(layers, weights, x):
    fresh = copy.deepcopy(layers)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(weights[name])
    return fresh


@pytest.mark.parametrize("assign", [False, True], ids=["copy_", "assign"])
def test_weights_written_during_writing_weights_reach_the_streamed_layers(assign):
    """Like vLLM's reload: every parameter written (into .data, or by assigning a new tensor);
    the next forward computes what a stack built with the new weights computes."""
    layers = decoder_stack(4, **SMALL)
    resident = copy.deepcopy(layers)
    x = torch.randn(5, 64)
    ws = WeightStreamer(layers, [1, 3], depth=1, workspace_bytes=1 << 22, poison=True)
    assert torch.equal(run_stack(layers, x), run_stack(resident, x))
    weights = new_weights(resident, 7)
    want = run_stack(reference(resident, weights, x), x)
    with ws.writing_weights("a test reload"):
        with ws.writing_weights():  # nested (reload_weights calls load_weights): one update
            for name, p in layers.named_parameters():
                if assign:
                    p.data = weights[name].clone()
                else:
                    p.data.copy_(weights[name])
    for _ in range(2):
        assert torch.equal(run_stack(layers, x), want)
    assert ws.weight_updates == 1
    for name, host in ws.host_copies(3).items():  # the host copies hold the new weights
        assert torch.equal(host, weights[f"3.{name}"])


def test_a_weight_write_leaves_the_carried_slots_holding_the_new_weights_at_once():
    """The engine's next step after a reload may be a captured graph's replay (no Python of
    ringflow's): before ``writing_weights`` returns, every carried slot holds the new bytes."""
    layers = decoder_stack(4, **SMALL)
    ws = WeightStreamer(layers, [1, 2, 3], depth=1, workspace_bytes=1 << 22)
    run_stack(layers, torch.randn(5, 64))
    carried = [layer for _, layer, _ in ws.dag.carried]
    assert carried
    old = {l: ws.pool.storage[ws.slot_of[l]][: ws.layer_bytes[l]].clone() for l in carried}
    weights = new_weights(layers, 3)
    with ws.writing_weights("a test reload"):
        for name, p in layers.named_parameters():
            p.data.copy_(weights[name])
    for layer in carried:
        slot = ws.pool.storage[ws.slot_of[layer]][: ws.layer_bytes[layer]]
        assert torch.equal(slot, ws.host[layer][: ws.layer_bytes[layer]])
        assert not torch.equal(slot, old[layer])


def test_a_write_that_reshapes_a_streamed_parameter_is_refused_with_its_name():
    layers = decoder_stack(4, **SMALL)
    ws = WeightStreamer(layers, [1, 3], depth=1, workspace_bytes=1 << 22)
    name, param = next((n, p) for n, p in layers[1].named_parameters() if p.dim() == 2)
    with pytest.raises(UnsupportedModelError, match=f"'{name}' of layer 1 a new shape"):
        with ws.writing_weights("a test reload"):
            param.data = torch.zeros(param.shape[0] + 1, param.shape[1])


def test_weights_cannot_be_written_in_the_middle_of_a_forward():
    layers = decoder_stack(4, **SMALL)
    ws = WeightStreamer(layers, [1, 3], depth=1, workspace_bytes=1 << 22)
    ws.stepper.before(0)
    with pytest.raises(LifecycleError, match="middle of a forward"):
        with ws.writing_weights():
            pass
