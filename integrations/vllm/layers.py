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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

from ringflow.errors import UnsupportedModelError
from ringflow.integrations.vllm.state import PluginState



@dataclass
class _Load:
    """One model load's recording: the stacks, and who is told of each as it is built."""
    stacks: list[list[nn.Module]]
    on_stack: tuple[Callable[[list[nn.Module]], None], ...]


# the current model load's recording (None: not loading). A dynamic extent (the worker's
# load_model), not process state: it lives in a ContextVar of its own, set and reset by
# recording(), so it cannot outlive the load that set it (record_stack ignores the plugin state)
_recording: contextvars.ContextVar[_Load | None] = \
    contextvars.ContextVar("ringflow_layer_stacks", default=None)


def record_stack(state: PluginState, original, offloader, modules_generator, *args, **kwargs):
    """The hook on an offloader's ``wrap_modules``: let it wrap the stack it was handed as
    usual, then (when a model load is recording) record the stack and tell each of the
    load's ``on_stack`` callbacks of it, before vLLM loads its weights."""
    load = _recording.get()
    if load is None:
        return original(offloader, modules_generator, *args, **kwargs)
    token = _recording.set(None)  # an offloader calling its parent's wrap_modules: one record
    try:
        result = original(offloader, modules_generator, *args, **kwargs)
    finally:
        _recording.reset(token)
    if not (args or kwargs.get("prefix")):  # with a prefix: a vision tower, not make_layers
        stack = list(result)
        for told in load.on_stack:
            told(stack)
        load.stacks.append(stack)
    return result


@contextlib.contextmanager
def recording(*on_stack: Callable[[list[nn.Module]], None]) -> Iterator[list[list[nn.Module]]]:
    """Collects the layer stacks ``make_layers`` builds inside the block (one model load),
    calling each of ``on_stack`` with every stack as it is built (its weights not yet loaded:
    Note [Ringflow places the chosen experts])."""
    load = _Load([], on_stack)
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
