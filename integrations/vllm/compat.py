"""Which vLLM runs here, and ringflow's hooks installed from the table of surfaces.

``surfaces.py`` lists every vLLM surface ringflow touches, per vLLM version range; this module
finds each one in the running vLLM, checks its parameters, and installs ringflow's hook there
(what ringflow only reads, :func:`get` looks up when it is needed). It is the only place that imports vLLM by a
name from the table, so a new vLLM is taught in the table alone.

Note [ringflow never stops vLLM]
    vLLM calls every general plugin's ``register`` with no ``try`` around it, in every process
    it starts, whether or not a profile is set: an exception there stops vLLM. So nothing here
    raises: a surface that is missing, renamed or whose parameters changed turns its feature
    off with one warning line naming vLLM's version and the surface, and vLLM runs as without
    ringflow. Only a profile that needs a feature that is off stops start-up, with one typed
    line (:func:`require`), where the profile is read.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import weakref
from dataclasses import dataclass, field

from ringflow.errors import EngineError
from ringflow.integrations.vllm import surfaces
from ringflow.integrations.vllm.hooks import wrap, wrap_function
from ringflow.integrations.vllm.surfaces import FEATURES, SUPPORTED, Surface

log = logging.getLogger("ringflow")


def version_tuple(text: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found[1]), int(found[2])) if found else None


def vllm_version() -> str:
    try:
        import vllm
    except Exception:  # noqa: BLE001 - a vLLM that does not import: nothing to hook
        return "?"
    return str(getattr(vllm, "__version__", "?"))


@dataclass
class Installed:
    """What :func:`install` found in this process's vLLM: the hooks it installed, the surfaces
    it did not find, and each feature that is off with the surface that turned it off."""

    version: str
    hooked: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # surface key -> why
    off: dict[str, tuple[str, str]] = field(default_factory=dict)  # feature -> (key, why)
    #: (owner, name, what the owner held before): what :func:`uninstall` puts back
    installed: list[tuple[object, str, object]] = field(default_factory=list)
    #: (a weak reference to an object vLLM built, name): attributes :func:`shadow` set on it
    shadowed: list[tuple[weakref.ref, str]] = field(default_factory=list)

    @property
    def parsed(self) -> tuple[int, int] | None:
        return version_tuple(self.version)


class SurfaceMissing(LookupError):
    """A surface is not where the table says, or its parameters changed."""


def resolve(surface: Surface) -> object:
    """The live object ``surface`` names (a class's own attribute, as the class holds it).

    Raises:
        SurfaceMissing: its module does not import, a name on the way is absent, or the
            parameters ringflow relies on are not there.
    """
    try:
        target = importlib.import_module(surface.module)
    except Exception as exc:  # noqa: BLE001 - any import failure means: not here
        raise SurfaceMissing(f"module {surface.module} does not import ({type(exc).__name__}: "
                             f"{exc})") from exc
    for part in surface.path.split("."):  # a class's own attribute as the class holds it
        target = (inspect.getattr_static(target, part, _ABSENT) if inspect.isclass(target)
                  else getattr(target, part, _ABSENT))
        if target is _ABSENT:
            raise SurfaceMissing(f"{surface.key} is absent")
    if isinstance(target, (staticmethod, classmethod)):
        target = target.__func__
    if surface.params:
        check_params(surface, target)
    return target


_ABSENT = object()


def params_of(function) -> list[str] | None:
    """Parameter names, in order (``*args`` as ``*name``, a keyword-only one as ``:name``);
    None if they cannot be read."""
    original = getattr(function, "__wrapped__", function)  # ringflow's own hooks wrap it
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return None
    mark = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.KEYWORD_ONLY: ":"}
    return [mark.get(p.kind, "") + p.name for p in signature.parameters.values()
            if p.kind is not p.VAR_KEYWORD]


def params_match(surface: Surface, names: list[str]) -> bool:
    """Whether ``names`` (a signature's, as :func:`params_of` spells them) has what
    ``surface.params`` says: positional from the first (a ``*args`` takes the rest; ringflow's
    hooks pass them on by position), or, with ``surface.anywhere``, by name (the hook binds
    them by name, keyword-only or not)."""
    if surface.anywhere:
        return set(surface.params) <= {n.lstrip(":") for n in names}
    for i, want in enumerate(surface.params):
        if i >= len(names) or names[i].startswith("*"):
            return i < len(names)
        if names[i] != want:
            return False
    return True


def check_params(surface: Surface, target) -> None:
    names = params_of(target)
    if names is None:  # a builtin or an extension function: nothing to read, take it
        return
    if not params_match(surface, names):
        raise SurfaceMissing(f"{surface.key} takes ({', '.join(names)}), not "
                             f"({', '.join(surface.params)}{', ...' if surface.params else ''}) "
                             f"as ringflow's hook expects")


def _hook_for(surface: Surface):
    module, name = surface.hook.split(":")
    hook = getattr(importlib.import_module(module), name)
    return hook(surface) if surface.factory else hook


def install(state) -> Installed:
    """Install every hook of the table that this vLLM has; keep what ringflow reads.

    Never raises (Note [ringflow never stops vLLM]); the result, also on ``state.surfaces``,
    says what is off and why.
    """
    found = Installed(vllm_version())
    if getattr(state, "surfaces", None) is not None:  # installed before: what it replaced
        found.installed = state.surfaces.installed
    state.surfaces = found
    version = found.parsed
    low, high = SUPPORTED
    if version is None or not low <= version <= high:
        log.warning("vLLM %s is outside the versions ringflow supports (%d.%d to %d.%d); each "
                    "surface it lacks is named below, and turns its feature off", found.version,
                    *low, *high)
    present: set[str] = set()
    for surface in surfaces.SURFACES:
        if surface.kind in ("attribute", "source"):  # checked in vLLM's source only
            continue
        try:
            target = resolve(surface)
            _install_one(state, surface, target, found)
        except Exception as exc:  # noqa: BLE001 - Note [ringflow never stops vLLM]
            found.missing[surface.key] = (str(exc) if isinstance(exc, SurfaceMissing)
                                          else f"{type(exc).__name__}: {exc}")
            continue
        present.add(surface.key)
    groups: dict[str, list[Surface]] = {}
    for surface in surfaces.SURFACES:
        if surface.group is not None:
            groups.setdefault(surface.group, []).append(surface)
    for surface in surfaces.SURFACES:
        why = found.missing.get(surface.key)
        if why is None or not surface.in_range(version):
            continue  # there, or this vLLM is not expected to have it (another range's)
        members = groups.get(surface.group, [surface])
        if surface.required and not any(m.key in present for m in members):
            found.off.setdefault(surface.feature, (surface.key, why))
            log.warning("vLLM %s: %s; %s is off", found.version, why, FEATURES[surface.feature])
        else:
            log.info("vLLM %s: %s; ringflow goes on without it (its use there: %s)",
                     found.version, why, surface.does)
    return found


def _install_one(state, surface: Surface, target, found: Installed) -> None:
    if surface.kind in ("read", "instance") or surface.hook is None:
        return  # hooked per object at run time (hook_class, or the instance hooks' owners)
    module = importlib.import_module(surface.module)
    owner_path, _, name = surface.path.rpartition(".")
    hook = _hook_for(surface)
    if surface.kind == "function":
        _recorded(found, module, name, lambda: wrap_function(module, name, hook, state))
    elif surface.kind == "method":
        owner = _walk(module, owner_path)
        _recorded(found, owner, name, lambda: wrap(owner, name, hook, state))
    elif surface.kind == "subclasses":
        pending, seen = [_walk(module, owner_path)], set()
        while pending:
            cls = pending.pop()
            if cls in seen:
                continue
            seen.add(cls)
            pending.extend(cls.__subclasses__())
            own = vars(cls).get(name)
            if own is not None and not getattr(own, "__isabstractmethod__", False):
                _recorded(found, cls, name, lambda cls=cls: wrap(cls, name, hook, state))
    else:
        raise EngineError(f"surface {surface.key}: unknown kind {surface.kind!r}")
    found.hooked.append(surface.key)


def _recorded(found: Installed, owner, name: str, wrap_it) -> None:
    """Run ``wrap_it`` (a wrap of ``owner.name``) and record what ``owner`` held there, for
    :func:`uninstall`, only if the wrap replaced it (not when the method was hooked already,
    on this class or the one it inherits it from, nor when the wrap raised)."""
    held = vars(owner).get(name, _ABSENT)
    wrap_it()
    if vars(owner).get(name, _ABSENT) is not held:
        found.installed.append((owner, name, held))


def uninstall(state) -> None:
    """Put back what :func:`install` and :func:`hook_class` replaced (tests install the table
    again, on a vLLM changed in between)."""
    found = getattr(state, "surfaces", None)
    if found is None:
        return
    for ref, name in reversed(found.shadowed):
        obj = ref()
        if obj is not None and name in vars(obj):
            delattr(obj, name)
    found.shadowed.clear()
    for owner, name, held in reversed(found.installed):
        if held is _ABSENT:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, held)
    found.installed.clear()
    state.surfaces = None


def _walk(module, path: str):
    owner = module
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def get(state, key: str):
    """What ringflow reads at ``key`` (a ``read`` surface) as vLLM holds it now, or None where
    this vLLM lacks it (its feature is then off, as the log said at start-up). Looked up on
    every call (never per layer or step), so whatever replaced it since is what is read."""
    found = getattr(state, "surfaces", None)
    if found is not None and key in found.missing:
        return None
    try:
        return resolve(surfaces.by_key()[key])
    except SurfaceMissing:
        return None


def hook_class(state, key: str, cls: type) -> bool:
    """Install the table's hook for ``key`` (an ``instance`` surface, a method) on ``cls``, a
    class vLLM chose at run time (a backend's metadata builder). False: ``cls`` has no such
    method, or it cannot be hooked (logged once, :func:`instance_ok`)."""
    surface = surfaces.by_key()[key]
    name = surface.path.rpartition(".")[2]
    if not hasattr(cls, name) or not instance_ok(state, key, cls):
        return False
    found = getattr(state, "surfaces", None)
    try:
        if found is None:
            wrap(cls, name, _hook_for(surface), state)
        else:
            _recorded(found, cls, name, lambda: wrap(cls, name, _hook_for(surface), state))
    except EngineError as exc:  # hooked for another plugin state
        _cannot_hook(state, surface, cls, exc)
        return False
    return True


def shadow(state, key: str, obj, value) -> bool:
    """Give ``obj`` (an object vLLM built: a layer) its own ``value`` for the ``instance``
    surface ``key``, its class and every other object untouched; :func:`uninstall` takes it
    away again (held weakly: the object dies with its model). False where the surface's
    parameters changed on ``obj``'s class (logged once, :func:`instance_ok`)."""
    name = surfaces.by_key()[key].path.rpartition(".")[2]
    if not instance_ok(state, key, type(obj)):
        return False
    setattr(obj, name, value)
    found = getattr(state, "surfaces", None)
    if found is not None:
        found.shadowed.append((weakref.ref(obj), name))
    return True


def instance_ok(state, key: str, cls: type) -> bool:
    """Whether ``cls``'s method of the ``instance`` surface ``key`` (a class vLLM chose at run
    time: a layer's, a backend's) still takes what ringflow's per-object hook relies on; False
    is logged once per class."""
    surface = surfaces.by_key()[key]
    try:
        check_params(surface, getattr(cls, surface.path.rpartition(".")[2]))
    except (SurfaceMissing, AttributeError) as exc:
        _cannot_hook(state, surface, cls, exc)
        return False
    return True


def _cannot_hook(state, surface: Surface, cls: type, why: Exception) -> None:
    name = surface.path.rpartition(".")[2]
    state.log_once(f"hook:{cls.__qualname__}.{name}", "vLLM %s: %s.%s cannot be hooked (%s); "
                   "%s is off for its layers", vllm_version(), cls.__qualname__, name, why,
                   FEATURES[surface.feature])


def require(state, features: set[str], who: str) -> None:
    """Stop with one typed line when ``who`` (a profile) needs a feature this vLLM lacks.

    Raises:
        EngineError: naming the feature, the surface that is missing and vLLM's version.
    """
    found = getattr(state, "surfaces", None)
    if found is None:
        return
    for feature in sorted(features):
        if feature in found.off:
            key, why = found.off[feature]
            raise EngineError(f"{who} needs {FEATURES[feature]}, which ringflow cannot offer "
                              f"on vLLM {found.version}: {why}; use a vLLM ringflow supports "
                              f"({SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}."
                              f"{SUPPORTED[1][1]}) or drop what needs it from the profile")


def metadata_builder_class(layer) -> type | None:
    """The metadata builder class of an attention layer's backend (None if it has none)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        return backend.get_builder_cls() if backend is not None else None
    except (AttributeError, NotImplementedError):
        return None
