"""ringflow puts the chosen layers' routed experts in host memory as vLLM builds them (Note
[Ringflow places the chosen experts]): which parameters move, what is refused, and the hook on
vLLM's offloader that tells it of each stack. On the CPU the move is a stand-in (a copy); the
pinned memory and vLLM's CUDA view run in the GPU engine tests."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ringflow.errors import ProfileError, UnsupportedModelError
from ringflow.integrations.vllm import layers as layers_mod
from ringflow.integrations.vllm.expert_placement import HostPlacement, check_placed, to_place
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.profile import Profile


class RoutedExperts(nn.Module):  # the class name is what moe_runners_of looks for
    def __init__(self, seed: int, scales: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w13_weight = nn.Parameter(torch.randn(4, 6, 3, generator=g), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.randn(4, 3, 3, generator=g), requires_grad=False)
        if scales:  # vLLM's fp8 scales start at one before the checkpoint loads
            self.w13_weight_scale = nn.Parameter(torch.ones(4), requires_grad=False)


class Runner(nn.Module):
    def __init__(self, seed: int, scales: bool = False):
        super().__init__()
        self.routed_experts = RoutedExperts(seed, scales)
        self.gate = nn.Linear(3, 4)


class Decoder(nn.Module):
    def __init__(self, seed: int, moe: bool = True, scales: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.mlp = Runner(seed, scales) if moe else nn.Linear(3, 3)


class PPMissingLayer(nn.Module):  # vLLM's place-holder for another pipeline stage's layer
    pass


def profile(layers="all"):
    return Profile.from_mapping({"experts": {"layers": layers, "slots": 2}}, vllm=True)


def moved(data):
    """The stand-in for pinned memory and vLLM's view: a copy in new memory."""
    return data.clone()


def expert_params(layer):
    return dict(layer.mlp.routed_experts.named_parameters())


class NoopOffloader:  # vLLM's default: keeps every layer where it was built
    def wrap_modules(self, modules_generator, prefix=""):
        return list(modules_generator)


class UVAOffloader:  # another offloader: may take parameters, so its stacks are told once wrapped
    def wrap_modules(self, modules_generator, prefix=""):
        return list(modules_generator)


def make_layers(placement, layers, offloader=None, events=None, **kwargs):
    """vLLM's make_layers: a generator of freshly built layers handed to the offloader's
    wrap_modules (through ringflow's hook), while a model load records."""
    offloader = offloader or NoopOffloader()

    def build():
        for layer in layers:
            if events is not None:
                events.append(("built", layer))
            yield layer
    return layers_mod.record_stack(PluginState(), type(offloader).wrap_modules, offloader,
                                   build(), **kwargs)


def test_the_chosen_layers_experts_move_with_their_values_and_vllms_mark(caplog):
    stack = [Decoder(0), Decoder(1, moe=False), Decoder(2, scales=True), Decoder(3)]
    before = {i: {n: (p.data_ptr(), p.detach().clone()) for n, p in expert_params(layer).items()}
              for i, layer in enumerate(stack) if i != 1}
    others = [p.data_ptr() for layer in stack for n, p in layer.named_parameters()
              if "routed_experts" not in n]
    placement = HostPlacement(PluginState(), profile([0, 2]), move=moved)
    with caplog.at_level(logging.INFO, logger="ringflow"), layers_mod.recording(placement):
        make_layers(placement, stack)
    assert placement.layers == [0, 2] and placement.stack == stack
    for i, layer in enumerate(stack):
        if i == 1:
            continue
        for name, p in expert_params(layer).items():
            ptr, value = before[i][name]
            assert torch.equal(p.detach(), value)  # the values it held (scales at one)
            placed = i in (0, 2)
            assert (p.data_ptr() != ptr) == placed, (i, name)
            assert getattr(p, "_vllm_is_uva_offloaded", False) == placed, (i, name)
    assert "w13_weight_scale" in expert_params(stack[2])  # scales move with their weights
    assert [p.data_ptr() for layer in stack for n, p in layer.named_parameters()
            if "routed_experts" not in n] == others  # nothing else moves
    [line] = [r.getMessage() for r in caplog.records if "pinned host memory" in r.getMessage()]
    assert line.startswith("experts: ringflow put layers [0, 2]'s routed experts")


def place(profile_, stack, offloader=None, **kwargs):
    """One model load building ``stack`` through make_layers; the placement that watched it."""
    placement = HostPlacement(PluginState(), profile_, move=moved)
    with layers_mod.recording(placement):
        make_layers(placement, stack, offloader, **kwargs)
    return placement


def test_each_layer_moves_as_it_is_built_under_vllms_no_op_offloader():
    """Without offload flags vLLM's no-op offloader builds every layer on the device before
    it returns: each chosen layer's experts must leave before the next layer is built, or the
    whole stack's experts would be in device memory at once."""
    events = []

    class Watch(layers_mod.StackWatcher):
        def built(self, index, layer):
            events.append(("told", layer))

    stack = [Decoder(0), Decoder(1), Decoder(2)]
    placement = HostPlacement(PluginState(), profile([0, 2]), move=moved)
    original = placement._place

    def recorded(found):
        events.extend(("moved", stack[i]) for i in found)
        original(found)
    placement._place = recorded
    with layers_mod.recording(Watch(), placement):
        make_layers(placement, stack, events=events)
    assert [(what, stack.index(layer)) for what, layer in events] == [
        ("built", 0), ("told", 0), ("moved", 0), ("built", 1), ("told", 1), ("built", 2),
        ("told", 2), ("moved", 2)]
    assert placement.layers == [0, 2]


def test_under_another_offloader_the_stack_moves_once_wrapped():
    """vLLM's UVA or prefetch offloader may take parameters itself: the layers are placed
    after it returned, what it took left where it put it."""
    stack = [Decoder(0), Decoder(1)]

    class Taking(UVAOffloader):
        def wrap_modules(self, modules_generator, prefix=""):
            layers = list(modules_generator)
            for p in expert_params(layers[0]).values():
                p._vllm_is_uva_offloaded = True  # vLLM's UVA offloader took layer 0
            return layers
    ptr = stack[0].mlp.routed_experts.w13_weight.data_ptr()
    placement = place(profile(), stack, Taking())
    assert placement.layers == [1] and stack[0].mlp.routed_experts.w13_weight.data_ptr() == ptr
    assert getattr(stack[1].mlp.routed_experts.w2_weight, "_vllm_is_uva_offloaded", False)


def test_indices_are_this_stages_layers_and_patterns_pick_as_the_lane_does():
    """Under pipeline parallelism make_layers hands the offloader this stage's layers only
    (the others are PPMissingLayer in the model's list): indices count from the stage's first,
    as the lane's ``decoder_layers`` does."""
    built = [Decoder(0), Decoder(1), Decoder(2), Decoder(3)]
    placement = place(profile({"every": 2, "last": 1}), built)
    assert placement.layers == [1, 3] and placement.stack == built
    model = nn.Module()
    model.layers = nn.ModuleList([PPMissingLayer(), PPMissingLayer(), *built])
    check_placed(placement, layers_mod.decoder_layers(model, [built]))


def test_parameters_vllms_uva_offloader_took_stay_where_it_put_them():
    stack = [Decoder(0), Decoder(1)]
    taken = stack[0].mlp.routed_experts.w13_weight
    taken._vllm_is_uva_offloaded = True
    ptr = taken.data_ptr()
    found = to_place(stack, profile().experts, None, "cpu")
    assert sorted(found) == [0, 1] and all(p is not taken for p in found[0])
    assert len(found[0]) == 1 and len(found[1]) == 2
    place(profile(), stack)
    assert taken.data_ptr() == ptr


def test_experts_quantized_at_load_are_refused_by_name():
    stack = [Decoder(0), Decoder(1)]
    with torch.device("meta"):
        stack[1].mlp.routed_experts.w2_weight = nn.Parameter(torch.empty(4, 3, 3),
                                                             requires_grad=False)
    with pytest.raises(UnsupportedModelError, match=r"layer 1's routed experts \(w2_weight\) "
                                                    r"are quantized as vLLM loads them"):
        place(profile(), stack)
    place(profile([0]), stack)  # layer 1 not chosen: fine


def test_experts_another_offloader_keeps_elsewhere_are_refused_with_the_fix():
    """On a GPU, a chosen layer's experts on the CPU were taken by vLLM's prefetch offloader:
    here the 'device' is the meta device, the experts are on the CPU."""
    stack = [Decoder(0), Decoder(1)]
    with pytest.raises(UnsupportedModelError, match="vLLM's offloader put them .* leave "
                                                    "experts out of --offload-params"):
        to_place(stack, profile().experts, None, "meta")


def test_a_listed_layer_that_does_not_exist_is_the_profiles_error():
    with pytest.raises(ProfileError, match=r"layers \[7\] do not exist"):
        place(profile([7]), [Decoder(0), Decoder(1)])


def test_only_the_first_moe_stack_is_placed_and_the_lane_must_be_its_decoder():
    target, draft = [Decoder(0), Decoder(1)], [Decoder(5)]
    placement = HostPlacement(PluginState(), profile(), move=moved)
    with layers_mod.recording(placement) as stacks:
        make_layers(placement, [nn.Linear(2, 2)])  # a dense stack (a drafter's): not the one
        make_layers(placement, target)
        make_layers(placement, draft)
        make_layers(placement, [Decoder(6)], prefix="vision")  # a tower: not a stack
    assert stacks == [[stacks[0][0]], target, draft]
    assert placement.stack == target and placement.layers == [0, 1]
    assert not hasattr(draft[0].mlp.routed_experts.w13_weight, "_vllm_is_uva_offloaded")
    check_placed(placement, target)
    check_placed(None, draft)  # nothing placed: nothing to check
    with pytest.raises(UnsupportedModelError, match="not this model's decoder"):
        check_placed(placement, draft)


def test_on_vllms_cpu_build_nothing_moves():
    stack = [Decoder(0), Decoder(1)]
    ptr = stack[0].mlp.routed_experts.w13_weight.data_ptr()
    placement = HostPlacement(PluginState(), profile())  # vLLM's own move, the CPU's device
    with layers_mod.recording(placement):
        make_layers(placement, stack)
    assert placement.layers == [] and stack[0].mlp.routed_experts.w13_weight.data_ptr() == ptr
    check_placed(placement, [Decoder(3)])  # nothing placed: any decoder


def test_outside_a_load_nobody_is_told_and_a_refusal_ends_the_recording(caplog):
    """``record_stack`` outside a model load passes the stack through; a refusal inside one
    is one logged line (Note [One line at start-up]), propagates (vLLM's load fails with it)
    and leaves nothing recording."""
    stack = [Decoder(0), Decoder(1)]
    assert make_layers(None, stack) == stack  # not loading: nothing placed
    assert not hasattr(stack[0].mlp.routed_experts.w13_weight, "_vllm_is_uva_offloaded")
    with caplog.at_level(logging.INFO, logger="ringflow"), pytest.raises(ProfileError):
        place(profile([9]), stack)
    assert sum("layers [9] do not exist" in r.getMessage() for r in caplog.records) == 1
    assert layers_mod._recording.get() is None


class BigDecoder(nn.Module):
    """A layer whose routed experts take ``mib`` MiB (bf16), built on the default device."""

    def __init__(self, mib: int):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.mlp = nn.Module()
        self.mlp.routed_experts = RoutedExperts.__new__(RoutedExperts)
        nn.Module.__init__(self.mlp.routed_experts)
        rows = mib * 2**20 // 2 // 1024
        self.mlp.routed_experts.w13_weight = nn.Parameter(
            torch.randn(rows, 1024, dtype=torch.bfloat16), requires_grad=False)
        self.mlp.routed_experts.w2_weight = nn.Parameter(
            torch.randn(4, 64, dtype=torch.bfloat16), requires_grad=False)


@pytest.mark.cuda
def test_on_a_gpu_at_most_one_layers_experts_are_ever_in_device_memory():
    """vLLM's no-op offloader builds all of a stack on the device before it returns: with 8
    layers of 64 MiB of experts each, 6 of them chosen, ringflow moving them as they are built
    keeps the peak one layer above the two resident ones (the first form, moving them once the
    stack was built, peaked at eight),
    and every chosen parameter ends as vLLM's CUDA view of pinned host memory, holding the
    values the layer was built with."""
    pytest.importorskip("vllm")
    from ringflow.cudart import in_host_memory
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    placement = HostPlacement(PluginState(), profile({"every": 4, "last": 3}))  # vLLM's move
    with torch.device("cuda"), layers_mod.recording(placement):
        built = make_layers(placement, (BigDecoder(64) for _ in range(8)))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    resident = torch.cuda.memory_allocated() - base
    assert placement.layers == [1, 2, 3, 5, 6, 7]
    assert resident < 3 * 64 * 2**20, resident / 2**20  # layers 0 and 4 only
    # above the two resident layers, one layer being built, not two (the H100 at b9654fc:
    # a 192 MiB peak, the resident layers' 128 MiB by construction); the first form held
    # every layer's experts at once
    assert peak - resident < 1.5 * 64 * 2**20, (peak / 2**20, resident / 2**20)
    for i, layer in enumerate(built):
        w = layer.mlp.routed_experts.w13_weight
        assert w.is_cuda and in_host_memory(w.data_ptr()) == (i % 4 != 0), i
        assert torch.isfinite(w.float()).all() and w.float().std() > 0.5  # randn survived
