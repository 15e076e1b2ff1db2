"""Which profile vLLM was started with: read by the plugin (weight streaming) and by the
attention hooks (full-KV prefetch), so neither imports the other."""

from __future__ import annotations

import dataclasses
import json
import os

from ringflow import envs
from ringflow.errors import ProfileError
from ringflow.orchestrator.profile import Profile


def profile_from(vllm_config) -> Profile | None:
    """The profile vLLM was started with, or None when ringflow is not enabled.

    ``additional_config["ringflow"]`` wins over ``RINGFLOW_PROFILE``.

    Raises:
        ProfileError: the profile is malformed or has neither an ``offload`` nor a
            ``kv_prefetch`` section.
    """
    section, env = _sources(vllm_config)
    if section is not None:
        named = _named(section, env)
        if named is not None:
            profile = _named_profile(named, f"additional_config.ringflow={named!r}")
        else:
            profile = Profile.from_mapping(section, source="additional_config.ringflow",
                                           default_name="vllm", vllm=True)
    elif env:
        profile = _named_profile(env, f"RINGFLOW_PROFILE={env}")
    else:
        return None
    return profile


def _named_profile(ref: str, where: str) -> Profile:
    """The profile at path or built-in name ``ref``; it and its errors name ``where`` it was
    given (and the file or built-in it found there), so a mistake found later, where the model
    loads, names it too."""
    def labelled(found: str | None) -> str:  # where, and the file or built-in found there
        return where + (f" ({found})" if found != ref else "")

    try:
        profile = Profile.load(ref, vllm=True)
    except ProfileError as exc:
        message = str(exc)
        if exc.source and message.startswith(f"{exc.source}: "):
            message = message[len(exc.source) + 2:]
        if exc.field and message.startswith(f"field '{exc.field}': "):
            message = message[len(exc.field) + 10:]
        raise ProfileError(exc.field, message, labelled(exc.source)) from exc
    return dataclasses.replace(profile, source=labelled(profile.source))


def _sources(vllm_config) -> tuple[object, str | None]:
    """``additional_config["ringflow"]`` (None: absent) and ``RINGFLOW_PROFILE``."""
    extra = getattr(vllm_config, "additional_config", None)
    return (extra.get("ringflow") if isinstance(extra, dict) else None,
            envs.text("RINGFLOW_PROFILE"))


def _named(section, env: str | None) -> str | None:
    """The path or built-in name the sources name (None: a mapping, or nothing): the section
    as a string or ``{"profile": ...}``, else, without a section, the variable."""
    if section is None:
        return env or None
    if isinstance(section, str):
        return section
    if isinstance(section, dict) and set(section) == {"profile"}:
        return section["profile"]
    return None


def source_key(vllm_config) -> tuple:
    """What :func:`profile_from` reads, as a key: the ``additional_config`` section, the
    ``RINGFLOW_PROFILE`` value, and the modification time of a file either names (an edited
    file is a new profile)."""
    section, env = _sources(vllm_config)
    named = _named(section, env)
    try:
        stamp = os.stat(named).st_mtime_ns if named else None
    except (OSError, TypeError, ValueError):
        stamp = None
    return json.dumps(section, sort_keys=True, default=str), env, stamp
