"""Custom ops that mark a decoder layer's start and end for the LayerStepper.

Under ``torch.compile`` (vLLM compiles its models) Python hooks would be traced away or
reordered; these ops are opaque to the compiler, and what they declare to mutate is what keeps
every read of a streamed layer's slot between its wait and its release
(Note [Release boundary under torch.compile]). In eager mode the hooks call the stepper
directly.

An engine that compiles its model into pieces can make them its splitting ops (vLLM's plugin
registers them with vLLM's piecewise CUDA graphs), so they run eagerly between graph pieces and
the gather streams never cross a piece boundary. An engine that breaks its capture at run time
instead (vLLM's breakable CUDA graphs) gets the same by a ``breaker`` (Note [Capture breaks]).

Note [Capture breaks]
    vLLM's breakable CUDA graphs capture the whole forward on one stream and, at each attention
    op, end the capture, run the op eagerly and begin a new one; a replay runs the captured
    segments and calls the eager ops again, in order. A gather forked inside one segment and
    joined in a later one would leave the first segment's capture unjoined (a capture error),
    and a wait on an event of an ended capture is not allowed. So the layer ops become breaks
    too: ``register_stepper(stepper, breaker=...)`` hands every ``before``/``after`` call to the
    breaker, which runs it between segments at capture and again at every replay. The stepper
    then runs as in eager mode (gathers forked and joined on real streams, carried slots primed
    by its own Python), the side streams never enter a capture, and the copies overlap the
    captured segments that follow them. Outside such a capture the breaker just calls.

Note [Release boundary under torch.compile]
    ``layer_begin(anchor)`` declares that it mutates the layer's hidden-state input;
    ``layer_end(tensors)`` declares that it mutates *every tensor the layer returned*.
    Functionalization turns each into an ``auto_functionalized`` node that consumes those
    tensors and produces their new versions, and rewrites every later use to the new versions.
    Hence, under Inductor:

    * Release: a value the layer returned is an input of ``layer_end``, so it is materialized
      into a buffer before the op runs, and every later reader reads the op's (re-inplaced)
      result. Inductor cannot recompute a returned value after the release from the layer's
      weights, because the recomputed value would be the pre-mutation version, which the graph
      no longer refers to. Every returned tensor must be anchored, not just the hidden states:
      a sandwich-norm residual (Gemma2, Gemma3) that is recomputable from a streamed norm
      weight would otherwise be recomputed after the slot was refilled.
    * Wait: every kernel that combines a weight with the layer's activations depends on the
      anchor's post-``begin`` version, so it runs after the wait.

    Where this does not hold:

    * A value computed from the slot that leaves the layer other than through its return value
      (stored in a module attribute, written into a buffer that is not returned) is not
      anchored and may be read after the release.
    * A kernel that reads *only* weights (a norm's ``1 + w`` materialized on its own) depends on
      no declared tensor, so nothing forbids running it before the wait. Inductor inlines such
      pointwise work into its consumer and keeps graph order otherwise; declaring the slot's
      parameters mutated by ``layer_begin`` would close it, but they alias one ring storage and
      AOTAutograd's synthetic-base path for mutated aliased inputs fails (torch 2.13,
      ``assert_size_stride`` on the synthetic base) for rings of several layers.
    * Freezing (``torch._inductor.config.freezing``) would constant-fold weights; vLLM does
      not freeze.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from ringflow.errors import UnsupportedModelError
from ringflow.graphs.stepped import LayerStepper

# weak: a stepper lives as long as its streamer (owned by the engine's worker), not longer
_STEPPERS: weakref.WeakValueDictionary[int, LayerStepper] = weakref.WeakValueDictionary()
#: handle -> how its calls run (Note [Capture breaks]); absent: called directly
_BREAKERS: dict[int, Callable[[Callable[[int], None], int], object]] = {}
_HANDLES = itertools.count(1)
OP_NAMES = ("ringflow::layer_begin", "ringflow::layer_end")


def register_stepper(stepper: LayerStepper, *,
                     breaker: Callable[[Callable[[int], None], int], object] | None = None) -> int:
    """A handle the ops use to find ``stepper`` (kept alive until :func:`unregister_stepper`).
    ``breaker(call, layer)``, if given, runs each ``before``/``after`` call (Note [Capture
    breaks])."""
    handle = next(_HANDLES)
    _STEPPERS[handle] = stepper
    if breaker is not None:
        _BREAKERS[handle] = breaker
    return handle


def unregister_stepper(handle: int) -> None:
    _STEPPERS.pop(handle, None)
    _BREAKERS.pop(handle, None)


def _step(handle: int, begin: bool, layer: int) -> None:
    stepper = _STEPPERS[handle]
    call = stepper.before if begin else stepper.after
    breaker = _BREAKERS.get(handle)
    if breaker is None:
        call(layer)
    else:
        breaker(call, layer)


@torch.library.custom_op("ringflow::layer_begin", mutates_args=("anchor",))
def layer_begin(anchor: torch.Tensor, handle: int, layer: int) -> None:
    _step(handle, True, layer)


@layer_begin.register_fake
def _layer_begin_fake(anchor: torch.Tensor, handle: int, layer: int) -> None:
    return None


@torch.library.custom_op("ringflow::layer_end", mutates_args=("tensors",))
def layer_end(tensors: list[torch.Tensor], handle: int, layer: int) -> None:
    _step(handle, False, layer)


@layer_end.register_fake
def _layer_end_fake(tensors: list[torch.Tensor], handle: int, layer: int) -> None:
    return None


def begin(anchor: torch.Tensor, handle: int, layer: int) -> None:
    """Layer start (``anchor``: the layer's hidden-state input): the custom op while
    compiling, a direct call otherwise (cheaper)."""
    if torch.compiler.is_compiling():
        torch.ops.ringflow.layer_begin(anchor, handle, layer)
    else:
        _step(handle, True, layer)


def end(output: object, handle: int, layer: int) -> None:
    """Layer end: ``output`` is whatever the layer returned; every tensor in it is anchored."""
    if torch.compiler.is_compiling():
        leaves = torch.utils._pytree.tree_leaves(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        torch.ops.ringflow.layer_end(tensors, handle, layer)
    else:
        _step(handle, False, layer)


def wrap_layer(layer: torch.nn.Module, handle: int, index: int):
    """Put ``layer``'s forward between ``begin`` and ``end`` for the stepper ``handle``.

    Returns the instance-level forward it replaced (None: the class's), for
    :func:`unwrap_layer`.
    """
    original = layer.forward
    previous = layer.__dict__.get("forward")

    def forward(*args, **kwargs):
        begin(_anchor_in(args, kwargs), handle, index)
        out = original(*args, **kwargs)
        end(out, handle, index)  # Note [Release boundary under torch.compile]
        return out

    layer.forward = forward
    return previous


def unwrap_layer(layer: torch.nn.Module, previous) -> None:
    if previous is None:
        del layer.forward  # back to the class's forward: no cycle left
    else:
        layer.forward = previous


def _anchor_in(args: tuple, kwargs: dict) -> torch.Tensor:
    """The tensor a decoder layer reads first: its hidden states (``forward(positions,
    hidden_states, residual)`` in vLLM's models), else its first tensor argument."""
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise UnsupportedModelError("a streamed decoder layer was called without a tensor "
                                    "argument; ringflow anchors its wait on the layer's hidden "
                                    "states: leave this layer resident")
    return tensors[1] if len(tensors) > 1 else tensors[0]
