"""Decoder-layer discovery (integrations/vllm/layers.py) without an engine: stacks recorded
while a model loads, the model's own stack chosen, one clear line for anything else."""

import pytest
from torch import nn

from ringflow import UnsupportedModelError
from ringflow.integrations.vllm import layers


class PPMissingLayer(nn.Identity):
    """Named like vLLM's placeholder for another pipeline stage's layer."""


def _stack(n):
    return [nn.Linear(4, 4) for _ in range(n)]


class TinyForCausalLM(nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.decoder = nn.ModuleDict({"layers": nn.ModuleList(stack)})


def _record(stacks_built):
    """What the hook records when an offloader's wrap_modules sees ``stacks_built``."""
    with layers.recording() as stacks:
        for stack, prefix in stacks_built:
            kwargs = {"prefix": prefix} if prefix else {}
            layers.record_stack(None, lambda self, modules, **kw: list(modules), None, iter(stack),
                                 **kwargs)
    return stacks


def test_the_models_own_stack_is_found_wherever_it_lives_and_a_drafts_is_ignored():
    target, draft = _stack(3) + [PPMissingLayer()], _stack(2)
    stacks = _record([(target, None), (draft, None)])
    model = TinyForCausalLM(target)
    assert layers.decoder_layers(model, stacks) == target[:3]


def test_a_stack_routed_by_name_is_a_tower_not_a_decoder():
    stacks = _record([(_stack(2), "visual")])
    assert stacks == []


def test_nothing_is_recorded_outside_a_model_load():
    assert layers.record_stack(None, lambda self, m: list(m), None, iter(_stack(2))) != []
    with layers.recording() as stacks:
        pass
    assert stacks == []


def test_a_model_without_a_make_layers_stack_is_refused_with_its_class_name():
    with pytest.raises(UnsupportedModelError, match=r"^cannot find the decoder layers of "
                                            r"TinyForCausalLM: vLLM did not build them through "
                                            r"make_layers"):
        layers.decoder_layers(TinyForCausalLM(_stack(2)), [])


def test_two_candidate_stacks_are_refused_rather_than_guessed():
    a, b = _stack(2), _stack(3)
    model = TinyForCausalLM(a + b)
    with pytest.raises(UnsupportedModelError, match="TinyForCausalLM has 2 layer stacks built by "
                                            "make_layers"):
        layers.decoder_layers(model, _record([(a, None), (b, None)]))
