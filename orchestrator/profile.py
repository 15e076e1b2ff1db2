"""Profile: a validated run description loaded from YAML (``profiles/*.yaml``) or a mapping.

Every field is listed in :data:`FIELDS` with what it means and what it accepts; the same table
drives validation, error messages and ``profiles/README.md``. Any mistake raises
:class:`~ringflow.errors.ProfileError` naming the field and the accepted values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ringflow.errors import ProfileError
from ringflow.orchestrator.budget import MAX_LAYERS, MAX_SLOT_BYTES, MIB, PoolLayout

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}
CAPTURE_POLICIES = ("join", "sync", "error")
GATHER_PRIORITIES = ("normal", "high")
GATHER_KINDS = ("h2d", "index", "paged")
COMPUTE_KINDS = ("attention", "decoder")
_LANE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")

#: field -> (meaning, accepted values, default or None when required)
FIELDS: dict[str, tuple[str, str, Any]] = {
    "name": ("label carried into dumps and tables", "a non-empty string", "<file stem>"),
    "layers": ("layers in one forward pass", "an integer in 1..8192", None),
    "depth": ("prefetch lookahead in layers: the ring holds depth + 1 slots (memory); even one "
              "slot (depth 0) prefetches behind layers that gather nothing", "an integer >= 0",
              None),
    "synchronous": ("gather every layer on the compute stream, just before it computes (no "
                    "prefetch); before, depth 0 meant this", "true | false", False),
    "cross_forward": ("lanes whose sources never change between forwards (weights): the next "
                      "forward's first slots are filled in this forward's tail",
                      "true (every lane), false, or a list of lane names", False),
    "workspace_mib": ("device budget of each lane's slot ring, in MiB; depth is reduced to fit",
                      "a number > 0 that holds at least one slot", None),
    "slot": ("shape and dtype of one slot (one layer's gathered data)",
             "a mapping with 'shape' and 'dtype'", None),
    "slot.shape": ("dimensions of one slot", "a non-empty list of integers >= 1", None),
    "slot.dtype": ("element type of a slot", " | ".join(DTYPE_BYTES), None),
    "lanes": ("independent pipelines, each with its own pool and gather stream "
              "(micro-batches, target/draft)", "a non-empty list of unique names [A-Za-z][A-Za-z0-9_-]*",
              ["kv"]),
    "gathered_layers": ("layers that need a gather; the others compute from resident data",
                        "'all' or a list of layer indices", "all"),
    "ineligible": ("gathered layers that cannot be prefetched; they gather synchronously",
                   "a list of layer indices (subset of gathered_layers)", []),
    "capture": ("what to do when a forward runs inside a CUDA graph capture",
                " | ".join(CAPTURE_POLICIES), "join"),
    "gather_priority": ("CUDA stream priority of the gather lanes", " | ".join(GATHER_PRIORITIES),
                        "normal"),
    "kv_token_bytes": ("bytes one token takes in one layer's KV cache; when set, plans report "
                       "how many KV tokens the pools displace", "an integer >= 1 or null", None),
    "workload": ("the synthetic workload `ringflow run` drives", "a mapping", {}),
    "workload.gather": ("how the synthetic workload fills a slot", " | ".join(GATHER_KINDS), "h2d"),
    "workload.queries": ("query rows of the attention-like compute", "an integer >= 1", 8),
    "workload.store_layers": ("distinct source tensors the gathers cycle through",
                              "an integer >= 1", 4),
    "workload.block_size": ("rows per block of the paged gather", "an integer >= 1", 16),
    "workload.seed": ("seed of the synthetic data", "an integer", 0),
    "workload.compute": ("what a layer computes from its slot: attention-like over the slot's "
                         "rows, or a Llama decoder layer whose weights the slot holds",
                         "attention | decoder", "attention"),
    "workload.hidden": ("decoder compute: hidden size", "an integer >= 1", 4096),
    "workload.intermediate": ("decoder compute: MLP size", "an integer >= 1", 11008),
    "workload.heads": ("decoder compute: attention heads (must divide hidden)", "an integer >= 1",
                       32),
    "offload": ("vLLM weight streaming: decoder layers whose weights live in pinned host memory "
                "and stream through a device ring (the plugin plans it from the model); with it, "
                "layers/depth/workspace_mib/slot may be left out", "a mapping", None),
    "offload.layers": ("decoder layers to offload",
                       "'all', a list of layer indices, or {every: N, last: K} (the last K of every "
                       "N layers)", None),
    "offload.depth": ("layers of lookahead; the ring holds depth + 1 layer-slots (one slot "
                      "still prefetches behind resident layers)", "an integer >= 0", 1),
    "offload.synchronous": ("copy each offloaded layer's weights just before it runs, on the "
                            "compute stream (no prefetch)", "true | false", False),
    "offload.cross_forward": ("fill the next forward's first layer-slots during this forward's "
                              "last layers (weights do not change between forwards)",
                              "true | false", True),
    "offload.workspace_mib": ("device budget of the weight ring, in MiB; depth is reduced to fit",
                              "a number > 0 that holds one layer's weights", None),
    "kv_prefetch": ("vLLM attention: gather each attention layer's full context KV (paged "
                    "cache, or a DCP group's all-gather) into a ring slot layers ahead; the "
                    "plugin plans it from the model", "a mapping", None),
    "kv_prefetch.depth": ("layers of lookahead; the ring holds depth + 1 full-KV slots",
                          "an integer >= 0", 1),
    "kv_prefetch.workspace_mib": ("device budget of each full-KV ring (one per model and "
                                  "micro-batch), in MiB; depth is reduced to fit",
                                  "a number > 0 that holds one slot", None),
    "kv_prefetch.capacity_tokens": ("context tokens one slot holds (all requests of a step); a "
                                    "larger step runs without prefetch and logs it",
                                    "an integer >= 1, or omitted for max_num_seqs x "
                                    "max_model_len", None),
    "kv_prefetch.verify": ("compare every slot with its layer's cache before attention reads "
                           "it, and (MLA) the backend's output with a reference attention over "
                           "the slot; host-syncs: for tests and debugging", "true | false",
                           False),
}
_REQUIRED = ("layers", "depth", "workspace_mib", "slot")
_OFFLOAD_KEYS = ["layers", "depth", "workspace_mib", "synchronous", "cross_forward"]
_KV_KEYS = ["depth", "workspace_mib", "capacity_tokens", "verify"]
_TOP = [k for k in FIELDS if "." not in k]


def _accepted(name: str) -> str:
    return f"accepted: {FIELDS[name][1]}"


def _fail(name: str, got: Any, source: str | None, why: str = "") -> ProfileError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    why = f"{why}; " if why else ""
    return ProfileError(name, f"{why}got {shown} ({type(got).__name__}); {_accepted(name)}", source)


def _int(name: str, value: Any, source: str | None, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, source)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(name, value, source, "out of range")
    return value


def _choice(name: str, value: Any, options: tuple[str, ...], source: str | None) -> str:
    if not isinstance(value, str) or value not in options:
        raise _fail(name, value, source)
    return value


def _layers_list(name: str, value: Any, layers: int, source: str | None) -> frozenset[int]:
    if not isinstance(value, list):
        raise _fail(name, value, source)
    seen: set[int] = set()
    for item in value:
        _int(name, item, source)
        if not 0 <= item < layers:
            raise ProfileError(name, f"layer {item} does not exist; accepted: indices in "
                               f"0..{layers - 1}", source)
        if item in seen:
            raise ProfileError(name, f"layer {item} is listed twice; accepted: unique indices", source)
        seen.add(item)
    return frozenset(seen)


def _mapping(name: str | None, value: Any, allowed: list[str], source: str | None) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(name, f"expected a mapping, got {type(value).__name__}", source)
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
    """Parameters of the synthetic workload ``ringflow run`` drives (see FIELDS)."""

    gather: str = "h2d"
    queries: int = 8
    store_layers: int = 4
    block_size: int = 16
    seed: int = 0
    compute: str = "attention"
    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32

    def decoder_elements(self) -> int:
        """Elements of one decoder layer's weights: QKV, O, gate/up, down, two norms."""
        h, i = self.hidden, self.intermediate
        return 3 * h * h + h * h + 2 * i * h + h * i + 2 * h


@dataclass(frozen=True)
class OffloadSpec:
    """Which decoder layers stream their weights, how far ahead, within what budget."""

    layers: str | frozenset[int] | tuple[int, int]  # "all", explicit indices, or (every, last)
    depth: int
    workspace_mib: float
    synchronous: bool = False
    cross_forward: bool = True

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
    doc = _mapping("offload", doc, _OFFLOAD_KEYS, source)
    for key in ("layers", "workspace_mib"):
        if key not in doc:
            raise ProfileError(f"offload.{key}", f"is missing; {_accepted('offload.' + key)}",
                               source)
    spec = doc["layers"]
    if spec == "all":
        layers: Any = "all"
    elif isinstance(spec, dict):
        group = _mapping("offload.layers", spec, ["every", "last"], source)
        if set(group) != {"every", "last"}:
            raise _fail("offload.layers", spec, source, "needs both 'every' and 'last'")
        every = _int("offload.layers", group["every"], source, 1, MAX_LAYERS)
        last = _int("offload.layers", group["last"], source, 1, every)
        layers = (every, last)
    else:
        layers = _layers_list("offload.layers", spec, MAX_LAYERS, source)
        if not layers:
            raise ProfileError("offload.layers", "is empty: nothing would be offloaded; accepted: "
                               "'all', a non-empty list, or {every: N, last: K}", source)
    depth = _int("offload.depth", doc.get("depth", 1), source, 0)
    mib = _budget("offload.workspace_mib", doc["workspace_mib"], source)
    return OffloadSpec(layers, depth, mib, _bool("offload.synchronous", doc, False, source),
                       _bool("offload.cross_forward", doc, True, source))


def _bool(name: str, doc: dict, default: bool, source: str | None) -> bool:
    value = doc.get(name.rsplit(".", 1)[-1], default)
    if not isinstance(value, bool):
        raise _fail(name, value, source)
    return value


@dataclass(frozen=True)
class KVPrefetchSpec:
    """Full-KV prefetch for vLLM attention layers: lookahead, budget, slot size, verification."""

    depth: int
    workspace_mib: float
    capacity_tokens: int | None
    verify: bool

    def to_mapping(self) -> dict:
        out = {"depth": self.depth, "workspace_mib": self.workspace_mib, "verify": self.verify}
        if self.capacity_tokens is not None:
            out["capacity_tokens"] = self.capacity_tokens
        return out


def _kv_prefetch(doc: Any, source: str | None) -> KVPrefetchSpec:
    doc = _mapping("kv_prefetch", doc, _KV_KEYS, source)
    if "workspace_mib" not in doc:
        raise ProfileError("kv_prefetch.workspace_mib",
                           f"is missing; {_accepted('kv_prefetch.workspace_mib')}", source)
    capacity = doc.get("capacity_tokens")
    if capacity is not None:
        capacity = _int("kv_prefetch.capacity_tokens", capacity, source, 1, 1 << 40)
    verify = doc.get("verify", False)
    if not isinstance(verify, bool):
        raise _fail("kv_prefetch.verify", verify, source)
    return KVPrefetchSpec(_int("kv_prefetch.depth", doc.get("depth", 1), source, 0),
                          _budget("kv_prefetch.workspace_mib", doc["workspace_mib"], source),
                          capacity, verify)


def _budget(name: str, value: Any, source: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0 or value > 1 << 24:
        raise _fail(name, value, source)
    return value


@dataclass(frozen=True)
class Profile:
    """A validated run description. Build with :meth:`load` or :meth:`from_mapping`.

    ``layers``, ``depth``, ``workspace_mib`` and ``slot`` are None only in an offload-only
    profile (vLLM weight streaming), which the plugin plans from the model it finds.
    """

    name: str
    layers: int | None
    depth: int | None
    workspace_mib: float | None
    slot: SlotShape | None
    lanes: tuple[str, ...] = ("kv",)
    gathered_layers: frozenset[int] | None = None  # None: every layer
    ineligible: frozenset[int] = frozenset()
    synchronous: bool = False
    cross_forward: tuple[str, ...] = ()
    capture: str = "join"
    gather_priority: str = "normal"
    kv_token_bytes: int | None = None
    workload: Workload = field(default_factory=Workload)
    offload: OffloadSpec | None = None
    kv_prefetch: KVPrefetchSpec | None = None
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
        doc = _mapping(None, doc, _TOP, source)
        offload = _offload(doc["offload"], source) if "offload" in doc else None
        kv_prefetch = _kv_prefetch(doc["kv_prefetch"], source) if "kv_prefetch" in doc else None
        run_keys = [k for k in _REQUIRED if k in doc]
        vllm_only = offload is not None or kv_prefetch is not None
        if not vllm_only or run_keys:  # a run profile: all four or a missing-field error
            for key in _REQUIRED:
                if key not in doc:
                    raise ProfileError(key, f"is missing; {_accepted(key)}", source)
        name = doc.get("name", default_name)
        if not isinstance(name, str) or not name:
            raise _fail("name", name, source)

        lanes = doc.get("lanes", ["kv"])
        if not isinstance(lanes, list) or not lanes:
            raise _fail("lanes", lanes, source)
        for lane in lanes:
            if not isinstance(lane, str) or not _LANE_NAME.match(lane):
                raise _fail("lanes", lane, source)
        if len(set(lanes)) != len(lanes):
            raise ProfileError("lanes", f"names repeat in {lanes}; accepted: unique names", source)
        common = dict(
            name=name, lanes=tuple(lanes), offload=offload, kv_prefetch=kv_prefetch,
            source=source,
            capture=_choice("capture", doc.get("capture", "join"), CAPTURE_POLICIES, source),
            gather_priority=_choice("gather_priority", doc.get("gather_priority", "normal"),
                                    GATHER_PRIORITIES, source),
        )
        if not run_keys:
            for key in ("gathered_layers", "ineligible", "kv_token_bytes", "workload",
                        "synchronous", "cross_forward"):
                if key in doc:
                    raise ProfileError(key, "needs the run fields layers, depth, workspace_mib "
                                       "and slot; a vLLM-only profile takes its layers from "
                                       "the model", source)
            return cls(layers=None, depth=None, workspace_mib=None, slot=None, **common)

        layers = _int("layers", doc["layers"], source, 1, MAX_LAYERS)
        depth = _int("depth", doc["depth"], source, 0)

        slot_doc = _mapping("slot", doc["slot"], ["shape", "dtype"], source)
        for key in ("shape", "dtype"):
            if key not in slot_doc:
                raise ProfileError(f"slot.{key}", f"is missing; {_accepted('slot.' + key)}", source)
        shape = slot_doc["shape"]
        if not isinstance(shape, list) or not shape:
            raise _fail("slot.shape", shape, source)
        dims = tuple(_int("slot.shape", d, source, 1) for d in shape)
        slot = SlotShape(dims, _choice("slot.dtype", slot_doc["dtype"], tuple(DTYPE_BYTES), source))
        if slot.nbytes > MAX_SLOT_BYTES:
            raise ProfileError("slot.shape", f"one slot of {slot.nbytes:,} bytes exceeds the "
                               f"{MAX_SLOT_BYTES:,}-byte limit; accepted: a smaller shape", source)

        mib = _budget("workspace_mib", doc["workspace_mib"], source)
        if mib * MIB < slot.nbytes:
            raise ProfileError(
                "workspace_mib",
                f"budget {mib} MiB is smaller than one slot ({slot.nbytes:,} bytes = "
                f"{slot.nbytes / MIB:.3f} MiB); accepted: at least {slot.nbytes / MIB:.3f}", source)

        gathered_doc = doc.get("gathered_layers", "all")
        gathered = None if gathered_doc == "all" else _layers_list(
            "gathered_layers", gathered_doc, layers, source)
        ineligible = _layers_list("ineligible", doc.get("ineligible", []), layers, source)
        if gathered is not None and not ineligible <= gathered:
            raise ProfileError("ineligible", f"layers {sorted(ineligible - gathered)} are not "
                               f"gathered; accepted: a subset of gathered_layers", source)

        cross = doc.get("cross_forward", False)
        if isinstance(cross, bool):
            cross = list(lanes) if cross else []
        if not isinstance(cross, list) or any(c not in lanes for c in cross):
            raise _fail("cross_forward", cross, source, f"lanes are {list(lanes)}")

        token_bytes = doc.get("kv_token_bytes")
        if token_bytes is not None:
            _int("kv_token_bytes", token_bytes, source, 1)

        work_keys = [k.split(".", 1)[1] for k in FIELDS if k.startswith("workload.")]
        work_doc = _mapping("workload", {} if doc.get("workload") is None else doc["workload"],
                            work_keys, source)
        workload = Workload(
            gather=_choice("workload.gather", work_doc.get("gather", "h2d"), GATHER_KINDS, source),
            queries=_int("workload.queries", work_doc.get("queries", 8), source, 1, 1 << 20),
            store_layers=_int("workload.store_layers", work_doc.get("store_layers", 4), source, 1,
                              1024),
            block_size=_int("workload.block_size", work_doc.get("block_size", 16), source, 1,
                            1 << 20),
            seed=_int("workload.seed", work_doc.get("seed", 0), source, 0, 2**63 - 1),
            compute=_choice("workload.compute", work_doc.get("compute", "attention"),
                            COMPUTE_KINDS, source),
            hidden=_int("workload.hidden", work_doc.get("hidden", 4096), source, 1, 1 << 20),
            intermediate=_int("workload.intermediate", work_doc.get("intermediate", 11008),
                              source, 1, 1 << 22),
            heads=_int("workload.heads", work_doc.get("heads", 32), source, 1, 1 << 12),
        )
        if workload.compute == "decoder":
            if workload.hidden % workload.heads:
                raise ProfileError("workload.heads", f"{workload.heads} heads do not divide hidden "
                                   f"size {workload.hidden}", source)
            if math.prod(dims) < workload.decoder_elements():
                raise ProfileError("slot.shape", f"a decoder layer of hidden {workload.hidden} and "
                                   f"intermediate {workload.intermediate} has "
                                   f"{workload.decoder_elements():,} weights; the slot holds "
                                   f"{math.prod(dims):,}; accepted: a shape of at least that many "
                                   f"elements", source)
        return cls(layers=layers, depth=depth, workspace_mib=mib, slot=slot,
                   gathered_layers=gathered, ineligible=ineligible, kv_token_bytes=token_bytes,
                   synchronous=_bool("synchronous", doc, False, source),
                   cross_forward=tuple(dict.fromkeys(cross)), workload=workload, **common)

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
                               "RINGFLOW_DUMP=path to see that plan); add layers, depth, "
                               "workspace_mib and slot to plan it here", self.source)
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
