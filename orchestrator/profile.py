"""Profile: a validated run description loaded from YAML (``profiles/*.yaml``) or a mapping.

Every field is one row of :data:`FIELDS`: what it means, what it accepts (type and range), its
default. That table is the only place these are stated: validation reads it, error messages
quote it, and ``tests/test_profile.py`` holds ``profiles/README.md`` to it. Any mistake raises
:class:`~ringflow.errors.ProfileError` naming the field and the accepted values.

The vocabularies other layers share are defined here, the lowest layer that needs them:
:data:`DTYPE_BYTES` (slot element types), :data:`CAPTURE_POLICIES` and
:data:`GATHER_PRIORITIES` (executors in ``ringflow.graphs`` import them).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ringflow.errors import ProfileError, RingflowError
from ringflow.orchestrator.budget import MAX_LAYERS, MAX_SLOT_BYTES, MIB, PoolLayout

#: slot element type -> bytes per element (``orchestrator/slots.py`` maps the names to torch)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}
#: what a forward does inside a CUDA graph capture ringflow did not open (graphs/eager.py)
CAPTURE_POLICIES = ("join", "sync", "error")
#: gather_priority -> CUDA stream priority of the gather streams (lower runs first)
GATHER_PRIORITIES = {"normal": 0, "high": -1}
GATHER_KINDS = ("h2d", "index", "paged")
DCP_TRANSPORTS = ("nccl", "peer", "auto")
COMPUTE_KINDS = ("attention", "decoder")
_LANE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
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
    the model). ``words`` states the accepted values where the kind cannot.
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
        raise RingflowError(f"a {self.kind} field states its accepted values in words: give "
                            f"it words= in FIELDS")

    def check(self, name: str, value: Any, source: str | None) -> Any:
        """``value`` if this field accepts it (a null: the default, where nullable).

        Raises:
            ProfileError: naming ``name`` and :attr:`accepted`.
        """
        if value is None and self.nullable:
            return copy.deepcopy(self.default)
        if self.kind == "int":
            _int_in(name, value, source, self.lo, self.hi)
        elif self.kind == "mib":
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0 < value <= self.hi:
                raise _fail(name, value, source)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise _fail(name, value, source)
        elif self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise _fail(name, value, source)
        elif self.kind == "str":
            if not isinstance(value, str) or not value:
                raise _fail(name, value, source)
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
                        words=f"a number > 0 that holds {holds}", **more)


#: dotted field name -> its :class:`ProfileField`, in the order profiles/README.md lists them
FIELDS: dict[str, ProfileField] = {
    "name": ProfileField("label carried into dumps and tables", "str", None,  # None: file stem
                         words="a non-empty string"),
    "layers": _integer("layers in one forward pass", 1, MAX_LAYERS, run=True),
    "depth": _integer("prefetch lookahead in layers: the ring holds depth + 1 slots (memory); "
                      "even one slot (depth 0) prefetches behind layers that gather nothing", 0,
                      run=True),
    "synchronous": _flag("gather every layer on the compute stream, just before it computes (no "
                         "prefetch); before, depth 0 meant this", False, run=True),
    "cross_forward": ProfileField("lanes whose sources never change between forwards (weights): "
                                  "the next forward's first slots are filled in this forward's "
                                  "tail", "list", False, run=True,
                                  words="true (every lane), false, or a list of lane names"),
    "workspace_mib": _mib("device budget of each lane's slot ring, in MiB; depth is reduced to "
                          "fit", "at least one slot", run=True),
    "slot": ProfileField("shape and dtype of one slot (one layer's gathered data)", "mapping",
                         run=True, words="a mapping with 'shape' and 'dtype'"),
    "slot.shape": ProfileField("dimensions of one slot", "list", lo=1,
                               words="a non-empty list of integers >= 1"),
    "slot.dtype": _one_of("element type of a slot", DTYPE_BYTES),
    "lanes": ProfileField("independent pipelines, each with its own pool and gather stream "
                          "(micro-batches, target/draft)", "list", ["kv"],
                          words="a non-empty list of unique names [A-Za-z][A-Za-z0-9_-]*"),
    "gathered_layers": ProfileField("layers that need a gather; the others compute from "
                                    "resident data", "list", "all", run=True,
                                    words="'all' or a list of layer indices"),
    "ineligible": ProfileField("gathered layers that cannot be prefetched; they gather "
                               "synchronously", "list", [], run=True,
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
                                   words="'all', a list of layer indices, or {every: N, last: K} "
                                   "(the last K of every N layers)"),
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
    "kv_prefetch.depth": _integer("layers of lookahead; the ring holds depth + 1 full-KV slots",
                                  0, None, 1),
    "kv_prefetch.workspace_mib": _mib("device budget of each full-KV ring (one per model and "
                                      "micro-batch), in MiB; depth is reduced to fit",
                                      "one slot"),
    "kv_prefetch.capacity_tokens": _integer(  # None: the plugin derives it from vLLM's limits
        "context tokens one slot holds (all requests of a step); a larger step runs without "
        "prefetch and logs it", 1, 1 << 40, None, nullable=True,
        words="an integer >= 1, or omitted for max_num_seqs x max_model_len"),
    "kv_prefetch.dcp_transport": _one_of(
        "under decode context parallelism, how the ranks' KV parts are exchanged: nccl "
        "(all-gather on the SMs), peer (copy engines pulling from the peers' rings in symmetric "
        "memory; NCCL if unavailable, logged) or auto (both timed when the ring is built; peer "
        "kept unless NCCL is more than 10% faster; recorded in the plan's meta)", DCP_TRANSPORTS, "auto"),
    "kv_prefetch.verify": _flag("compare every slot with its layer's cache before attention "
                                "reads it, and (MLA) the backend's output with a reference "
                                "attention over the slot; host-syncs: for tests and debugging",
                                False),
}


def _keys(section: str | None) -> list[str]:
    """The field names a section (None: the top level) accepts, as its mapping spells them."""
    if section is None:
        return [k for k in FIELDS if "." not in k]
    return [k.split(".", 1)[1] for k in FIELDS if k.startswith(section + ".")]


_REQUIRED = [k for k in _keys(None) if FIELDS[k].default is REQUIRED]  # of a run profile
_RUN_OPTIONAL = [k for k in _keys(None) if FIELDS[k].run and FIELDS[k].default is not REQUIRED]
_RUN_FIELDS = f"{', '.join(_REQUIRED[:-1])} and {_REQUIRED[-1]}"


def _accepted(name: str) -> str:
    return f"accepted: {FIELDS[name].accepted}"


def _fail(name: str, got: Any, source: str | None, why: str = "") -> ProfileError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    why = f"{why}; " if why else ""
    return ProfileError(name, f"{why}got {shown} ({type(got).__name__}); {_accepted(name)}", source)


def _int_in(name: str, value: Any, source: str | None, lo: int | None = None,
            hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, source)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(name, value, source, "out of range")
    return value


def _get(doc: dict, name: str, source: str | None) -> Any:
    """Field ``name`` of its section ``doc``: checked (:meth:`ProfileField.check`), or its
    default when absent.

    Raises:
        ProfileError: a required field is absent, or the value is not accepted.
    """
    spec, key = FIELDS[name], name.rsplit(".", 1)[-1]
    if key not in doc:
        if spec.default is REQUIRED:
            raise ProfileError(name, f"is missing; {_accepted(name)}", source)
        return copy.deepcopy(spec.default)  # ["kv"], [], {}: the table's own stay untouched
    return spec.check(name, doc[key], source)


def _layers_list(name: str, value: Any, layers: int, source: str | None) -> frozenset[int]:
    if not isinstance(value, list):
        raise _fail(name, value, source)
    seen: set[int] = set()
    for item in value:
        _int_in(name, item, source)
        if not 0 <= item < layers:
            raise ProfileError(name, f"layer {item} does not exist; accepted: indices in "
                               f"0..{layers - 1}", source)
        if item in seen:
            raise ProfileError(name, f"layer {item} is listed twice; accepted: unique indices", source)
        seen.add(item)
    return frozenset(seen)


def _mapping(name: str | None, value: Any, source: str | None,
             allowed: list[str] | None = None) -> dict:
    """``value`` as the mapping of section ``name``; only its fields (or ``allowed``) as keys."""
    if not isinstance(value, dict):
        raise ProfileError(name, f"expected a mapping, got {type(value).__name__}", source)
    allowed = _keys(name) if allowed is None else allowed
    prefix = f"{name}." if name else ""
    for key in value:
        if not isinstance(key, str) or key not in allowed:
            where = f"'{key}'" if isinstance(key, str) else repr(key)
            raise ProfileError(
                f"{prefix}{key}" if isinstance(key, str) else name,
                f"unknown field {where}; accepted fields: {', '.join(allowed)}", source)
    return value


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


def _workload(doc: Any, source: str | None) -> Workload:
    doc = _mapping("workload", doc, source)
    return Workload(**{key: _get(doc, f"workload.{key}", source) for key in _keys("workload")})


def _slot(doc: Any, source: str | None) -> SlotShape:
    doc = _mapping("slot", doc, source)
    shape, dtype = _get(doc, "slot.shape", source), _get(doc, "slot.dtype", source)
    if not isinstance(shape, list) or not shape:
        raise _fail("slot.shape", shape, source)
    slot = SlotShape(tuple(_int_in("slot.shape", d, source, FIELDS["slot.shape"].lo)
                           for d in shape), dtype)
    if slot.nbytes > MAX_SLOT_BYTES:
        raise ProfileError("slot.shape", f"one slot of {slot.nbytes:,} bytes exceeds the "
                           f"{MAX_SLOT_BYTES:,}-byte limit; accepted: a smaller shape", source)
    return slot


def _lanes(value: Any, source: str | None) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _fail("lanes", value, source)
    for lane in value:
        if not isinstance(lane, str) or not _LANE_NAME.match(lane):
            raise _fail("lanes", lane, source)
    if len(set(value)) != len(value):
        raise ProfileError("lanes", f"names repeat in {value}; accepted: unique names", source)
    return tuple(value)


@dataclass(frozen=True)
class OffloadSpec:
    """Which decoder layers stream their weights, how far ahead, within what budget."""

    layers: str | frozenset[int] | tuple[int, int]  # "all", explicit indices, or (every, last)
    depth: int
    workspace_mib: float
    synchronous: bool
    cross_forward: bool

    def resolve(self, count: int, source: str | None = None) -> list[int]:
        """The offloaded layer indices of a model with ``count`` decoder layers.

        Raises:
            ProfileError: a listed layer does not exist in the model.
        """
        if self.layers == "all":
            return list(range(count))
        if isinstance(self.layers, tuple):
            every, last = self.layers
            return [i for i in range(count) if i % every >= every - last]
        missing = sorted(i for i in self.layers if i >= count)
        if missing:
            raise ProfileError("offload.layers", f"layers {missing} do not exist: the model has "
                               f"{count} decoder layers (0..{count - 1})", source)
        return sorted(self.layers)

    def to_mapping(self) -> dict:
        layers: Any = self.layers
        if isinstance(layers, tuple):
            layers = {"every": layers[0], "last": layers[1]}
        elif isinstance(layers, frozenset):
            layers = sorted(layers)
        return {"layers": layers, "depth": self.depth, "workspace_mib": self.workspace_mib,
                "synchronous": self.synchronous, "cross_forward": self.cross_forward}


def _offload(doc: Any, source: str | None) -> OffloadSpec:
    doc = _mapping("offload", doc, source)
    values = {key: _get(doc, f"offload.{key}", source) for key in _keys("offload")}
    spec = values["layers"]
    if spec == "all":
        layers: Any = "all"
    elif isinstance(spec, dict):
        group = _mapping("offload.layers", spec, source, ["every", "last"])
        if set(group) != {"every", "last"}:
            raise _fail("offload.layers", spec, source, "needs both 'every' and 'last'")
        every = _int_in("offload.layers", group["every"], source, 1, MAX_LAYERS)
        last = _int_in("offload.layers", group["last"], source, 1, every)
        layers = (every, last)
    else:
        layers = _layers_list("offload.layers", spec, MAX_LAYERS, source)
        if not layers:
            raise ProfileError("offload.layers", "is empty: nothing would be offloaded; accepted: "
                               "'all', a non-empty list, or {every: N, last: K}", source)
    return OffloadSpec(**{**values, "layers": layers})


@dataclass(frozen=True)
class KVPrefetchSpec:
    """Full-KV prefetch for vLLM attention layers: lookahead, budget, slot size, verification."""

    depth: int
    workspace_mib: float
    capacity_tokens: int | None
    dcp_transport: str
    verify: bool

    def to_mapping(self) -> dict:
        out = {"depth": self.depth, "workspace_mib": self.workspace_mib, "verify": self.verify,
               "dcp_transport": self.dcp_transport}
        if self.capacity_tokens is not None:
            out["capacity_tokens"] = self.capacity_tokens
        return out


def _kv_prefetch(doc: Any, source: str | None) -> KVPrefetchSpec:
    doc = _mapping("kv_prefetch", doc, source)
    return KVPrefetchSpec(**{key: _get(doc, f"kv_prefetch.{key}", source)
                             for key in _keys("kv_prefetch")})


@dataclass(frozen=True)
class Profile:
    """A validated run description. Build with :meth:`load` or :meth:`from_mapping`.

    ``layers``, ``depth``, ``workspace_mib`` and ``slot`` are None only in an offload-only
    profile (vLLM weight streaming), which the plugin plans from the model it finds. Every
    field's default is in :data:`FIELDS`.
    """

    name: str
    layers: int | None
    depth: int | None
    workspace_mib: float | None
    slot: SlotShape | None
    lanes: tuple[str, ...]
    gathered_layers: frozenset[int] | None  # None: every layer
    ineligible: frozenset[int]
    synchronous: bool
    cross_forward: tuple[str, ...]
    capture: str
    gather_priority: str
    kv_token_bytes: int | None
    workload: Workload
    offload: OffloadSpec | None
    kv_prefetch: KVPrefetchSpec | None
    source: str | None = field(default=None, compare=False)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, ref: str | Path) -> Profile:
        """Load a profile from a YAML path, or a built-in profile by name (``"demo"``)."""
        path = Path(ref)
        if not path.exists():
            builtin = resources.files("ringflow.profiles").joinpath(f"{ref}.yaml")
            if not str(ref).endswith((".yaml", ".yml")) and builtin.is_file():
                return cls.from_yaml_text(builtin.read_bytes(), source=f"<builtin {ref}>",
                                          default_name=str(ref))
            names = ", ".join(sorted(builtin_profiles()))
            raise ProfileError(None, f"no such file, and no built-in profile of that name; "
                               f"built-in profiles: {names}", str(ref))
        if path.is_dir():
            raise ProfileError(None, "is a directory; give a profile YAML file", str(ref))
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(None, f"cannot be read ({exc.strerror})", str(ref)) from None
        return cls.from_yaml_text(data, source=str(ref), default_name=path.stem)

    @classmethod
    def from_yaml_text(cls, data: bytes | str, *, source: str = "<yaml>",
                       default_name: str = "profile") -> Profile:
        if isinstance(data, bytes):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProfileError(None, f"is not UTF-8 text (byte {exc.start}); save it as "
                                   f"UTF-8", source) from None
        try:
            doc = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ProfileError(None, f"is not valid YAML: {problem}{where}", source) from None
        if doc is None:
            raise ProfileError(None, f"is empty; required fields: {', '.join(_REQUIRED)}", source)
        return cls.from_mapping(doc, source=source, default_name=default_name)

    @classmethod
    def from_mapping(cls, doc: Any, *, source: str = "<mapping>",
                     default_name: str = "profile") -> Profile:
        """Validate a plain mapping (parsed YAML, vLLM ``additional_config``) into a Profile."""
        doc = _mapping(None, doc, source)
        offload = _offload(doc["offload"], source) if "offload" in doc else None
        kv_prefetch = _kv_prefetch(doc["kv_prefetch"], source) if "kv_prefetch" in doc else None
        # a run profile: all of _REQUIRED or a missing-field error; else vLLM sections only
        run = (offload is None and kv_prefetch is None) or any(k in doc for k in _REQUIRED)
        if not run:
            for key in _RUN_OPTIONAL:
                if key in doc:
                    raise ProfileError(key, f"needs the run fields {_RUN_FIELDS}; a vLLM-only "
                                       f"profile takes its layers from the model", source)
        name = _get(doc, "name", source)
        lanes = _lanes(_get(doc, "lanes", source), source)
        layers = depth = mib = slot = None
        if run:
            layers, depth = _get(doc, "layers", source), _get(doc, "depth", source)
            slot = _slot(_get(doc, "slot", source), source)
            mib = _get(doc, "workspace_mib", source)
            if mib * MIB < slot.nbytes:
                raise ProfileError(
                    "workspace_mib",
                    f"budget {mib} MiB is smaller than one slot ({slot.nbytes:,} bytes = "
                    f"{slot.nbytes / MIB:.3f} MiB); accepted: at least {slot.nbytes / MIB:.3f}",
                    source)

        # absent from a vLLM-only profile (refused above): the defaults need no layer count
        gathered_doc = _get(doc, "gathered_layers", source)
        gathered = None if gathered_doc == "all" else _layers_list(
            "gathered_layers", gathered_doc, layers, source)
        ineligible = _layers_list("ineligible", _get(doc, "ineligible", source), layers, source)
        if gathered is not None and not ineligible <= gathered:
            raise ProfileError("ineligible", f"layers {sorted(ineligible - gathered)} are not "
                               f"gathered; accepted: a subset of gathered_layers", source)

        cross = _get(doc, "cross_forward", source)
        if isinstance(cross, bool):
            cross = list(lanes) if cross else []
        if not isinstance(cross, list) or any(c not in lanes for c in cross):
            raise _fail("cross_forward", cross, source, f"lanes are {list(lanes)}")

        workload = _workload(_get(doc, "workload", source), source)
        if workload.compute == "decoder":  # only in a run profile: it has a workload section
            if workload.hidden % workload.heads:
                raise ProfileError("workload.heads", f"{workload.heads} heads do not divide hidden "
                                   f"size {workload.hidden}", source)
            if math.prod(slot.shape) < workload.decoder_elements():
                raise ProfileError("slot.shape", f"a decoder layer of hidden {workload.hidden} and "
                                   f"intermediate {workload.intermediate} has "
                                   f"{workload.decoder_elements():,} weights; the slot holds "
                                   f"{math.prod(slot.shape):,}; accepted: a shape of at least "
                                   f"that many elements", source)
        return cls(name=default_name if name is None else name, layers=layers, depth=depth,
                   workspace_mib=mib, slot=slot, lanes=lanes, gathered_layers=gathered,
                   ineligible=ineligible, synchronous=_get(doc, "synchronous", source),
                   cross_forward=tuple(dict.fromkeys(cross)),
                   capture=_get(doc, "capture", source),
                   gather_priority=_get(doc, "gather_priority", source),
                   kv_token_bytes=_get(doc, "kv_token_bytes", source), workload=workload,
                   offload=offload, kv_prefetch=kv_prefetch, source=source)

    def to_mapping(self) -> dict:
        """The YAML-shaped mapping that :meth:`from_mapping` turns back into this profile."""
        head: dict[str, Any] = {"name": self.name, "lanes": list(self.lanes),
                                "capture": self.capture, "gather_priority": self.gather_priority}
        if self.offload is not None:
            head["offload"] = self.offload.to_mapping()
        if self.kv_prefetch is not None:
            head["kv_prefetch"] = self.kv_prefetch.to_mapping()
        if self.layers is None:
            return head
        out: dict[str, Any] = {
            "name": self.name, "layers": self.layers, "depth": self.depth,
            "workspace_mib": self.workspace_mib,
            "slot": {"shape": list(self.slot.shape), "dtype": self.slot.dtype},
            "lanes": list(self.lanes),
            "gathered_layers": "all" if self.gathered_layers is None else sorted(self.gathered_layers),
            "ineligible": sorted(self.ineligible), "capture": self.capture,
            "synchronous": self.synchronous, "cross_forward": list(self.cross_forward),
            "gather_priority": self.gather_priority,
            "workload": {f.name: getattr(self.workload, f.name) for f in fields(Workload)},
        }
        if self.kv_token_bytes is not None:
            out["kv_token_bytes"] = self.kv_token_bytes
        return {**head, **out}

    def replace(self, **changes: Any) -> Profile:
        """A copy with top-level fields changed, validated like a fresh profile."""
        doc = self.to_mapping()
        doc.update(changes)
        return Profile.from_mapping(doc, source=self.source or "<mapping>", default_name=self.name)

    # -- derived ------------------------------------------------------------------------------

    def require_run_fields(self) -> Profile:
        """Raise unless this profile can be planned on its own (it is not offload-only)."""
        if self.layers is None:
            raise ProfileError("layers", "is missing: this profile has only vLLM sections "
                               "('offload', 'kv_prefetch'), which the plugin plans from the "
                               "model it loads (set "
                               f"RINGFLOW_DUMP=path to see that plan); add {_RUN_FIELDS} to "
                               f"plan it here", self.source)
        return self

    @property
    def workspace_bytes(self) -> int:
        self.require_run_fields()
        return int(self.workspace_mib * MIB)

    def pool_layouts(self) -> tuple[PoolLayout, ...]:
        """Each lane's ring, fitted to the budget exactly as :class:`SlotPool` will allocate it."""
        self.require_run_fields()
        return tuple(PoolLayout.fit(lane, self.slot.nbytes, self.depth, self.workspace_bytes)
                     for lane in self.lanes)

    @property
    def reserved_bytes(self) -> int:
        return sum(p.reserved_bytes for p in self.pool_layouts())

    def kv_tokens_displaced(self) -> int | None:
        """KV-cache tokens the pools' bytes would otherwise hold (all layers), or None."""
        if self.kv_token_bytes is None:
            return None
        return self.reserved_bytes // (self.kv_token_bytes * self.layers)


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in ``ringflow.profiles``."""
    root = resources.files("ringflow.profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(ref: str | Path) -> Profile:
    """Load a profile from a path or a built-in name; see :meth:`Profile.load`."""
    return Profile.load(ref)
