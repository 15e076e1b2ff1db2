"""Finding a vLLM model's decoder layers the way vLLM itself does.

vLLM builds every decoder stack through one helper, ``make_layers``
(``vllm/model_executor/models/utils.py``), which passes the stage's freshly built layers through
the process's weight offloader: ``get_offloader().wrap_modules(layers)``. vLLM's own prefetch
offloader finds its layers there, and so does ringflow: while a worker loads its model, the
offloader's ``wrap_modules`` records every stack it is handed. Attribute paths
(``model.model.layers``, ``model.decoder.layers``, ``transformer.h``) differ per family; this
does not.

A model whose stack was not built through ``make_layers`` (or that has several candidate stacks
in its language model) is refused with one line naming its class.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from ringflow.errors import UnsupportedModelError
from ringflow.integrations.vllm.state import PluginState


class StackWatcher:
    """Told of the decoder stacks one model load builds (:func:`recording`): ``built`` with
    each layer as vLLM's no-op offloader takes it from ``make_layers``'s generator (before the
    next layer is built), ``wrapped`` with the whole stack once the offloader returned it (any
    offloader), before vLLM loads its weights."""

    def built(self, index: int, layer: nn.Module) -> None:
        pass

    def wrapped(self, stack: list[nn.Module]) -> None:
        pass


@dataclass
class _Load:
    """One model load's recording: the stacks, and who is told of each as it is built."""
    stacks: list[list[nn.Module]]
    watchers: tuple[StackWatcher, ...]


# the current model load's recording (None: not loading). A dynamic extent (the worker's
# load_model), not process state: it lives in a ContextVar of its own, set and reset by
# recording(), so it cannot outlive the load that set it (record_stack ignores the plugin state)
_recording: contextvars.ContextVar[_Load | None] = \
    contextvars.ContextVar("ringflow_layer_stacks", default=None)


def _told_as_built(layers: Iterator[nn.Module], watchers) -> Iterator[nn.Module]:
    for index, layer in enumerate(layers):
        for watcher in watchers:
            watcher.built(index, layer)
        yield layer


def record_stack(state: PluginState, original, offloader, modules_generator, *args, **kwargs):
    """The hook on an offloader's ``wrap_modules``: let it wrap the stack it was handed as
    usual and (when a model load is recording) record the stack and tell the load's watchers
    of it. Under vLLM's no-op offloader (no offload flags), which keeps every layer where it
    was built, each layer is told as it is built too: what a watcher moves off the device
    then leaves before the next layer allocates (Note [Ringflow places the chosen experts]).
    Other offloaders may take parameters themselves: their layers are told once wrapped."""
    load = _recording.get()
    if load is None:
        return original(offloader, modules_generator, *args, **kwargs)
    stack_call = not (args or kwargs.get("prefix"))  # with a prefix: a vision tower
    if stack_call and load.watchers and type(offloader).__name__ == "NoopOffloader":
        modules_generator = _told_as_built(modules_generator, load.watchers)
    token = _recording.set(None)  # an offloader calling its parent's wrap_modules: one record
    try:
        result = original(offloader, modules_generator, *args, **kwargs)
    finally:
        _recording.reset(token)
    if stack_call:
        stack = list(result)
        for watcher in load.watchers:
            watcher.wrapped(stack)
        load.stacks.append(stack)
    return result


@contextlib.contextmanager
def recording(*watchers: StackWatcher) -> Iterator[list[list[nn.Module]]]:
    """Collects the layer stacks ``make_layers`` builds inside the block (one model load),
    telling each of ``watchers`` of every stack as it is built (:class:`StackWatcher`)."""
    load = _Load([], watchers)
    token = _recording.set(load)
    try:
        yield load.stacks
    finally:
        _recording.reset(token)


def stage_layers(stack: list[nn.Module]) -> list[nn.Module]:
    """A recorded stack's layers on this pipeline stage (vLLM fills the other stages' places
    with ``PPMissingLayer``): what profiles index."""
    return [layer for layer in stack if type(layer).__name__ != "PPMissingLayer"]


def decoder_layers(model: nn.Module, stacks: list[list[nn.Module]]) -> list[nn.Module]:
    """``model``'s decoder layers on this pipeline stage, in execution order.

    Args:
        model: the loaded model (the target model; a draft model's stack is ignored).
        stacks: what :func:`recording` collected while the worker loaded it.

    Raises:
        UnsupportedModelError: no stack, or more than one, belongs to the model's language
            model.
    """
    owner = model.get_language_model() if hasattr(model, "get_language_model") else model
    inside = {id(m) for m in owner.modules()}
    mine = [stack for stack in stacks if stack and all(id(m) in inside for m in stack)]
    name = type(model).__name__
    if not mine:
        raise UnsupportedModelError(
            f"cannot find the decoder layers of {name}: vLLM did not build them through "
            f"make_layers, which is where ringflow finds them; weight streaming supports models "
            f"whose decoder stack vLLM builds with make_layers (remove the offload section)")
    if len(mine) > 1:
        sizes = ", ".join(str(len(s)) for s in mine)
        raise UnsupportedModelError(
            f"{name} has {len(mine)} layer stacks built by make_layers ({sizes} layers); "
            f"ringflow cannot tell which is the decoder: weight streaming does not support this "
            f"model (remove the offload section)")
    return stage_layers(mine[0])
