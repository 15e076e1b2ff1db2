"""ringflow's part of vLLM's compile-cache key.

Note [Compile-cache key]
    vLLM keeps compiled graphs on disk under a key made of its config hash
    (``VllmConfig.compute_hash``), its own environment variables and the traced source files
    (``torch_aot_compile/<hash>`` and the Inductor cache under it). ``additional_config`` is in
    the config hash; ``RINGFLOW_PROFILE``, the other switches that change the traced model and
    the *content* of a profile named by path are not. Without them an engine started with a
    profile after a plain run (or after another profile) could load a graph traced without
    ringflow's layer ops (streamed layers read with no wait) or with another partition. The
    hook on ``VllmConfig.compute_hash`` (to vLLM 0.33) folds :func:`factors` into vLLM's hash,
    the hook on ``VllmConfig.compile_factors`` (0.34, which hashes that dict) adds them under
    the key ``ringflow``: nothing when
    ringflow is off (plain vLLM's key is unchanged), the resolved profile and every set switch
    marked ``compiled`` in :data:`ringflow.envs.SWITCHES` otherwise. A profile that streams
    weights also brings a digest of the code that decides which layers carry layer ops (the
    placement of ``{count: N}`` and its rates, the plan's issue points, the boundary rule:
    Note [Boundary layers]): none of it is traced, and the same profile could otherwise get
    the ops around other layers than a cached graph has.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

from ringflow import __version__, envs
from ringflow.errors import RingflowError
from ringflow.integrations.vllm.config import profile_from
from ringflow.integrations.vllm.state import PluginState

log = logging.getLogger("ringflow")


def factors(vllm_config, state: PluginState | None = None) -> dict[str, object]:
    """What ringflow changes in the model vLLM traces under ``vllm_config``; empty when
    ringflow changes nothing. A profile that does not load is keyed by its error (the plugin
    reports it where the model loads). ``state``: parse the profile once (its cache)."""
    # RINGFLOW_PROFILE counts by the profile it resolves to (below): an additional_config that
    # wins over it leaves it out of the key, as the start-up line says it is ignored
    found: dict[str, object] = {name: os.environ[name] for name, switch in envs.SWITCHES.items()
                                if switch.compiled and os.environ.get(name)
                                and name != "RINGFLOW_PROFILE"}
    try:
        profile = state.profile(vllm_config) if state is not None else profile_from(vllm_config)
    except RingflowError as exc:
        found["profile_error"] = str(exc)
    else:
        if profile is not None:
            found["profile"] = profile.to_mapping()
            if profile.offload is not None:
                found["wrapped_layers_code"] = wrapped_layers_code()
    if found:
        found["ringflow"] = __version__
    return found


#: the modules that decide which decoder layers carry layer ops for a weight profile
WRAPPED_LAYERS_CODE = ("ringflow.orchestrator.placement", "ringflow.orchestrator.planner",
                       "ringflow.graphs.stepped")


@functools.cache
def wrapped_layers_code() -> str:
    """A digest of the source of :data:`WRAPPED_LAYERS_CODE` as installed."""
    import importlib
    digest = hashlib.sha256()
    for name in WRAPPED_LAYERS_CODE:
        digest.update(Path(importlib.import_module(name).__file__).read_bytes())
    return digest.hexdigest()[:16]


def keyed_hash(base: str, extra: dict[str, object]) -> str:
    """vLLM's hash ``base`` with ringflow's factors folded in (same length; ``base`` itself
    when there are none)."""
    if not extra:
        return base
    text = json.dumps([base, extra], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[: len(base) or None]


def on_compute_hash(state: PluginState, original, vllm_config, *args, **kwargs) -> str:
    """The hook on ``VllmConfig.compute_hash`` (Note [Compile-cache key])."""
    base = original(vllm_config, *args, **kwargs)
    return keyed_hash(base, log_factors(state, factors(vllm_config, state)))


def on_compile_factors(state: PluginState, original, vllm_config, *args, **kwargs):
    """The hook on ``VllmConfig.compile_factors`` (vLLM 0.34: the compile-cache key is the hash
    of this dict): ringflow's factors under ``"ringflow"``, nothing when there are none."""
    found = original(vllm_config, *args, **kwargs)
    extra = log_factors(state, factors(vllm_config, state))
    if extra and isinstance(found, dict):
        found = {**found, "ringflow": extra}
    return found


def factor_words(extra: dict[str, object]) -> str:
    """What ringflow adds to the key, in the log's words: ``profile 'vllm_weights' and the
    code that picks the wrapped layers``."""
    words = []
    for key in sorted(extra):
        if key == "profile":
            words.append(f"profile '{extra[key].get('name', '?')}'")
        elif key == "profile_error":
            words.append("the error its profile gave")
        elif key == "wrapped_layers_code":
            words.append("the code that picks the wrapped layers")
        elif key != "ringflow":
            words.append(f"{key}={extra[key]}")
    return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]])) if words else \
        "version alone"


def log_factors(state: PluginState, extra: dict[str, object]) -> dict[str, object]:
    """Say once, in plain words, what ringflow adds to vLLM's compile-cache key; ``extra``."""
    if extra:
        state.log_once("cache-key", "vLLM's compile-cache key includes ringflow's %s: an "
                       "engine with another profile or switch traces and caches graphs of its "
                       "own", factor_words(extra), level=logging.INFO)
    return extra
