"""Installing ringflow's hooks on vLLM classes: once, recognisably, keeping the original."""

from __future__ import annotations

import functools
import inspect

from ringflow.errors import EngineError


def wrap(cls: type, name: str, hook, state) -> None:
    """Replace ``cls.name`` by a method that calls ``hook(state, original, self, *args,
    **kwargs)``: every hook receives the process's plugin state (``state.py``).

    Idempotent: a method ringflow already wrapped is left as it is (vLLM loads plugins in
    every process, and tests start several engines in one).

    Raises:
        EngineError: the method is already hooked for another state: a class hook serves one
            process's state, and rebinding it would hide the first one's lanes.
    """
    original = getattr(cls, name)
    static = isinstance(inspect.getattr_static(cls, name, None), staticmethod)
    if getattr(original, "_ringflow_hook", False):
        if original._ringflow_state is not state:
            raise EngineError(f"{cls.__qualname__}.{name} is already hooked for another plugin "
                              f"state; one process has one (ringflow.integrations.vllm.state."
                              f"STATE)")
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return hook(state, original, self, *args, **kwargs)

    wrapper._ringflow_hook = True
    wrapper._ringflow_state = state
    setattr(cls, name, staticmethod(wrapper) if static else wrapper)  # "self": the first arg


def wrap_function(module, name: str, hook, state) -> None:
    """Replace the function ``module.name`` by one that calls ``hook(state, original, *args,
    **kwargs)``; idempotent and one state per function, as :func:`wrap`.

    Raises:
        EngineError: the function is already hooked for another state.
    """
    original = getattr(module, name)
    if getattr(original, "_ringflow_hook", False):
        if original._ringflow_state is not state:
            raise EngineError(f"{module.__name__}.{name} is already hooked for another plugin "
                              f"state; one process has one")
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return hook(state, original, *args, **kwargs)

    wrapper._ringflow_hook = True
    wrapper._ringflow_state = state
    setattr(module, name, wrapper)
