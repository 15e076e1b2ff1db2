"""Installing ringflow's hooks on vLLM classes: once, recognisably, keeping the original.

Note [vLLM's errors keep vLLM's frames]
    A hooked method's exception passes through ringflow's wrapper and hook on its way up, so
    its traceback would name ``hooks.py`` and the hook's module between vLLM's frames, and
    ringflow would look to blame for an error vLLM raised (a start refused for memory, a
    model vLLM cannot load). Where the exception was raised outside ringflow (its innermost
    frame is not ringflow's), the wrapper drops ringflow's frames from its traceback (and from
    the exceptions chained to it, likewise) and re-raises it bare, which adds no frame of its
    own: the traceback reads as vLLM's alone. An exception raised in ringflow's code keeps
    every frame. ``RINGFLOW_HOOK_FRAMES=1`` keeps them always.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from types import TracebackType

from ringflow import envs
from ringflow.errors import EngineError


@functools.cache
def own_folders() -> tuple[str, ...]:
    """Where ringflow's code lies: its packages' folders (the repository's top-level folders
    in an editable install, where a virtual environment may sit beside them)."""
    folders = []
    for name in ("ringflow", "ringflow.integrations", "ringflow.orchestrator",
                 "ringflow.graphs", "ringflow.kernels"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders += [os.path.abspath(p) + os.sep for p in spec.submodule_search_locations]
    return tuple(folders)


def _ringflows(tb: TracebackType) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(own_folders())


def hide_own_frames(exc: BaseException) -> None:
    """Drop ringflow's frames from ``exc``'s traceback, and from the exceptions chained to it,
    where each was raised outside ringflow (Note [vLLM's errors keep vLLM's frames])."""
    if envs.flag("RINGFLOW_HOOK_FRAMES"):
        return
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames, tb = [], exc.__traceback__
        while tb is not None:
            frames.append(tb)
            tb = tb.tb_next
        if frames and not _ringflows(frames[-1]):
            kept = [tb for tb in frames if not _ringflows(tb)]
            for upper, lower in zip(kept, kept[1:]):
                upper.tb_next = lower
            kept[-1].tb_next = None
            exc.__traceback__ = kept[0]
        exc = exc.__cause__ or exc.__context__


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
        try:
            return hook(state, original, self, *args, **kwargs)
        except BaseException as exc:
            hide_own_frames(exc)
            raise  # bare: no frame of this wrapper added back

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
        try:
            return hook(state, original, *args, **kwargs)
        except BaseException as exc:
            hide_own_frames(exc)
            raise  # bare: no frame of this wrapper added back

    wrapper._ringflow_hook = True
    wrapper._ringflow_state = state
    setattr(module, name, wrapper)
