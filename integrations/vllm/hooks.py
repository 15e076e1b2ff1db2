"""Installing ringflow's hooks on vLLM classes: once, recognisably, keeping the original."""

from __future__ import annotations

import functools


def wrap(cls: type, name: str, hook, state) -> None:
    """Replace ``cls.name`` by a method that calls ``hook(state, original, self, *args,
    **kwargs)``: every hook receives the process's plugin state (``state.py``).

    Idempotent: a method ringflow already wrapped is left as it is (vLLM loads plugins in
    every process, and tests start several engines in one).
    """
    original = getattr(cls, name)
    if getattr(original, "_ringflow_hook", False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return hook(state, original, self, *args, **kwargs)

    wrapper._ringflow_hook = True
    setattr(cls, name, wrapper)
