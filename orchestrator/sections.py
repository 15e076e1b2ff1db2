"""The sections of a profile as validated values: the slot, the synthetic workload, and the two
vLLM sections (``offload``: weight streaming; ``kv_prefetch``: full-KV prefetch), each with the
parser that builds it from its mapping (checked against :data:`~ringflow.orchestrator.schema.FIELDS`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ringflow.errors import ProfileError
from ringflow.orchestrator.budget import MAX_LAYERS, MAX_SLOT_BYTES
from ringflow.orchestrator.schema import (FIELDS, LANE_NAME, field_value, int_in, layer_set,
                                          rejected, section, section_keys)
from ringflow.orchestrator.placement import choose
from ringflow.orchestrator.vocab import DTYPE_BYTES


@dataclass(frozen=True)
class SlotShape:
    """Shape and dtype of one slot."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Workload:
    """Parameters of the synthetic workload ``ringflow run`` drives (FIELDS ``workload.*``)."""

    gather: str
    queries: int
    store_layers: int
    block_size: int
    seed: int
    compute: str
    hidden: int
    intermediate: int
    heads: int

    def decoder_elements(self) -> int:
        """Elements of one decoder layer's weights: QKV, O, gate/up, down, two norms."""
        h, i = self.hidden, self.intermediate
        return 3 * h * h + h * h + 2 * i * h + h * i + 2 * h


def workload_section(doc: Any, source: str | None) -> Workload:
    doc = section("workload", doc, source)
    return Workload(**{key: field_value(doc, f"workload.{key}", source) for key in section_keys("workload")})


def slot_section(doc: Any, source: str | None) -> SlotShape:
    doc = section("slot", doc, source)
    shape, dtype = field_value(doc, "slot.shape", source), field_value(doc, "slot.dtype", source)
    if not isinstance(shape, list) or not shape:
        raise rejected("slot.shape", shape, source)
    slot = SlotShape(tuple(int_in("slot.shape", d, source, FIELDS["slot.shape"].lo)
                           for d in shape), dtype)
    if slot.nbytes > MAX_SLOT_BYTES:
        raise ProfileError("slot.shape", f"one slot of {slot.nbytes:,} bytes exceeds the "
                           f"{MAX_SLOT_BYTES:,}-byte limit; accepted: a smaller shape", source)
    return slot


def lane_names(value: Any, source: str | None) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise rejected("lanes", value, source)
    for lane in value:
        if not isinstance(lane, str) or not LANE_NAME.match(lane):
            raise rejected("lanes", lane, source)
    if len(set(value)) != len(value):
        raise ProfileError("lanes", f"names repeat in {value}; accepted: unique names", source)
    return tuple(value)


@dataclass(frozen=True)
class Placed:
    """``offload.layers: {count: N}``: N layers, placed by the planner
    (``orchestrator/placement.py``)."""

    count: int


@dataclass(frozen=True)
class OffloadSpec:
    """Which decoder layers stream their weights, how far ahead, within what budget."""

    # "all", explicit indices, (every, last), or Placed(count)
    layers: str | frozenset[int] | tuple[int, int] | Placed
    depth: int
    workspace_mib: float
    synchronous: bool
    cross_forward: bool

    def resolve(self, count: int, source: str | None = None, *,
                costs: tuple[list[float], list[float]] | None = None, slots: int = 2
                ) -> list[int]:
        """The offloaded layer indices of a model with ``count`` decoder layers.

        ``costs`` (per-layer compute and copy ms) and ``slots`` place a ``{count: N}``; without
        costs the layers count as equal (evenly spaced).

        Raises:
            ProfileError: a listed layer does not exist in the model, or the pattern selects
                none of its layers (saying what was asked and what the model has).
        """
        if isinstance(self.layers, Placed):
            if self.layers.count > count:
                raise ProfileError("offload.layers", f"{{count: {self.layers.count}}} asks for "
                                   f"more layers than the model's {count} decoder layers; "
                                   f"accepted: a count of 1..{count}, or 'all'", source)
            compute, copy = costs if costs is not None else ([1.0] * count, [1.0] * count)
            return list(choose(compute, copy, self.layers.count, max(1, slots),
                               self.cross_forward).layers)
        return resolve_layers("offload.layers", self.layers, count, source)

    def to_mapping(self) -> dict:
        layers = ({"count": self.layers.count} if isinstance(self.layers, Placed)
                  else layers_mapping(self.layers))
        return {"layers": layers, "depth": self.depth, "workspace_mib": self.workspace_mib,
                "synchronous": self.synchronous, "cross_forward": self.cross_forward}


def picks(layers: str | frozenset[int] | tuple[int, int], index: int) -> bool:
    """Whether a layer pattern picks layer ``index`` (of a stack whose length may not be known
    yet: :func:`resolve_layers` checks the indices against it)."""
    if layers == "all":
        return True
    if isinstance(layers, tuple):
        every, last = layers
        return index % every >= every - last
    return index in layers


def resolve_layers(name: str, layers: str | frozenset[int] | tuple[int, int], count: int,
                   source: str | None) -> list[int]:
    """The indices a layer pattern (``'all'``, a set, or ``(every, last)``) picks of ``count``
    decoder layers.

    Raises:
        ProfileError: a listed layer does not exist, or the pattern picks none.
    """
    if layers == "all":
        return list(range(count))
    if isinstance(layers, tuple):
        every, last = layers
        chosen = [i for i in range(count) if picks(layers, i)]
        if not chosen:
            raise ProfileError(name, f"{{every: {every}, last: {last}}} selects no layer of a "
                               f"model with {count} decoder layers (0..{count - 1}); accepted: "
                               f"an 'every' of at most {count}, a list of layer indices, or "
                               f"'all'", source)
        return chosen
    missing = sorted(i for i in layers if i >= count)
    if missing:
        raise ProfileError(name, f"layers {missing} do not exist: the model has {count} "
                           f"decoder layers (0..{count - 1})", source)
    return sorted(layers)


def layers_mapping(layers: str | frozenset[int] | tuple[int, int]) -> Any:
    """A layer pattern as a profile spells it."""
    if isinstance(layers, tuple):
        return {"every": layers[0], "last": layers[1]}
    return sorted(layers) if isinstance(layers, frozenset) else layers


def layer_pattern(name: str, spec: Any, source: str | None, placed: bool = False) -> Any:
    """Parse ``'all'``, a non-empty list of indices, ``{every: N, last: K}`` (and, with
    ``placed``, ``{count: N}``) into ``'all'``, a frozenset, a tuple or :class:`Placed`."""
    if spec == "all":
        return "all"
    if isinstance(spec, dict) and placed and "count" in spec:
        group = section(name, spec, source, ["count"])
        return Placed(int_in(name, group["count"], source, 1, MAX_LAYERS))
    if isinstance(spec, dict):
        group = section(name, spec, source, ["every", "last"])
        if set(group) != {"every", "last"}:
            raise rejected(name, spec, source, "needs both 'every' and 'last'")
        every = int_in(name, group["every"], source, 1, MAX_LAYERS)
        return every, int_in(name, group["last"], source, 1, every)
    layers = layer_set(name, spec, MAX_LAYERS, source)
    if not layers:
        raise ProfileError(name, "is empty: nothing would be chosen; accepted: 'all', a "
                           "non-empty list, or {every: N, last: K}", source)
    return layers


def offload_section(doc: Any, source: str | None) -> OffloadSpec:
    doc = section("offload", doc, source)
    values = {key: field_value(doc, f"offload.{key}", source) for key in section_keys("offload")}
    return OffloadSpec(**{**values, "layers": layer_pattern("offload.layers", values["layers"],
                                                             source, placed=True)})


@dataclass(frozen=True)
class ExpertsSpec:
    """Routed experts from host memory through a per-layer cache (Note [Expert cache])."""

    layers: str | frozenset[int] | tuple[int, int]
    #: None: a quarter of the experts, at least top_k; "auto": by memory; a mapping: per layer
    slots: int | str | dict[int, int] | None
    in_place_tokens: int  # steps of at most this many tokens end in place (Note [Expert cache])
    lookahead: bool  # guess the next chosen layer's experts a layer early (Note [Expert lookahead])
    layer_tokens: int = 1024  # steps of at least this many tokens use the layer ring
    #: the layer ring's layers (0: no ring; Note [Expert layer ring]), or "slots": windows of
    #: the slots' memory (Note [Large steps stream through the slots])
    layer_buffers: int | str = 2
    ring_from_slots: bool = True  # fills take what the slots hold (Note [Ring fills from the slots])
    lend_slots: bool = False  # the tail lends the carried layers' slots (Note [Ring lends the ...])
    decode_from_ring: bool = False  # small steps read the held layers (Note [Small steps read ...])
    early_start: bool = False  # an arena's large step starts before its forward (Note [Large ...])
    auto_percent: int = 25  # slots: auto takes this share of what vLLM's budget leaves
    host_share: str | float = "off"  # misses the host's CPU computes (Note [Host split])
    host_tokens: int = 1  # steps of up to this many tokens take the host share (Note [Host split])
    host_rates: str | None = None  # tools/host_rates.py's JSON; None: measured at start-up
    host_threads: int = 0  # the host share's CPU threads; 0: the fastest measured

    def slots_for(self, experts: int, top_k: int, held: int = 0, chosen: int = 1,
                  layer: int | None = None) -> int:
        """The cache slots of ``layer``, with ``experts`` routed experts, ``top_k`` per token
        (``slots: auto`` is sized by :func:`auto_slots` where the memory is known; here it
        takes the default; a mapping names each chosen layer's, checked by
        :meth:`check_slot_layers`). The default, a quarter of the experts, is per chosen layer:
        with ``held`` of the ``chosen`` layers held in the ring (no slots, Note [Small steps
        read the held layers]) their share goes to the others, the same memory in all."""
        if isinstance(self.slots, dict):
            if layer not in self.slots:
                raise ProfileError("experts.slots", f"is a mapping per layer and names no "
                                   f"layer {layer}; give every chosen layer its count", None)
            return min(self.slots[layer], experts)
        if isinstance(self.slots, int):
            return min(self.slots, experts)
        return min(experts, max(top_k, experts // 4) * chosen // (chosen - held))

    def check_slot_layers(self, chosen: list[int], source: str | None,
                          among: bool = False) -> None:
        """A mapping of ``slots`` names exactly the ``chosen`` layers (with ``among``: only
        layers among them, as the front end knows the pattern but not which layers are MoE)."""
        if isinstance(self.slots, dict):
            _check_slot_layers(self.slots, chosen, source, among)

    def to_mapping(self) -> dict:
        out: dict[str, Any] = {"layers": layers_mapping(self.layers)}
        if self.slots is not None:
            out["slots"] = (dict(sorted(self.slots.items())) if isinstance(self.slots, dict)
                            else self.slots)
        out["in_place_tokens"] = self.in_place_tokens
        out["lookahead"] = self.lookahead
        out["layer_tokens"] = self.layer_tokens
        out["layer_buffers"] = self.layer_buffers
        out["ring_from_slots"] = self.ring_from_slots
        out["lend_slots"] = self.lend_slots
        out["decode_from_ring"] = self.decode_from_ring
        out["early_start"] = self.early_start
        out["auto_percent"] = self.auto_percent
        out["host_share"] = self.host_share
        out["host_tokens"] = self.host_tokens
        if self.host_rates is not None:
            out["host_rates"] = self.host_rates
        out["host_threads"] = self.host_threads
        return out


def experts_section(doc: Any, source: str | None) -> ExpertsSpec:
    doc = section("experts", doc, source)
    values = {key: field_value(doc, f"experts.{key}", source) for key in section_keys("experts")}
    if isinstance(values["slots"], dict):  # per layer: YAML gives int keys, JSON strings
        values["slots"] = _slots_per_layer(values, source)
    elif values["slots"] not in (None, "auto"):
        int_in("experts.slots", values["slots"], source, 1, 1 << 16)
    if values["layer_buffers"] != "slots":
        int_in("experts.layer_buffers", values["layer_buffers"], source, 0, 1 << 10)
    return ExpertsSpec(layers=layer_pattern("experts.layers", values["layers"], source),
                       slots=values["slots"], in_place_tokens=values["in_place_tokens"],
                       lookahead=values["lookahead"], layer_tokens=values["layer_tokens"],
                       layer_buffers=values["layer_buffers"],
                       ring_from_slots=values["ring_from_slots"],
                       lend_slots=values["lend_slots"],
                       decode_from_ring=values["decode_from_ring"],
                       early_start=values["early_start"],
                       auto_percent=values["auto_percent"],
                       host_share=_host_share(values["host_share"], source),
                       host_tokens=values["host_tokens"], host_rates=values["host_rates"],
                       host_threads=values["host_threads"])


def _slots_per_layer(values: dict, source: str | None) -> dict[int, int]:
    """``experts.slots`` as a mapping {layer: count} (keys: ints, or their decimal strings as
    JSON writes them), checked against what the section says without the model: each layer
    once, among a list of ``layers``, and not beside a knob that sizes every layer alike."""
    out: dict[int, int] = {}
    for key, count in values["slots"].items():
        if isinstance(key, str) and re.fullmatch(r"[0-9]+", key):
            key = int(key)
        layer = int_in("experts.slots", key, source, 0, MAX_LAYERS)
        if layer in out:
            raise ProfileError("experts.slots", f"names layer {layer} twice", source)
        out[layer] = int_in("experts.slots", count, source, 1, 1 << 16)
    if not out:
        raise rejected("experts.slots", {}, source, "names no layer")
    if values["decode_from_ring"]:
        raise ProfileError("experts.slots", "is a mapping per layer; decode_from_ring sizes "
                           "every layer from one count (the held layers have no slots): give "
                           "one count, or leave decode_from_ring off", source)
    layers = values["layers"]
    if isinstance(layers, list) and all(type(i) is int for i in layers):  # (other lists:
        _check_slot_layers(out, layers, source)                           # layer_pattern's)
    return out


def _check_slot_layers(slots: dict[int, int], chosen: list[int], source: str | None,
                       among: bool = False) -> None:
    """``slots`` (per layer) names exactly the ``chosen`` layers, or with ``among`` only
    layers among them."""
    named = sorted(slots)
    want = sorted(i for i in set(chosen) if i in slots or not among)
    if named != want:
        extra, missing = sorted(set(named) - set(want)), sorted(set(want) - set(named))
        raise ProfileError("experts.slots", f"names layers {named}, the chosen layers "
                           f"{'among them ' if among else ''}are {want}"
                           + (f": {extra} not chosen" if extra else "")
                           + (f": {missing} without a count" if missing else "")
                           + "; give every chosen layer its count", source)


def _host_share(value: Any, source: str | None) -> str | float:
    """``experts.host_share``: 'off', 'auto' or a share in 0..1 (0 is 'off')."""
    if value in ("off", "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise rejected("experts.host_share", value, source)
    return float(value) if value else "off"


def auto_slots(left: int, percent: int, layers: int, slot_bytes: int, experts: int,
               top_k: int, source: str | None = None) -> int:
    """``slots: auto``: the slots per layer that ``percent`` of ``left`` bytes (what vLLM's
    memory budget leaves after the weights and the layer ring) holds over ``layers`` chosen
    layers, ``slot_bytes`` each; at most the layer's ``experts``.

    Raises:
        ProfileError: that share holds fewer than ``top_k`` per layer (a step could not fit
            one token's experts in one pass), naming what to change.
    """
    share = max(left, 0) * percent // 100
    slots = share // (layers * slot_bytes)
    if slots < top_k:
        raise ProfileError("experts.slots", f"is 'auto': {percent}% of the "
                           f"{max(left, 0) / 2**20:,.0f} MiB vLLM's memory budget leaves after "
                           f"the weights and the layer ring holds {slots} experts per layer for "
                           f"{layers} layers of {slot_bytes / 2**20:.1f} MiB each, fewer than "
                           f"top_k ({top_k}); raise experts.auto_percent or "
                           f"--gpu-memory-utilization, or set experts.slots", source)
    return min(slots, experts)


@dataclass(frozen=True)
class KVPrefetchSpec:
    """Full-KV prefetch for vLLM attention layers: lookahead, budget, slot size, verification."""

    consumer: str
    depth: int
    workspace_mib: float
    capacity_tokens: int | None
    dcp_transport: str
    min_context_tokens: int | None
    verify: bool

    def to_mapping(self) -> dict:
        out = {"consumer": self.consumer, "depth": self.depth,
               "workspace_mib": self.workspace_mib, "verify": self.verify,
               "dcp_transport": self.dcp_transport}
        if self.capacity_tokens is not None:
            out["capacity_tokens"] = self.capacity_tokens
        if self.min_context_tokens is not None:
            out["min_context_tokens"] = self.min_context_tokens
        return out


def kv_prefetch_section(doc: Any, source: str | None) -> KVPrefetchSpec:
    doc = section("kv_prefetch", doc, source)
    spec = KVPrefetchSpec(**{key: field_value(doc, f"kv_prefetch.{key}", source)
                             for key in section_keys("kv_prefetch")})
    if spec.consumer == "full_kv_check" and not spec.verify:
        raise ProfileError("kv_prefetch.consumer", "is full_kv_check, which gathers every "
                           "layer's full context KV each step for nothing but verify to read; "
                           "set verify: true with it, or use consumer: context", source)
    if spec.consumer == "context" and spec.capacity_tokens is not None:
        raise ProfileError("kv_prefetch.capacity_tokens", "applies to consumer: full_kv_check "
                           "only; a context slot is vLLM's context workspace, sized by vLLM "
                           "(drop capacity_tokens)", source)
    if spec.consumer == "full_kv_check" and spec.min_context_tokens is not None:
        raise ProfileError("kv_prefetch.min_context_tokens", "applies to consumer: context "
                           "only; full_kv_check gathers every step (drop min_context_tokens)",
                           source)
    return spec
