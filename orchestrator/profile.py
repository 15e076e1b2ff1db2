"""Profile: a validated run description, loaded from YAML (``profiles/*.yaml``), a built-in
name or a mapping (vLLM's ``additional_config``).

What each field means and accepts is declared once, in the schema
(:mod:`ringflow.orchestrator.schema`); the sections' values and parsers are in
:mod:`ringflow.orchestrator.sections`. This module reads documents, applies the checks that
span fields (a run profile's required fields, a budget of at least one slot, ineligible layers
among the gathered ones) and answers what a profile plans: its rings and what they cost.
"""

from __future__ import annotations

import difflib

import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ringflow.errors import BudgetError, ConfigError, ProfileError
from ringflow.orchestrator import profile_yaml
from ringflow.orchestrator.budget import PoolLayout
from ringflow.orchestrator.schema import (RUN_FIELDS, RUN_OPTIONAL, RUN_REQUIRED, field_value,
                                          layer_set, rejected, section, section_keys)
from ringflow.orchestrator.sections import (ExpertsSpec, KVPrefetchSpec, OffloadSpec, SlotShape,
                                            Workload, experts_section, kv_prefetch_section,
                                            lane_names, offload_section, slot_section,
                                            workload_section)
from ringflow.units import MIB


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
    experts: ExpertsSpec | None = None
    source: str | None = field(default=None, compare=False)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, ref: str | Path | dict, *, vllm: bool = False) -> Profile:
        """Load a profile from a YAML path, a built-in profile by name (``"demo"``), or a
        mapping of its fields (as :meth:`from_mapping`; ``vllm``: as a vLLM profile).

        Raises:
            ProfileError: no such file or built-in, or the profile is malformed.
            ConfigError: ``ref`` is none of those.
        """
        if isinstance(ref, dict):
            return cls.from_mapping(ref, source="<dict>", vllm=vllm)
        if not isinstance(ref, (str, Path)):
            raise ConfigError(f"a profile is a YAML path, a built-in name or a mapping of its "
                              f"fields, not {type(ref).__name__} ({ref!r:.60})")
        if not str(ref).strip():
            raise ConfigError("a profile name or path is empty; give a YAML path or a built-in "
                              f"name ({', '.join(sorted(builtin_profiles()))})")
        path = Path(ref)
        if not path.exists():
            builtin = resources.files("ringflow.profiles").joinpath(f"{ref}.yaml")
            if not str(ref).endswith((".yaml", ".yml")) and builtin.is_file():
                return cls.from_yaml_text(builtin.read_bytes(), source=f"<builtin {ref}>",
                                          default_name=str(ref), vllm=vllm)
            names = ", ".join(sorted(builtin_profiles()))
            raise ProfileError(None, f"no such file, and no built-in profile of that name; "
                               f"built-in profiles: {names}", str(ref))
        if path.is_dir():
            raise ProfileError(None, "is a directory; give a profile YAML file", str(ref))
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(None, f"cannot be read ({exc.strerror})", str(ref)) from exc
        return cls.from_yaml_text(data, source=str(ref), default_name=path.stem, vllm=vllm)

    @classmethod
    def from_yaml_text(cls, data: bytes | str, *, source: str = "<yaml>",
                       default_name: str = "profile", vllm: bool = False) -> Profile:
        if isinstance(data, bytes):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProfileError(None, f"is not UTF-8 text (byte {exc.start}); save it as "
                                   f"UTF-8", source) from exc
        doc = profile_yaml.load(data, source)
        if doc is None and not vllm:
            raise ProfileError(None, f"is empty; required fields: {', '.join(RUN_REQUIRED)}", source)
        return cls.from_mapping(doc, source=source, default_name=default_name, vllm=vllm)

    @classmethod
    def from_mapping(cls, doc: Any, *, source: str = "<mapping>",
                     default_name: str = "profile", vllm: bool = False) -> Profile:
        """Validate a plain mapping (parsed YAML, vLLM ``additional_config``) into a Profile.
        ``vllm``: it is meant for the vLLM plugin, so an ``offload`` or ``kv_prefetch`` section
        is asked for first, before any planner field (:func:`check_vllm_sections`)."""
        if vllm:
            check_vllm_sections(doc, source)
        doc = section(None, doc, source)
        offload = offload_section(doc["offload"], source) if "offload" in doc else None
        kv_prefetch = kv_prefetch_section(doc["kv_prefetch"], source) if "kv_prefetch" in doc else None
        experts = experts_section(doc["experts"], source) if "experts" in doc else None
        # a run profile: all of RUN_REQUIRED or a missing-field error; else vLLM sections only
        run = ((offload is None and kv_prefetch is None and experts is None)
               or any(k in doc for k in RUN_REQUIRED))
        if not run:
            for key in RUN_OPTIONAL:
                if key in doc:
                    raise ProfileError(key, f"needs the run fields {RUN_FIELDS}; a vLLM-only "
                                       f"profile takes its layers from the model", source)
        name = field_value(doc, "name", source)
        lanes = lane_names(field_value(doc, "lanes", source), source)
        layers = depth = mib = slot = None
        if run:
            layers, depth = field_value(doc, "layers", source), field_value(doc, "depth", source)
            slot = slot_section(field_value(doc, "slot", source), source)
            mib = field_value(doc, "workspace_mib", source)
            try:
                PoolLayout.fit(lanes[0], slot.nbytes, depth, int(mib * MIB))
            except BudgetError as exc:
                raise ProfileError("workspace_mib", f"{exc}; accepted: a workspace_mib of at "
                                   f"least one slot.shape", source) from exc
            except ConfigError as exc:  # a budget that rounds to no byte at all
                raise ProfileError("workspace_mib", f"{exc}; accepted: a budget of at least "
                                   f"one slot.shape", source) from exc

        # absent from a vLLM-only profile (refused above): the defaults need no layer count
        gathered_doc = field_value(doc, "gathered_layers", source)
        gathered = None if gathered_doc == "all" else layer_set(
            "gathered_layers", gathered_doc, layers, source)
        ineligible = layer_set("ineligible", field_value(doc, "ineligible", source), layers, source)
        if gathered is not None and not ineligible <= gathered:
            raise ProfileError("ineligible", f"layers {sorted(ineligible - gathered)} are not "
                               f"gathered; accepted: a subset of gathered_layers", source)

        cross = field_value(doc, "cross_forward", source)
        if isinstance(cross, bool):
            cross = list(lanes) if cross else []
        if not isinstance(cross, list) or any(c not in lanes for c in cross):
            raise rejected("cross_forward", cross, source, f"lanes are {list(lanes)}")

        workload = workload_section(field_value(doc, "workload", source), source)
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
                   ineligible=ineligible, synchronous=field_value(doc, "synchronous", source),
                   cross_forward=tuple(dict.fromkeys(cross)),
                   capture=field_value(doc, "capture", source),
                   gather_priority=field_value(doc, "gather_priority", source),
                   kv_token_bytes=field_value(doc, "kv_token_bytes", source), workload=workload,
                   offload=offload, kv_prefetch=kv_prefetch, experts=experts, source=source)

    def to_mapping(self) -> dict:
        """The YAML-shaped mapping that :meth:`from_mapping` turns back into this profile."""
        head: dict[str, Any] = {"name": self.name, "lanes": list(self.lanes),
                                "capture": self.capture, "gather_priority": self.gather_priority}
        if self.offload is not None:
            head["offload"] = self.offload.to_mapping()
        if self.kv_prefetch is not None:
            head["kv_prefetch"] = self.kv_prefetch.to_mapping()
        if self.experts is not None:
            head["experts"] = self.experts.to_mapping()
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
            raise ProfileError("layers", f"is missing: this profile has only vLLM sections "
                               f"({self.vllm_sections_text}), which the plugin plans from the "
                               f"model it loads (set RINGFLOW_DUMP=path to see that plan); add "
                               f"{RUN_FIELDS} to plan it here", self.source)
        return self

    @property
    def vllm_sections_text(self) -> str:
        """The vLLM sections this profile has, as messages name them: ``'offload'``, ..."""
        return " and ".join(f"'{name}'" for name in VLLM_SECTIONS
                            if getattr(self, name, None) is not None)

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


#: the sections the vLLM plugin acts on
VLLM_SECTIONS = ("offload", "kv_prefetch", "experts")

#: what the vLLM plugin needs, as the errors show it
VLLM_EXAMPLE = ('{"offload": {"layers": {"every": 2}, "depth": 1, "workspace_mib": 1024}} '
                '(weight streaming) or {"kv_prefetch": {"depth": 1, "workspace_mib": 240}} (MLA '
                'context prefetch) or {"experts": {"layers": "all"}} (routed experts from host '
                'memory); built-in: vllm_weights, vllm_weights_small, vllm_kv_prefetch')


def check_vllm_sections(doc: Any, source: str) -> None:
    """A profile meant for vLLM has an ``offload`` or a ``kv_prefetch`` section: said at once,
    with an example, for an empty document or one with only the planner's fields.

    Raises:
        ProfileError: neither section is there.
    """
    if isinstance(doc, dict) and any(k in doc for k in VLLM_SECTIONS):
        return
    if doc is None or doc == {}:
        what = "is empty"
    elif isinstance(doc, dict):
        known = section_keys(None)
        unknown = sorted(str(k) for k in doc if k not in known)
        if unknown:  # a misspelt section, most likely: name it as ringflow plan does
            near = difflib.get_close_matches(unknown[0], VLLM_SECTIONS + tuple(known), n=1)
            what = (f"has unknown field '{unknown[0]}'"
                    + (f" (did you mean '{near[0]}'?)" if near else "")
                    + " and no offload, kv_prefetch or experts section")
        else:
            what = (f"is not a vLLM profile: it has {', '.join(sorted(map(str, doc)))} (fields "
                    f"of `ringflow plan` and `ringflow run`) but no offload, kv_prefetch or "
                    f"experts section")
    else:
        return  # not a mapping: section() says what it is
    raise ProfileError(None, f"{what}; vLLM needs an offload, a kv_prefetch or an experts section, for "
                       f"example {VLLM_EXAMPLE}", source)


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in ``ringflow.profiles``."""
    root = resources.files("ringflow.profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(ref: str | Path | dict) -> Profile:
    """Load a profile from a path, a built-in name or a mapping; see :meth:`Profile.load`."""
    return Profile.load(ref)
