"""WeightStreamer: stream chosen layers' weights from host memory through a ring of device slots.

Independent of vLLM: it takes a list of layer modules (a model's decoder layers) and works on any
``nn.Module`` whose forward reads its parameters, so the GPU tests drive it with plain torch
modules of real decoder-layer shapes.

Note [Weight slots]
    Each offloaded layer's parameters are grouped by the storage they live in (MLA's ``W_UV`` and
    ``W_UK_T`` are views of ``kv_b_proj.weight``: one storage, copied once). A layer's storages
    are laid out back to back (256-byte aligned) in one pinned host buffer, and the same layout
    in its ring slot, so one gather is one host-to-device copy. The planner gives the i-th
    offloaded layer slot ``i % slots`` in every forward, so each parameter points at its slot
    once, here, with its original shape, strides and offset; what changes per forward is only
    what the slot holds. The device copies of offloaded weights are dropped before the ring is
    allocated, and both happen before the engine sizes its KV cache.

Note [Weights that change]
    An engine that rewrites weights after load (a reload from disk or an iterator, an in-place
    ``load_weights``) writes into whatever ``param.data`` is: for an offloaded layer, a slot the
    next gather overwrites. :meth:`WeightStreamer.writing_weights` points the offloaded
    parameters at their host copies for the write (a loader that assigns ``param.data`` instead
    is followed: its values are copied into the host copy), then back at their slots, and tells
    the plan its sources changed, so no slot filled from the old weights, carried into the next
    forward or not, is read again: the carried slots are re-filled before the write returns
    (Note [Prime at the write] in graphs/executor.py), since the engine's next step may be a
    replay of a graph it captured, which runs none of ringflow's Python. Resident layers are written where they live, as always.
    What moves weights some other way is not followed and is refused with one line by the vLLM
    plugin (``refusal`` and ``on_engine_sleep`` in integrations/vllm/weights.py):
    sleep levels 1 and 2 (vLLM's allocator would move or drop the ring and the slots the
    captured graphs address), the weight-transfer engine, and LoRA adapters (in the front end).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ringflow.errors import (AllocationError, BudgetError, ConfigError, LifecycleError,
                             UnsupportedModelError)
from ringflow.graphs.eager import executor_for
from ringflow.graphs.slots import SlotPool
from ringflow.graphs.stepped import LayerStepper, engine_computes
from ringflow.integrations.torch import layer_ops
from ringflow.kernels import copy_host_to_device
from ringflow.orchestrator.dag import NodeKind
from ringflow.orchestrator.planner import Planner
from ringflow.units import MIB, ceil_div, mib

log = logging.getLogger("ringflow")
ALIGN = 256
LANE = "weights"


@dataclass
class _Region:
    """One storage of a layer: where it sits in the layer's slot, and the params viewing it."""

    offset: int
    nbytes: int
    source: torch.Tensor | None  # uint8 view of the original storage (dropped once copied)
    params: list[tuple[str, nn.Parameter, int]] = field(default_factory=list)  # + element offset


def _layout(index: int, layer: nn.Module) -> tuple[list[_Region], int]:
    regions: dict[int, _Region] = {}
    offset = 0
    for name, param in layer.named_parameters(remove_duplicate=False):
        storage = param.untyped_storage()
        key = storage.data_ptr()
        region = regions.get(key)
        if region is None:
            raw = torch.empty(0, dtype=torch.uint8, device=param.device)
            raw.set_(storage, 0, (storage.nbytes(),), (1,))
            region = _Region(offset, storage.nbytes(), raw)
            regions[key] = region
            offset += ceil_div(storage.nbytes(), ALIGN) * ALIGN
        region.params.append((name, param, param.storage_offset()))
    if not regions:
        raise UnsupportedModelError(f"decoder layer {index} has no parameters to offload; leave "
                                    f"it out of the offloaded layers")
    return list(regions.values()), offset


class WeightStreamer:
    """Streams the weights of ``offload`` layers of ``layers`` through a ring of slots.

    Args:
        layers: the model's decoder layers, in execution order.
        offload: indices (into ``layers``) whose weights move to host memory.
        depth: layers of lookahead; the ring holds ``depth + 1`` layer-slots (reduced to fit);
            one slot still prefetches behind resident layers.
        cross_forward: fill the next forward's first layer-slots during this forward's last
            layers (Note [Forward boundary] in orchestrator/dag.py).
        synchronous: copy each layer's weights on the compute stream right before it runs.
        workspace_bytes: device budget of the ring.
        capture: policy inside a CUDA graph capture (``join``, ``sync``, ``error``).
        gather_priority: stream priority of the copy lane.
        poison: fill a slot with NaN bytes after its layer ran (debug).
        wrap: install the forward wrappers around the plan's boundary layers: the first, the
            last and the offloaded ones (tests may drive :attr:`stepper` by hand).
        breaker: runs each layer op's stepper call, for an engine that breaks its CUDA graph
            capture at run time (Note [Capture breaks] in layer_ops.py).

    Raises:
        ConfigError: an offloaded layer that does not exist, or none at all.
        BudgetError: a ring smaller than one offloaded layer's weights.
        UnsupportedModelError: weights shared between layers, or a layer without weights.
        AllocationError: host memory that cannot be pinned, or a ring that cannot be allocated.
    """

    def __init__(self, layers: Sequence[nn.Module], offload: Iterable[int], *, depth: int,
                 workspace_bytes: int, capture: str = "join", gather_priority: str = "normal",
                 poison: bool = False, wrap: bool = True, name: str = "weights",
                 cross_forward: bool = True, synchronous: bool = False,
                 breaker=None) -> None:
        self.layers = list(layers)
        count = len(self.layers)
        self.offloaded = sorted(set(offload))
        bad = [i for i in self.offloaded if not 0 <= i < count]
        if bad:
            raise ConfigError(f"offload: layers {bad} do not exist: the stack has {count} layers "
                              f"(0..{count - 1})")
        if not self.offloaded:
            raise ConfigError(f"offload: no layer to stream; give indices in 0..{count - 1}")
        layouts = {i: _layout(i, self.layers[i]) for i in self.offloaded}
        self._check_unshared(layouts)
        self.device = next(iter(layouts.values()))[0][0].source.device
        self.layer_bytes = {i: used for i, (_, used) in layouts.items()}
        slot_bytes = max(self.layer_bytes.values())

        # 1. host copies (pinned where a GPU will read them), then params point at them, so the
        #    device copies of offloaded weights are freed before the ring is allocated
        self.host: dict[int, torch.Tensor] = {}
        for i, (regions, used) in layouts.items():
            host = self._host_buffer(used)
            for region in regions:
                host[region.offset: region.offset + region.nbytes].copy_(region.source)
                self._point(region, host)
                region.source = None
            self.host[i] = host
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

        # 2. the ring (one allocation) and the plan over it
        try:
            self.pool = SlotPool(LANE, (slot_bytes,), torch.uint8, depth=depth,
                                 workspace_bytes=workspace_bytes, device=self.device)
        except BudgetError as exc:  # say it in layers: what the caller chose
            raise BudgetError(LANE, slot_bytes, workspace_bytes, what="offloaded layer's weights",
                              hint=" (depth d needs d + 1 layers' worth)") from exc
        self.dag = Planner(count, [self.pool.layout], gathered=self.offloaded, name=name,
                           cross_forward=[LANE] if cross_forward else (),
                           synchronous=synchronous).plan()
        self.slot_of = {n.layer: n.slot for n in (*self.dag.nodes, *self.dag.prime)
                        if n.kind in (NodeKind.GATHER, NodeKind.SYNC_GATHER)}

        self._regions = {i: regions for i, (regions, _) in layouts.items()}
        self.saved_bytes: int | None = None  # device bytes streaming freed (the plugin measures)
        self._writing = 0  # writing_weights depth
        self.weight_updates = 0

        # 3. every offloaded parameter now views its layer's slot (Note [Weight slots])
        for i, (regions, _) in layouts.items():
            slot = self.pool.storage[self.slot_of[i]]
            for region in regions:
                self._point(region, slot)

        self.executor = executor_for(self.dag, [self.pool], self._gather, engine_computes,
                                     capture=capture,
                                     gather_priority=gather_priority, poison=False)
        self.stepper = LayerStepper(self.executor, poison=poison)
        self.handle = layer_ops.register_stepper(self.stepper, breaker=breaker)
        self._originals: dict[int, object] = {}
        if wrap:  # only the boundary layers (Note [Boundary layers] in graphs/stepped.py)
            for i in self.stepper.boundaries:
                self._wrap(i, self.layers[i])

    # -- setup helpers ------------------------------------------------------------------------

    def _check_unshared(self, layouts) -> None:
        owner: dict[int, int] = {}
        for i, (regions, _) in layouts.items():
            for region in regions:
                for name, param, _ in region.params:
                    first = owner.setdefault(id(param), i)
                    if first != i:
                        raise UnsupportedModelError(
                            f"parameter '{name}' is shared by decoder layers {first} and {i}; "
                            f"ringflow cannot stream shared weights: leave one of those layers "
                            f"resident")

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8)  # on a CPU the "host" is plain memory
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise AllocationError(f"pinning {nbytes / MIB:.1f} MiB of host memory for offloaded "
                                  f"weights failed ({exc}); raise the locked-memory limit "
                                  f"(ulimit -l) or offload fewer layers") from exc

    @staticmethod
    def _point(region: _Region, buffer: torch.Tensor) -> None:
        """Make every param of ``region`` view ``buffer`` at the region's offset."""
        for _, param, offset in region.params:
            param.data = _view(region, buffer, param, offset)

    def host_copies(self, layer: int) -> dict[str, torch.Tensor]:
        """The host copies of offloaded layer ``layer``'s parameters, by name, each shaped like
        its parameter: what every gather of that layer copies into its slot (tests change one
        to prove that the layer really computes from its slot)."""
        if layer not in self._regions:
            raise ConfigError(f"layer {layer} is not offloaded; offloaded layers: "
                              f"{self.offloaded}")
        return {name: _view(region, self.host[layer], param, offset)
                for region in self._regions[layer] for name, param, offset in region.params}

    @contextlib.contextmanager
    def writing_weights(self, what: str = "a weight update"):
        """While an engine writes new weights (a reload, ``load_weights``): the offloaded
        layers' parameters view their host copies, so every write lands where the gathers
        read; afterwards they view their slots again, the carried slots are re-filled from the
        new weights at once and every other slot by the forward that reads it (Note [Weights
        that change]). Re-entrant; between forwards.

        Raises:
            LifecycleError: a forward is in flight.
            UnsupportedModelError: the write changed a streamed parameter's shape or dtype.
        """
        if self._writing:
            self._writing += 1
            try:
                yield
            finally:
                self._writing -= 1
            return
        if self.stepper.in_forward:
            raise LifecycleError(f"{what} arrived in the middle of a forward of the streamed "
                                 f"layers; write weights between forwards")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy still reads the host copies
        views = {}
        for i, regions in self._regions.items():
            for region in regions:
                self._point(region, self.host[i])
                views.update({id(param): param.data for _, param, _ in region.params})
        self._writing = 1
        try:
            yield
        finally:
            self._writing = 0
            self._follow_replaced(views, what)
            for i, regions in self._regions.items():
                slot = self.pool.storage[self.slot_of[i]]
                for region in regions:
                    self._point(region, slot)
            # the carried slots are re-filled now, not at the next forward ringflow issues: a
            # graph the engine replays next reads them (Note [Prime at the write])
            self.stepper.sources_changed(LANE)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # whichever stream the engine uses next
            self.weight_updates += 1

    def _follow_replaced(self, views: dict, what: str) -> None:
        """A loader that assigned ``param.data`` instead of copying into it: its values go
        into the host copy (same shape and dtype), or the write cannot be followed."""
        for i, regions in self._regions.items():
            for region in regions:
                for name, param, offset in region.params:
                    view = views[id(param)]
                    if param.data.data_ptr() == view.data_ptr():
                        continue
                    if param.shape != view.shape or param.dtype != view.dtype:
                        raise UnsupportedModelError(
                            f"{what} gave streamed parameter '{name}' of layer {i} a new "
                            f"{'shape' if param.shape != view.shape else 'dtype'} "
                            f"({tuple(view.shape)} {view.dtype} -> {tuple(param.shape)} "
                            f"{param.dtype}); ringflow cannot follow it: leave layer {i} "
                            f"resident")
                    view.copy_(param.data)

    #: called before each gather on the copy stream (tests inject a sleep kernel here)
    gather_hook = None

    def _gather(self, layer: int, lane: str, out: torch.Tensor) -> None:
        if self.gather_hook is not None:
            self.gather_hook()
        copy_host_to_device(self.host[layer], out[: self.layer_bytes[layer]])

    def _wrap(self, index: int, layer: nn.Module) -> None:
        # remember an instance-level forward (someone else's wrapper) to put it back on close
        self._originals[index] = layer_ops.wrap_layer(layer, self.handle, index)

    # -- reporting and teardown ---------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes

    def describe(self) -> str:
        layers = self.offloaded
        shown = layers if len(layers) <= 12 else f"{layers[:6]} ... {layers[-3:]}"
        return (f"streaming the weights of {len(layers)} of {len(self.layers)} decoder layers "
                f"({shown}) through {self.pool.slots} slot(s) x {mib(self.pool.slot_bytes)}"
                f" = {mib(self.reserved_bytes)} on {self.device} (depth "
                f"{self.pool.depth}; {self.pool.layout.arithmetic()}); "
                f"{self._boundary()}; {self._wrapped()}; executor: {self.executor.kind}")

    def _wrapped(self) -> str:
        if not self._originals:
            return "no layer ops (the caller steps the plan)"
        return (f"layer ops around {len(self._originals)} of {len(self.layers)} layers (the "
                f"first, the last and the offloaded ones)")

    def _boundary(self) -> str:
        if self.dag.meta.get("synchronous"):
            return "synchronous: each layer's copy runs on the compute stream before it"
        carried = [layer for _, layer, _ in self.dag.carried]
        if carried:
            return (f"layers {carried} are filled during the previous forward's last layers "
                    f"(cross-forward)")
        return "every forward fills its first slots at its start"

    def close(self) -> None:
        """Unhook the layers and free the ring (host-syncs). The offloaded layers stop working."""
        for index, original in self._originals.items():
            layer_ops.unwrap_layer(self.layers[index], original)
        self._originals.clear()
        layer_ops.unregister_stepper(self.handle)
        self.pool.close()


def _view(region: _Region, buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """``param``'s shape, strides and offset over ``region``'s bytes in ``buffer``."""
    typed = buffer[region.offset: region.offset + region.nbytes].view(param.dtype)
    return typed.as_strided(param.shape, param.stride(), typed.storage_offset() + offset)
