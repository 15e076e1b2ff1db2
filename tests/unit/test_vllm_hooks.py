"""Installing hooks on vLLM classes (integrations/vllm/hooks.py): each hook receives the one
plugin state it was installed with."""

import pytest

from ringflow import EngineError
from ringflow.integrations.vllm.hooks import wrap
from ringflow.integrations.vllm.state import PluginState


def test_a_class_hook_receives_its_state_once_and_serves_no_other():
    class Worker:
        def load(self, x):
            return x + 1

    first, second = PluginState(), PluginState()
    seen = []

    def hook(state, original, self, x):
        seen.append(state)
        return original(self, x) * 10

    wrap(Worker, "load", hook, first)
    wrap(Worker, "load", hook, first)            # vLLM loads plugins in every process: no-op
    assert Worker().load(1) == 20 and seen == [first]
    with pytest.raises(EngineError, match="Worker.load is already hooked for another plugin state"):
        wrap(Worker, "load", hook, second)
    assert Worker().load(2) == 30 and seen == [first, first]  # still the first state's hook
