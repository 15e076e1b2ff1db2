"""The chosen layers' routed experts put in pinned host memory by ringflow, as vLLM builds them.

Note [Ringflow places the chosen experts]
    The expert lane reads each chosen layer's routed experts from pinned host memory through
    a CUDA view of it (Note [Experts in vLLM], step 1). Until December 2026 vLLM's UVA
    offloader put them there (``--cpu-offload-gb G --cpu-offload-params experts``), which
    takes whole parameters of the *first* layers until ``G`` GiB: a user had to compute
    ``G``, could not choose which layers, and on vLLM 0.26 had to select the V1 model runner
    (its V2 runner makes no offloader).

    ringflow now does what that offloader does, for the layers the profile chose:
    ``make_layers`` hands every freshly built (not yet loaded) decoder stack to the process's
    offloader (``BaseOffloader.wrap_modules``, where :mod:`layers` records it). Right after
    the offloader wrapped the stack, :class:`HostPlacement` gives each parameter of a chosen
    layer's ``RoutedExperts`` (weights and, for fp8, their scales) pinned host memory of its
    own, copies what the parameter held (scales start at one), and sets ``p.data`` to vLLM's
    CUDA view of it (``get_accelerator_view_from_cpu_tensor``) with vLLM's own mark
    ``_vllm_is_uva_offloaded``. vLLM then loads the checkpoint through that view, and its
    ``device_loading_context`` re-offloads a marked parameter that weight processing replaced
    (fp8), exactly as for its UVA offloader. The experts never occupy device memory, so a
    model larger than the GPU loads, and vLLM sizes its KV cache without them.

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

from ringflow.errors import UnsupportedModelError
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.experts import moe_runners_of
from ringflow.integrations.vllm.layers import stage_layers
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.sections import resolve_layers
from ringflow.units import mib

log = logging.getLogger("ringflow")

_VIEW = "vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor"


def to_place(stack: list, spec, source: str | None, device: str) -> dict[int, list]:
    """The parameters of ``stack``'s chosen layers (``spec.layers``, indices of this stage's
    layers) that are in ``device`` memory and must move to host memory, per layer: each
    chosen MoE layer's ``RoutedExperts`` parameters, less those vLLM's UVA offloader took.
    A chosen index without MoE is left to the lane's own refusal (``experts.enable``).

    Raises:
        UnsupportedModelError: a chosen layer's experts are on the meta device (quantized at
            load) or in host memory vLLM's prefetch offloader manages.
    """
    chosen = resolve_layers("experts.layers", spec.layers, len(stack), source)
    found: dict[int, list] = {}
    for i in chosen:
        for runner in moe_runners_of(stack[i]):
            for name, p in runner.routed_experts.named_parameters():
                if getattr(p, "_vllm_is_uva_offloaded", False):
                    continue
                if p.device.type == device:
                    found.setdefault(i, []).append(p)
                elif p.is_meta:
                    raise UnsupportedModelError(
                        f"experts: layer {i}'s routed experts ({name}) are quantized as vLLM "
                        f"loads them (--quantization over a bf16 checkpoint): they have no "
                        f"data when ringflow puts them in host memory; serve an fp8 "
                        f"checkpoint (per tensor, or in 128x128 blocks like Qwen3-*-FP8 and "
                        f"DeepSeek-V3), or the bf16 one without --quantization")
                else:
                    raise UnsupportedModelError(
                        f"experts: layer {i}'s routed experts ({name}) are on {p.device}, "
                        f"where vLLM's prefetch offloader (--offload-backend prefetch) keeps "
                        f"them for its own buffers; ringflow serves the chosen layers' experts "
                        f"itself: leave experts out of --offload-params, or drop layer {i} "
                        f"from experts.layers")
    return found


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


class HostPlacement:
    """Called with every decoder stack vLLM builds while the model loads (``layers.recording``):
    puts the first MoE stack's chosen experts in pinned host memory (Note [Ringflow places the
    chosen experts]). ``move`` turns a parameter's data into its host-memory view (default:
    pinned memory and vLLM's CUDA view; tests pass their own)."""

    def __init__(self, state: PluginState, profile, move=None):
        self.state, self.spec, self.source = state, profile.experts, profile.source
        self.move = move
        self.stack: list | None = None  # the stack placed (None: none yet)
        self.layers: list[int] = []  # its layers with experts moved here

    def __call__(self, stack: list) -> None:
        if self.stack is not None:
            return  # a draft model's stack, built after the target's
        layers = stage_layers(stack)
        if not any(moe_runners_of(layer) for layer in layers):
            return
        self.stack = layers
        device = next((p.device.type for layer in layers for p in layer.parameters()
                       if p.device.type not in ("cpu", "meta")), None)
        if device is None and self.move is None:
            return  # vLLM's CPU build: the experts are in host memory already
        found = to_place(layers, self.spec, self.source, device or "cpu")
        if not found:
            return
        move = self.move or _pinned_view(self.state)
        moved = 0
        for params in found.values():
            for p in params:
                p.data = move(p.data)
                p._vllm_is_uva_offloaded = True  # vLLM's mark: re-offloaded after processing
                moved += p.data.numel() * p.data.element_size()
        self.layers = sorted(found)
        log.info("experts: ringflow put layers %s's routed experts (%s) in pinned host memory "
                 "as vLLM built them (no --cpu-offload-gb needed)", self.layers, mib(moved))


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
