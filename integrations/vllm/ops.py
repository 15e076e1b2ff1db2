"""Custom ops that mark a decoder layer's start and end for the LayerStepper.

Under ``torch.compile`` (vLLM compiles its models) Python hooks would be traced away or
reordered; these ops are opaque to the compiler and declare that they mutate the tensor the
layer reads first (its hidden states) and the tensor it produces, so every kernel of the layer
that reads streamed weights stays between them: the weights' wait comes first, the slot's
retire comes after the last read. In eager mode the hooks call the stepper directly.

They are also vLLM "splitting ops" under piecewise CUDA graphs (the plugin registers them), so
they run eagerly between graph pieces and the gather streams never cross a piece boundary.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ringflow.graphs.stepped import LayerStepper

# weak: a stepper lives as long as its streamer (owned by the engine's worker), not longer
_STEPPERS: weakref.WeakValueDictionary[int, LayerStepper] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
OP_NAMES = ("ringflow::layer_begin", "ringflow::layer_end")


def register_stepper(stepper: LayerStepper) -> int:
    """A handle the ops use to find ``stepper`` (kept alive until :func:`unregister_stepper`)."""
    handle = next(_HANDLES)
    _STEPPERS[handle] = stepper
    return handle


def unregister_stepper(handle: int) -> None:
    _STEPPERS.pop(handle, None)


@torch.library.custom_op("ringflow::layer_begin", mutates_args=("anchor",))
def layer_begin(anchor: torch.Tensor, handle: int, layer: int) -> None:
    _STEPPERS[handle].before(layer)


@layer_begin.register_fake
def _layer_begin_fake(anchor: torch.Tensor, handle: int, layer: int) -> None:
    return None


@torch.library.custom_op("ringflow::layer_end", mutates_args=("anchor",))
def layer_end(anchor: torch.Tensor, handle: int, layer: int) -> None:
    _STEPPERS[handle].after(layer)


@layer_end.register_fake
def _layer_end_fake(anchor: torch.Tensor, handle: int, layer: int) -> None:
    return None


def begin(anchor: torch.Tensor, handle: int, layer: int) -> None:
    """Layer start: the custom op while compiling, a direct call otherwise (cheaper)."""
    if torch.compiler.is_compiling():
        torch.ops.ringflow.layer_begin(anchor, handle, layer)
    else:
        _STEPPERS[handle].before(layer)


def end(anchor: torch.Tensor, handle: int, layer: int) -> None:
    if torch.compiler.is_compiling():
        torch.ops.ringflow.layer_end(anchor, handle, layer)
    else:
        _STEPPERS[handle].after(layer)
