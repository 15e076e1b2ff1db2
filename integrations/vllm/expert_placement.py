"""The chosen layers' routed experts put in pinned host memory by ringflow, as vLLM builds them.

Note [Ringflow places the chosen experts]
    The expert lane reads each chosen layer's routed experts from pinned host memory through
    a CUDA view of it (Note [Experts in vLLM], step 1). Until December 2026 vLLM's UVA
    offloader put them there (``--cpu-offload-gb G --cpu-offload-params experts``), which
    takes whole parameters of the *first* layers until ``G`` GiB: a user had to compute
    ``G``, could not choose which layers, and on vLLM 0.26 had to select the V1 model runner
    (its V2 runner makes no offloader).

    ringflow now does what that offloader does, for the layers the profile chose:
    ``make_layers`` hands a generator of freshly built (not yet loaded) decoder layers to the
    process's offloader (``BaseOffloader.wrap_modules``, where :mod:`layers` records the
    stack). Without offload flags that is vLLM's no-op offloader, which builds the whole stack
    before it returns; so :class:`HostPlacement` is told of each layer as the generator yields
    it, before the next one is built (``StackWatcher.built``), and gives each parameter of a
    chosen layer's ``RoutedExperts`` (weights and, for fp8, their scales) pinned host memory of
    its own, copies what the parameter held (scales start at one), and sets ``p.data`` to
    vLLM's CUDA view of it (``get_accelerator_view_from_cpu_tensor``) with vLLM's own mark
    ``_vllm_is_uva_offloaded``. At most one layer's experts are then in device memory at a
    time, as under vLLM's UVA offloader. Under another offloader (UVA, prefetch), which may take
    parameters itself, the chosen layers move once it returned the stack (``wrapped``), so
    until then the stack's chosen experts it left are in device memory. vLLM then loads the
    checkpoint through the views, and its ``device_loading_context`` re-offloads a marked
    parameter that weight processing replaced (fp8), exactly as for its UVA offloader; vLLM
    sizes its KV cache without the experts.

    * A parameter vLLM's UVA offloader already took (the flags above, still accepted) stays
      as it is.
    * A chosen layer's parameter on the CPU while the layer computes on a GPU was taken by
      vLLM's prefetch offloader (``--offload-backend prefetch``), which would swap it into its
      own buffers: refused, naming the layer.
    * A parameter on the meta device is quantized at load (``--quantization fp8`` over a bf16
      checkpoint) and has no data yet: refused, naming the fp8 checkpoints the lane serves.
    * Only the first stack with MoE layers is placed: the target model's, which vLLM builds
      before a draft model's. :func:`check_placed` refuses a lane whose decoder is another.
    * On vLLM's CPU build the experts are already in host memory: nothing is placed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ringflow.errors import RingflowError, UnsupportedModelError
from ringflow.integrations.vllm import compat, startup_errors
from ringflow.integrations.vllm.experts import moe_runners_of
from ringflow.integrations.vllm.layers import StackWatcher, stage_layers
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.sections import picks, resolve_layers
from ringflow.units import mib

log = logging.getLogger("ringflow")

_VIEW = "vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor"


def layer_params(index: int, layer, device: str) -> list:
    """Decoder layer ``index``'s routed-expert parameters (all of its MoE runners') that are in
    ``device`` memory and must move to host memory: those vLLM's UVA offloader took stay.

    Raises:
        UnsupportedModelError: the experts are on the meta device (quantized at load) or in
            host memory another offloader manages.
    """
    found = []
    for runner in moe_runners_of(layer):
        for name, p in runner.routed_experts.named_parameters():
            if getattr(p, "_vllm_is_uva_offloaded", False):
                continue
            if p.device.type == device:
                found.append(p)
            elif p.is_meta:
                raise UnsupportedModelError(
                    f"experts: layer {index}'s routed experts ({name}) are quantized as vLLM "
                    f"loads them (--quantization over a bf16 checkpoint): they have no data "
                    f"when ringflow puts them in host memory; serve an fp8 checkpoint (per "
                    f"tensor, or in 128x128 blocks like Qwen3-*-FP8 and DeepSeek-V3), or the "
                    f"bf16 one without --quantization")
            else:
                raise UnsupportedModelError(
                    f"experts: layer {index}'s routed experts ({name}) are on {p.device}, "
                    f"where vLLM's offloader put them (--offload-backend prefetch keeps them "
                    f"for its own buffers; its UVA offloader does without UVA); ringflow "
                    f"serves the chosen layers' experts itself: leave experts out of "
                    f"--offload-params, or drop layer {index} from experts.layers")
    return found


def to_place(stack: list, spec, source: str | None, device: str) -> dict[int, list]:
    """:func:`layer_params` of ``stack``'s chosen layers (``spec.layers``, indices of this
    stage's layers) that have any. A chosen index without MoE is left to the lane's own
    refusal (``experts.enable``).

    Raises:
        ProfileError: a listed layer does not exist.
    """
    chosen = resolve_layers("experts.layers", spec.layers, len(stack), source)
    found = {i: layer_params(i, stack[i], device) for i in chosen}
    return {i: params for i, params in found.items() if params}


def _pinned_view(state: PluginState) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function giving a device parameter's data pinned host memory of its own, as vLLM's
    CUDA view of it."""
    view = compat.get(state, _VIEW)
    if view is None:
        raise UnsupportedModelError(f"experts: this vLLM has no {_VIEW} (ringflow reads the "
                                    f"host-memory experts through vLLM's CUDA view of them): "
                                    f"use a vLLM ringflow supports, or drop the experts section")

    def move(data: torch.Tensor) -> torch.Tensor:
        pinned = torch.empty_strided(data.size(), data.stride(), dtype=data.dtype,
                                     device="cpu", pin_memory=True)
        pinned.copy_(data)
        return view(pinned)

    return move


class HostPlacement(StackWatcher):
    """Watches the decoder stacks vLLM builds while the model loads (``layers.recording``) and
    puts the first MoE stack's chosen experts in pinned host memory (Note [Ringflow places the
    chosen experts]): each layer as it is built under vLLM's no-op offloader, else (and what is
    left) once the offloader wrapped the stack. ``move`` turns a parameter's data into its
    host-memory view (default: pinned memory and vLLM's CUDA view; tests pass their own, and
    then the load's device may be the CPU)."""

    def __init__(self, state: PluginState, profile, move=None):
        self.state, self.spec, self.source = state, profile.experts, profile.source
        self.move = move
        self.stack: list | None = None  # the stack placed (None: none yet)
        self.layers: list[int] = []  # its layers with experts moved here
        self._moved: dict[int, int] = {}  # its layers moved so far -> bytes
        self._mover = None

    def _device(self) -> str | None:
        """The device vLLM builds the layers on (its loader sets torch's default device), or
        None where nothing is placed (vLLM's CPU build: the experts are in host memory)."""
        device = torch.get_default_device().type
        return device if device == "cuda" or self.move is not None else None

    def _place(self, found: dict[int, list]) -> None:
        move = self._mover = self._mover or self.move or _pinned_view(self.state)
        for i, params in found.items():
            for p in params:
                p.data = move(p.data)
                p._vllm_is_uva_offloaded = True  # vLLM's mark: re-offloaded after processing
                self._moved[i] = self._moved.get(i, 0) + p.data.numel() * p.data.element_size()

    def built(self, index: int, layer) -> None:
        try:
            self._built_one(index, layer)
        except RingflowError as exc:
            startup_errors.fail(exc)  # one line, last (Note [One line at start-up])

    def wrapped(self, stack: list) -> None:
        try:
            self._wrapped(stack)
        except RingflowError as exc:
            startup_errors.fail(exc)

    def _built_one(self, index: int, layer) -> None:
        if self.stack is not None:
            return  # a draft model's stack, built after the target's
        if index == 0:
            self._moved = {}  # a new stack
        device = self._device()
        if device is not None and picks(self.spec.layers, index):
            self._place({index: layer_params(index, layer, device)})

    def _wrapped(self, stack: list) -> None:
        if self.stack is not None:
            return
        layers = stage_layers(stack)
        if not any(moe_runners_of(layer) for layer in layers):
            return  # (so nothing of it was placed as built: it has no routed experts)
        self.stack = layers
        device = self._device()
        if device is None:
            return
        self._place(to_place(layers, self.spec, self.source, device))
        self.layers = sorted(self._moved)
        if self.layers:
            log.info("experts: ringflow put layers %s's routed experts (%s) in pinned host "
                     "memory as vLLM built them (no --cpu-offload-gb needed)", self.layers,
                     mib(sum(self._moved.values())))


def check_placed(placement: HostPlacement | None, decoder: list) -> None:
    """Refuse a lane whose decoder is not the stack ringflow placed experts of: the first MoE
    stack built in this load was another model's (Note [Ringflow places the chosen experts])."""
    if placement is None or not placement.layers:
        return
    if [id(m) for m in placement.stack] != [id(m) for m in decoder]:
        raise UnsupportedModelError(
            "experts: ringflow put the experts of the first MoE stack vLLM built in host "
            "memory, and that stack is not this model's decoder (a draft model built first?); "
            "drop the experts section for this model")
