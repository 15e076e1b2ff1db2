"""The profile schema: every field of a profile declared once, in :data:`FIELDS`.

Each field is one :class:`ProfileField` row: what it means, what it accepts (type and range),
its default. That table is the only place these are stated: validation reads it, error messages
quote it, ``profiles/README.md`` is held to it (``tests/unit/test_profile.py``) and
:func:`json_schema` derives the JSON Schema editors use from it. Any mistake raises
:class:`~ringflow.errors.ProfileError` naming the field and the accepted values.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from ringflow.errors import ProfileError
from ringflow.orchestrator.budget import MAX_LAYERS
from ringflow.orchestrator.vocab import (CAPTURE_POLICIES, COMPUTE_KINDS, DCP_TRANSPORTS,
                                         DTYPE_BYTES, GATHER_KINDS, GATHER_PRIORITIES,
                                         KV_CONSUMERS)

LANE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
MAX_WORKSPACE_MIB = 1 << 24  # 16 TiB: anything larger is a typo, not a budget


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: the default of a field that must be given (in a run profile, or in its section)
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class ProfileField:
    """One profile field: what it means, what it accepts, its default.

    ``kind`` says how a value is checked: ``int`` (``lo``..``hi``), ``mib`` (a budget: a number
    in (0, ``hi``]), ``bool``, ``choice`` (one of ``choices``), ``str`` (non-empty); any other
    kind (``mapping``, ``list``) is checked by the code that reads the field, which names it.
    ``default`` is :data:`REQUIRED`, or the value an absent field takes (None: unset, or
    derived when the profile is used). ``nullable``: an explicit null also means the default.
    ``run``: a top-level field of run profiles only (a vLLM-only profile takes its layers from
    the model). ``words`` states the accepted values where the kind cannot; ``shape`` states
    them for editors (the JSON Schema of a ``list`` field), where the kind cannot.
    """

    meaning: str
    kind: str
    default: Any = REQUIRED
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()
    nullable: bool = False
    run: bool = False
    words: str = ""
    shape: dict | None = None

    @property
    def accepted(self) -> str:
        """The accepted values, as error messages say them."""
        if self.words:
            return self.words
        if self.kind == "int":
            text = f"an integer >= {self.lo}" if self.hi is None else \
                f"an integer in {self.lo}..{self.hi}"
            return f"{text} or null" if self.nullable else text
        if self.kind == "bool":
            return "true | false"
        if self.kind == "choice":
            return " | ".join(self.choices)
        raise ProfileError(None, f"a {self.kind} field states its accepted values in words: give "
                            f"it words= in FIELDS")

    def check(self, name: str, value: Any, source: str | None) -> Any:
        """``value`` if this field accepts it (a null: the default, where nullable).

        Raises:
            ProfileError: naming ``name`` and :attr:`accepted`.
        """
        if value is None and self.nullable:
            return copy.deepcopy(self.default)
        if self.kind == "int":
            int_in(name, value, source, self.lo, self.hi)
        elif self.kind == "mib":
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0 < value <= self.hi:
                raise rejected(name, value, source)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise rejected(name, value, source)
        elif self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise rejected(name, value, source)
        elif self.kind == "str":
            if not isinstance(value, str) or not value:
                raise rejected(name, value, source)
        return value


def _integer(meaning: str, lo: int, hi: int | None = None, default: Any = REQUIRED,
             **more: Any) -> ProfileField:
    return ProfileField(meaning, "int", default, lo=lo, hi=hi, **more)


def _one_of(meaning: str, choices, default: Any = REQUIRED) -> ProfileField:
    return ProfileField(meaning, "choice", default, choices=tuple(choices))


def _flag(meaning: str, default: bool, **more: Any) -> ProfileField:
    return ProfileField(meaning, "bool", default, **more)


def _mib(meaning: str, holds: str, **more: Any) -> ProfileField:
    return ProfileField(meaning, "mib", REQUIRED, hi=MAX_WORKSPACE_MIB,
                        words=f"a number > 0 and at most {MAX_WORKSPACE_MIB:,} (16 TiB) that "
                              f"holds {holds}", **more)


#: dotted field name -> its :class:`ProfileField`, in the order profiles/README.md lists them
FIELDS: dict[str, ProfileField] = {
    "name": ProfileField("label carried into dumps and tables", "str", None,  # None: file stem
                         words="a non-empty string"),
    "layers": _integer("layers in one forward pass", 1, MAX_LAYERS, run=True),
    "depth": _integer("prefetch lookahead in layers: the ring holds depth + 1 slots (memory); "
                      "even one slot (depth 0) prefetches behind layers that gather nothing", 0,
                      MAX_LAYERS - 1,
                      run=True),
    "synchronous": _flag("gather every layer on the compute stream, just before it computes (no "
                         "prefetch)", False, run=True),
    "cross_forward": ProfileField("lanes whose sources never change between forwards (weights): "
                                  "the next forward's first slots are filled in this forward's "
                                  "tail", "list", False, run=True,
                                  shape={"oneOf": [{"type": "boolean"}, {"type": "array", "items": {
                                      "type": "string"}}]},
                                  words="true (every lane), false, or a list of lane names"),
    "workspace_mib": _mib("device budget of each lane's slot ring, in MiB; depth is reduced to "
                          "fit", "at least one slot", run=True),
    "slot": ProfileField("shape and dtype of one slot (one layer's gathered data)", "mapping",
                         run=True, words="a mapping with 'shape' and 'dtype'"),
    "slot.shape": ProfileField("dimensions of one slot", "list", lo=1,
                               shape={"type": "array", "minItems": 1,
                                      "items": {"type": "integer", "minimum": 1}},
                               words="a non-empty list of integers >= 1"),
    "slot.dtype": _one_of("element type of a slot", DTYPE_BYTES),
    "lanes": ProfileField("independent pipelines, each with its own pool and gather stream "
                          "(micro-batches, target/draft)", "list", ["kv"],
                          shape={"type": "array", "minItems": 1, "uniqueItems": True,
                                 "items": {"type": "string", "pattern": LANE_NAME.pattern}},
                          words="a non-empty list of unique names [A-Za-z][A-Za-z0-9_-]*"),
    "gathered_layers": ProfileField("layers that need a gather; the others compute from "
                                    "resident data", "list", "all", run=True,
                                    shape={"oneOf": [{"const": "all"}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True}]},
                                    words="'all' or a list of layer indices"),
    "ineligible": ProfileField("gathered layers that cannot be prefetched; they gather "
                               "synchronously", "list", [], run=True, shape={"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True},
                               words="a list of layer indices (subset of gathered_layers)"),
    "capture": _one_of("what to do when a forward runs inside a CUDA graph capture",
                       CAPTURE_POLICIES, "join"),
    "gather_priority": _one_of("CUDA stream priority of the gather lanes", GATHER_PRIORITIES,
                               "normal"),
    "kv_token_bytes": _integer("bytes one token takes in one layer's KV cache; when set, plans "
                               "report how many KV tokens the pools displace", 1, None, None,
                               nullable=True, run=True),
    "workload": ProfileField("the synthetic workload `ringflow run` drives", "mapping", {},
                             nullable=True, run=True, words="a mapping"),
    "workload.gather": _one_of("how the synthetic workload fills a slot", GATHER_KINDS, "h2d"),
    "workload.queries": _integer("query rows of the attention-like compute", 1, 1 << 20, 8),
    "workload.store_layers": _integer("distinct source tensors the gathers cycle through",
                                      1, 1024, 4),
    "workload.block_size": _integer("rows per block of the paged gather", 1, 1 << 20, 16),
    "workload.seed": _integer("seed of the synthetic data", 0, 2**63 - 1, 0,
                              words="an integer in 0..2**63-1"),
    "workload.compute": _one_of("what a layer computes from its slot: attention-like over the "
                                "slot's rows, or a Llama decoder layer whose weights the slot "
                                "holds", COMPUTE_KINDS, "attention"),
    "workload.hidden": _integer("decoder compute: hidden size", 1, 1 << 20, 4096),
    "workload.intermediate": _integer("decoder compute: MLP size", 1, 1 << 22, 11008),
    "workload.heads": _integer("decoder compute: attention heads (must divide hidden)",
                               1, 1 << 12, 32),
    "offload": ProfileField("vLLM weight streaming: decoder layers whose weights live in pinned "
                            "host memory and stream through a device ring (the plugin plans it "
                            "from the model); with it, layers/depth/workspace_mib/slot may be "
                            "left out", "mapping", None, words="a mapping"),
    "offload.layers": ProfileField("decoder layers to offload", "list",
                                   shape={"oneOf": [{"const": "all"}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True}, {
                                       "type": "object", "additionalProperties": False,
                                       "required": ["every", "last"], "properties": {
                                           "every": {"type": "integer", "minimum": 1},
                                           "last": {"type": "integer", "minimum": 1}}}, {
                                       "type": "object", "additionalProperties": False,
                                       "required": ["count"], "properties": {
                                           "count": {"type": "integer", "minimum": 1}}}]},
                                   words="'all', a list of layer indices, {every: N, last: K} "
                                   "(the last K of every N layers), or {count: N} (the planner "
                                   "places N layers where they hide best)"),
    "offload.depth": _integer("layers of lookahead; the ring holds depth + 1 layer-slots (one "
                              "slot still prefetches behind resident layers)", 0, None, 1),
    "offload.synchronous": _flag("copy each offloaded layer's weights just before it runs, on "
                                 "the compute stream (no prefetch)", False),
    "offload.cross_forward": _flag("fill the next forward's first layer-slots during this "
                                   "forward's last layers (weights do not change between "
                                   "forwards)", True),
    "offload.workspace_mib": _mib("device budget of the weight ring, in MiB; depth is reduced "
                                  "to fit", "one layer's weights"),
    "kv_prefetch": ProfileField("vLLM attention: gather each attention layer's full context KV "
                                "(paged cache, or a DCP group's all-gather) into a ring slot "
                                "layers ahead; the plugin plans it from the model", "mapping",
                                None, words="a mapping"),
    "kv_prefetch.consumer": _one_of(
        "who reads the prefetched KV: context (MLA's context-chunk gathers, read by vLLM's "
        "attention from a ring slot one chunk ahead; other layers have no consumer and gather "
        "nothing) or full_kv_check (every attention layer's full context KV gathered each step "
        "and read by nothing but verify: debugging only, needs verify: true)",
        KV_CONSUMERS, "context"),
    "kv_prefetch.depth": _integer("units of lookahead (context: (layer, chunk) gathers; "
                                  "full_kv_check: layers); the ring holds depth + 1 slots",
                                  0, None, 1),
    "kv_prefetch.workspace_mib": _mib("device budget of each full-KV ring (one per model and "
                                      "micro-batch), in MiB; depth is reduced to fit",
                                      "one slot"),
    "kv_prefetch.capacity_tokens": _integer(  # None: the plugin derives it from vLLM's limits
        "full_kv_check: context tokens one slot holds (all requests of a step); a larger step "
        "runs without prefetch and logs it. context: not used (a slot is vLLM's context "
        "workspace)", 1, 1 << 40, None, nullable=True,
        words="an integer >= 1, or omitted for max_num_seqs x max_model_len"),
    "kv_prefetch.dcp_transport": _one_of(
        "under decode context parallelism, how the ranks' KV parts are exchanged: nccl "
        "(all-gather on the SMs), peer (copy engines pulling from the peers' rings in symmetric "
        "memory; NCCL if unavailable, logged) or auto (both timed when the ring is built; peer "
        "kept unless NCCL is more than 10% faster; recorded in the plan's meta). consumer: "
        "context: nccl is an all-gather over ringflow's own communicator; peer and auto pull "
        "the peers' rows with copy engines from a context ring in symmetric memory (auto "
        "without timing; NCCL if unavailable, logged)", DCP_TRANSPORTS, "auto"),
    "kv_prefetch.min_context_tokens": _integer(  # None: off on one GPU, 0 under DCP (Note [Short context])
        "context: a step whose prefills have fewer context tokens than this (all chunks, all "
        "DCP ranks) runs vLLM's own gathers, logged once; 0: every step with context. "
        "Omitted: on one GPU every step is left to vLLM and no ring is reserved (there, on the "
        "H200, ringflow's host time per (layer, chunk) cost more than the local gather it "
        "hides), 0 under DCP (the exchange is on the critical path)", 0, 1 << 40, None,
        nullable=True, words="an integer >= 0, or omitted (one GPU: off; DCP: 0)"),
    "kv_prefetch.verify": _flag("compare every slot with its layer's cache before attention "
                                "reads it, and (MLA) the backend's output with a reference "
                                "attention over the slot; host-syncs: for tests and debugging",
                                False),
    "experts": ProfileField("vLLM MoE layers: the routed experts of the chosen layers live in "
                            "host memory and a cache of expert slots per layer holds the "
                            "ones steps use; each step brings in only the experts its router "
                            "chose that are not cached (Note [Expert cache])", "mapping", None,
                            words="a mapping"),
    "experts.layers": ProfileField("decoder layers whose routed experts live in host memory "
                                   "(each must be a MoE layer)", "list", "all",
                                   shape={"oneOf": [{"const": "all"}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True}, {
                                       "type": "object", "additionalProperties": False,
                                       "required": ["every", "last"], "properties": {
                                           "every": {"type": "integer", "minimum": 1},
                                           "last": {"type": "integer", "minimum": 1}}}]},
                                   words="'all' (every MoE layer), a list of layer indices, or "
                                   "{every: N, last: K}"),
    "experts.slots": ProfileField("experts each chosen layer keeps on the device; a step that "
                                  "needs more runs in several passes (slower, never wrong); "
                                  "'auto': experts.auto_percent of the device memory vLLM's "
                                  "budget (--gpu-memory-utilization) leaves after the weights "
                                  "and the layer ring, the KV cache getting the rest (on a "
                                  "GPU; the CPU build takes the default); a mapping of every "
                                  "chosen layer to its own count (with layer_buffers: slots, "
                                  "layers given every expert lend their rows to the large "
                                  "steps' other layers once they ran: one layout for decode, "
                                  "lone long prompts and chunks, Note [Large steps stream "
                                  "through the slots])", "slots", None,
                                  nullable=True, shape={"oneOf": [
                                      {"type": "integer", "minimum": 1, "maximum": 1 << 16},
                                      {"const": "auto"},
                                      {"type": "object", "minProperties": 1,
                                       "additionalProperties": False,
                                       "patternProperties": {"^[0-9]+$": {
                                           "type": "integer", "minimum": 1,
                                           "maximum": 1 << 16}}}]},
                                  words="an integer >= 1, 'auto', a mapping {layer: count} "
                                        "over the chosen layers, or omitted for a quarter of "
                                        "the layer's experts (at least its top_k; with "
                                        "decode_from_ring the held layers' quarters spread "
                                        "over the others)"),
    "experts.auto_percent": _integer("with slots: auto, the percent of what vLLM's memory "
                                     "budget leaves after the weights and the layer ring that "
                                     "the slots take (the KV cache gets the rest)", 1, 100, 25),
    "experts.in_place_tokens": _integer("a step of at most this many tokens that needs more "
                                        "experts than the slots hold computes the ones it could "
                                        "not install straight from host memory, in one pass, "
                                        "as vLLM's UVA offloader reads them (cheaper while each "
                                        "expert has few tokens); longer steps copy them into the "
                                        "slots in passes; 0: never", 0, 1 << 20, 1024),
    "experts.layer_tokens": _integer("a step of at least this many tokens needs nearly every "
                                     "expert: it takes each chosen layer's experts whole from "
                                     "the layer ring (copied ahead on a copy engine while the "
                                     "layers before compute, the next step's first layers in "
                                     "this step's tail) instead of the slot cache; never under "
                                     "a CUDA graph capture (Note [Expert layer ring])",
                                     1, 1 << 30, 1024),
    "experts.layer_buffers": ProfileField(
        "layers of experts the layer ring holds on the device (each the size of one chosen "
        "layer's routed experts; capped at the chosen layers); 0: no ring, every step through "
        "the slot cache; 'slots': no memory of its own, large steps stream each layer through "
        "windows of the slots' memory, as many as it holds whole layers (Note [Large steps "
        "stream through the slots]: the layout for long prompts with the first layers left "
        "resident)", "buffers", 2,
        shape={"oneOf": [{"type": "integer", "minimum": 0, "maximum": 1 << 10},
                         {"const": "slots"}]},
        words="an integer 0..1024, or 'slots'"),
    "experts.ring_from_slots": _flag("the layer ring's fills take the experts a layer's slot "
                                     "cache holds from device memory and copy only the others "
                                     "from host memory (false: every expert from host memory, "
                                     "the lane before this; Note [Ring fills from the slots])",
                                     True),
    "experts.lend_slots": _flag("with ring_from_slots, a large step's tail lends the slots of "
                                "the layers it carried into the ring to the next layer, whose "
                                "missing experts it copies there while the GPU is idle; the "
                                "next large step takes them from there (Note [Ring lends the "
                                "carried layers' slots]); off by default: the step after a "
                                "large one waits for that copy", False),
    "experts.decode_from_ring": _flag("the layer ring holds its first layer_buffers chosen "
                                      "layers whole between large steps and small steps "
                                      "(decode) compute them from there; those layers get no "
                                      "slots, the others the slots (by default their quarter "
                                      "and the held layers' spread over them; Note [Small "
                                      "steps read the held layers]); needs more chosen layers "
                                      "than layer_buffers; off by default (measured on an "
                                      "H100 only: profiles/results/README.md)",
                                      False),
    "experts.early_start": _flag("with layer_buffers: slots, a large step starts at vLLM's "
                                 "execute_model, before its forward: the top-up of the carried "
                                 "window copies while the host prepares the step and the "
                                 "layers before the first chosen one compute (Note [Large "
                                 "steps start early]); off by default (on an H100 a lone 8k "
                                 "prompt 1.04x the arena without it)", False),
    "experts.lookahead": _flag("each chosen layer guesses the next chosen layer's experts with "
                               "that layer's router and fetches them on a side stream, a layer "
                               "early (eager steps and FULL CUDA graphs; steps under piecewise "
                               "graphs and steps of several passes do not guess); the report "
                               "gives the guesses' hit rate (Note [Expert lookahead])", False),
    "experts.host_share": ProfileField("a decode step hands this share of each layer's missed "
                                       "experts to the host's CPU, which computes them from "
                                       "host memory while the GPU copies and computes the "
                                       "rest (Note [Host split]); 'auto': the share the host's "
                                       "measured rates predict (off where they predict no "
                                       "gain, said once); 'off': copy every miss; on a GPU "
                                       "only", "share", "off",
                                       shape={"oneOf": [{"enum": ["off", "auto"]},
                                                        {"type": "number", "minimum": 0,
                                                         "maximum": 1}]},
                                       words="'off', 'auto', or a number in 0..1"),
    "experts.host_tokens": _integer("the host share serves steps of at most this many tokens "
                                    "(and of one pass through the slots); larger steps copy "
                                    "every miss. 1: the share gained at batch 1 and never at "
                                    "batch 8 where measured", 1, 256, 1),
    "experts.host_rates": ProfileField("the host's rates as tools/host_rates.py wrote them, for "
                                       "host_share: auto; omitted: measured at start-up on the "
                                       "first chosen layer's experts, beside host-to-device "
                                       "copies", "str", None,
                                       nullable=True, words="a path to a JSON file"),
    "experts.host_threads": _integer("CPU threads the host share's worker computes with "
                                     "(its own; vLLM's threads are left as they are); 0: the "
                                     "fastest, measured at start-up, of the CPUs the process "
                                     "may run on divided among the host's GPU workers less "
                                     "one, half that and a quarter (with host_rates: the "
                                     "file's)", 0, 4096, 0),
}


def section_keys(section: str | None) -> list[str]:
    """The field names a section (None: the top level) accepts, as its mapping spells them."""
    if section is None:
        return [k for k in FIELDS if "." not in k]
    return [k.split(".", 1)[1] for k in FIELDS if k.startswith(section + ".")]


RUN_REQUIRED = [k for k in section_keys(None) if FIELDS[k].default is REQUIRED]  # of a run profile
RUN_OPTIONAL = [k for k in section_keys(None) if FIELDS[k].run and FIELDS[k].default is not REQUIRED]
RUN_FIELDS = f"{', '.join(RUN_REQUIRED[:-1])} and {RUN_REQUIRED[-1]}"


def accepted(name: str) -> str:
    return f"accepted: {FIELDS[name].accepted}"


def rejected(name: str, got: Any, source: str | None, why: str = "") -> ProfileError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    why = f"{why}; " if why else ""
    return ProfileError(name, f"{why}got {shown} ({type(got).__name__}); {accepted(name)}", source)


def int_in(name: str, value: Any, source: str | None, lo: int | None = None,
            hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise rejected(name, value, source)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise rejected(name, value, source, "out of range")
    return value


def field_value(doc: dict, name: str, source: str | None) -> Any:
    """Field ``name`` of its section ``doc``: checked (:meth:`ProfileField.check`), or its
    default when absent.

    Raises:
        ProfileError: a required field is absent, or the value is not accepted.
    """
    spec, key = FIELDS[name], name.rsplit(".", 1)[-1]
    if key not in doc:
        if spec.default is REQUIRED:
            raise ProfileError(name, f"is missing; {accepted(name)}", source)
        return copy.deepcopy(spec.default)  # ["kv"], [], {}: the table's own stay untouched
    return spec.check(name, doc[key], source)


def layer_set(name: str, value: Any, layers: int, source: str | None) -> frozenset[int]:
    if not isinstance(value, list):
        raise rejected(name, value, source)
    seen: set[int] = set()
    for item in value:
        int_in(name, item, source)
        if not 0 <= item < layers:
            raise ProfileError(name, f"layer {item} does not exist; accepted: indices in "
                               f"0..{layers - 1}", source)
        if item in seen:
            raise ProfileError(name, f"layer {item} is listed twice; accepted: unique indices", source)
        seen.add(item)
    return frozenset(seen)


def section(name: str | None, value: Any, source: str | None,
             allowed: list[str] | None = None) -> dict:
    """``value`` as the mapping of section ``name``; only its fields (or ``allowed``) as keys."""
    if not isinstance(value, dict):
        raise ProfileError(name, f"expected a mapping, got {type(value).__name__}", source)
    allowed = section_keys(name) if allowed is None else allowed
    prefix = f"{name}." if name else ""
    for key in value:
        if not isinstance(key, str) or key not in allowed:
            where = f"'{key}'" if isinstance(key, str) else repr(key)
            raise ProfileError(
                f"{prefix}{key}" if isinstance(key, str) else name,
                f"unknown field {where}; accepted fields: {', '.join(allowed)}", source)
    return value


def _json_field(name: str) -> dict:
    spec = FIELDS[name]
    out: dict[str, Any] = {"description": f"{spec.meaning}; accepted: {spec.accepted}"}
    if spec.kind == "int":
        out["type"] = "integer"
        out.update({k: v for k, v in (("minimum", spec.lo), ("maximum", spec.hi)) if v is not None})
    elif spec.kind == "mib":
        out.update(type="number", exclusiveMinimum=0, maximum=spec.hi)
    elif spec.kind == "bool":
        out["type"] = "boolean"
    elif spec.kind == "choice":
        out["enum"] = list(spec.choices)
    elif spec.kind == "str":
        out.update(type="string", minLength=1)
    elif spec.kind == "mapping":
        out.update(_json_section(name))
    elif spec.shape is not None:
        out.update(spec.shape)
    if spec.nullable:
        out = {"description": out.pop("description"), "oneOf": [out, {"type": "null"}]}
    if spec.default is not REQUIRED and spec.default is not None:
        out["default"] = spec.default
    return out


def _json_section(name: str | None) -> dict:
    prefix = f"{name}." if name else ""
    return {"type": "object", "additionalProperties": False,
            "properties": {key: _json_field(prefix + key) for key in section_keys(name)}}


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a profile, derived from :data:`FIELDS`: what an
    editor checks while a profile is written (``profiles/profile.schema.json`` is this,
    written out). Cross-field rules (a run profile's required fields, a budget of at least
    one slot) are ringflow's own checks, not the schema's."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://ringflow.invalid/profile.schema.json", "title": "ringflow profile",
            **_json_section(None)}
