"""What the plugin checks in vLLM's front end, before any engine process or worker starts.

vLLM builds its engine config in the process the user started (``EngineArgs.
create_engine_config``), then starts the engine core and its workers, which load the model
(45 s and more on a real one). Everything about ringflow that does not need the model is
checked there: the profile from ``--additional-config`` or ``RINGFLOW_PROFILE`` (syntax, fields,
built-in names, cross-field rules) and every ``RINGFLOW_*`` flag. A bad value stops vLLM with
one ``ringflow:`` line that names where it came from; what needs the model (layer indices,
slot sizes) is checked where the model loads, as before.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

from ringflow import __version__, envs
from ringflow.errors import ConfigError, ProfileError, RingflowError
from ringflow.integrations.vllm import compat, startup_errors, surfaces
from ringflow.integrations.vllm.config import profile_from
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.sections import Placed, resolve_layers

log = logging.getLogger("ringflow")


def check(additional_config, enable_lora: bool = False, state: PluginState | None = None):
    """Raise the first ringflow error in ``additional_config`` and the environment.

    Raises:
        ConfigError: a ``RINGFLOW_*`` flag holds something that is not a flag value, or LoRA
            is asked for with weight streaming.
        ProfileError: the profile does not load (the message names its source).
    """
    for name, switch in envs.SWITCHES.items():
        if switch.kind == "flag" and switch.scope != "tests":
            envs.flag(name)
    envs.warn_unknown(log)
    extra = additional_config if isinstance(additional_config, dict) else {}
    config = SimpleNamespace(additional_config=extra)
    profile = state.profile(config) if state is not None else profile_from(config)
    if enable_lora:
        refuse_lora(profile)
    if profile is not None and state is not None:  # what this vLLM lacks, before it starts
        compat.require(state, surfaces.needed(profile),
                       f"profile '{profile.name}' ({profile.source})")
    return profile


def streams_weights(profile) -> bool:
    """Whether an engine started with ``profile`` streams weights (``RINGFLOW_LAYER_OPS_ONLY``
    wraps the layers and moves nothing)."""
    return (profile is not None and profile.offload is not None
            and not envs.flag("RINGFLOW_LAYER_OPS_ONLY"))


def refuse_lora(profile) -> None:
    """LoRA adapters write next to the base weights of the linear layers that weight streaming
    moves; that path is not followed (Note [Weights that change]), so it is refused."""
    if streams_weights(profile):
        raise ConfigError(f"LoRA (enable_lora) is not supported while ringflow streams weights "
                          f"(profile '{profile.name}' from {profile.source}): the adapters on "
                          f"streamed layers are not followed; drop --enable-lora or the "
                          f"profile's offload section")


def refuse_extensible_kv_cache(profile, vllm_config) -> None:
    """vLLM 0.34's extensible KV cache commits its size after warm-up and lends it to weight
    updates (``extend_kv_cache``, ``set_kv_cache_reclaimable``): memory ringflow's credit and
    rings were not sized against, and not followed, so a profile refuses it here.

    Raises:
        ConfigError: the engine has an extensible KV cache and the profile holds a ring.
    """
    cache = getattr(vllm_config, "cache_config", None)
    if profile is not None and getattr(cache, "enable_extensible_kv_cache", False) is True:
        raise ConfigError(f"vLLM's extensible KV cache (--enable-extensible-kv-cache) is not "
                          f"supported with a ringflow profile (profile '{profile.name}' from "
                          f"{profile.source}): it resizes and lends the KV cache after ringflow's "
                          f"rings were counted; pass --no-enable-extensible-kv-cache or drop "
                          f"the profile")


def refuse_streaming_beside_experts(profile) -> None:
    """Weight streaming takes every parameter of its layers, the routed experts' host views
    included (Note [Ringflow places the chosen experts]), and would stream them too: an
    ``offload`` section beside an ``experts`` section was never run, so it is refused."""
    if streams_weights(profile) and profile.experts is not None:
        raise ProfileError("experts", "beside an offload section is not supported: weight "
                           "streaming would also stream the routed experts the expert lane "
                           "serves from host memory; drop one of the two sections",
                           profile.source)


def check_layers(profile, vllm_config) -> None:
    """The offloaded and expert layers against the model's ``num_hidden_layers`` (its config,
    read in the front end): an index or a count past it can exist in no decoder stack. What needs the loaded
    model (the stack itself, slot sizes) is checked where it loads.

    Raises:
        ProfileError: as the worker would, with what was asked and what the model has.
    """
    text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    layers = getattr(text, "num_hidden_layers", None)
    if not (isinstance(layers, int) and not isinstance(layers, bool) and layers > 0):
        return
    if streams_weights(profile):
        spec = profile.offload
        if not isinstance(spec.layers, Placed) or spec.layers.count > layers:
            spec.resolve(layers, profile.source)  # raises what the worker would (a choice
            # itself, for a count that fits, is the worker's: it has the layers' sizes)
    if profile is not None and profile.experts is not None:  # which are MoE: the worker's
        chosen = resolve_layers("experts.layers", profile.experts.layers, layers,
                                profile.source)
        profile.experts.check_slot_layers(chosen, profile.source, among=True)


def announce(state: PluginState, additional_config, profile) -> None:
    """Once per process: ringflow's version and what it will do (idle without a profile), and
    which source was ignored where both ``RINGFLOW_PROFILE`` and ``additional_config`` name
    one, so no choice is silent."""
    env = os.environ.get("RINGFLOW_PROFILE")
    if profile is None:
        why = ("RINGFLOW_PROFILE is set but empty" if env is not None and not env.strip()
               else "no profile: RINGFLOW_PROFILE=NAME or --additional-config "
                    "'{\"ringflow\": ...}' turns it on")
        state.log_once("announce", "version %s installed and idle (%s)", __version__, why,
                       level=logging.INFO)
        return
    ignored = ""
    section = additional_config.get("ringflow") if isinstance(additional_config, dict) else None
    if section is not None and env and env.strip():
        ignored = f"; RINGFLOW_PROFILE={env} is ignored: additional_config.ringflow wins"
    state.log_once("announce", "version %s, profile '%s' from %s%s", __version__, profile.name,
                   profile.source, ignored, level=logging.WARNING if ignored else logging.INFO)


def on_create_engine_config(state: PluginState, original, engine_args, *args, **kwargs):
    """The hook on ``EngineArgs.create_engine_config`` (the front end). A ringflow mistake is
    one ``ringflow:`` line: raised as its typed error (``LLM(...)``), or, under vLLM's command
    line, the process's exit message with no traceback (exit status 2)."""
    try:
        profile = check(getattr(engine_args, "additional_config", None),
                        bool(getattr(engine_args, "enable_lora", False)), state)
        announce(state, getattr(engine_args, "additional_config", None), profile)
        if profile is not None and getattr(engine_args, "enable_extensible_kv_cache", False) \
                is None:  # vLLM 0.34 turns it on where supported unless told: tell it
            engine_args.enable_extensible_kv_cache = False
            log.info("vLLM's extensible KV cache stays off: ringflow's rings are counted "
                     "against a KV cache sized once")
        config = original(engine_args, *args, **kwargs)
        profile = state.profile(config)
        refuse_streaming_beside_experts(profile)
        check_layers(profile, config)  # needs the model's config vLLM just read
        refuse_extensible_kv_cache(profile, config)
    except RingflowError as exc:
        startup_errors.exit_if_cli(f"ringflow: {exc}")  # the line is the last thing seen
        log.error("%s", exc)  # one line, before vLLM starts any engine process
        raise
    if profile is not None:  # what the engine processes find after load comes back here
        startup_errors.open_relay()
        say_cpu_memory(config)
    return config


def say_cpu_memory(config, nodes: list[tuple[int, int]] | None = None) -> bool:
    """On vLLM's CPU build without ``--kv-cache-memory-bytes``, one line before the engine
    starts: vLLM-CPU then reserves ``--gpu-memory-utilization`` (0.92 by default) of its NUMA
    node's memory for itself and its KV cache and stops at start, with a traceback, when less
    is free. ``nodes``: (total, free) bytes per NUMA node (read from /sys when None). Returns
    whether the reservation looks larger than what is free (the line is a warning then)."""
    if str(getattr(getattr(config, "device_config", None), "device_type", "")) != "cpu":
        return False
    cache = getattr(config, "cache_config", None)
    fraction = getattr(cache, "gpu_memory_utilization", None)
    if fraction is None or getattr(cache, "kv_cache_memory_bytes", None) is not None:
        return False
    nodes = numa_memory() if nodes is None else nodes
    if not nodes:
        return False
    total, free = min(nodes, key=lambda n: n[1] - fraction * n[0])
    short = free < fraction * total
    log.log(logging.WARNING if short else logging.INFO,
            "vLLM-CPU reserves --gpu-memory-utilization %.2f of its NUMA node's memory (%.2f of "
            "%.2f GiB; about %.2f GiB is free)%s; --kv-cache-memory-bytes sizes its KV cache "
            "instead and skips that reservation", fraction, fraction * total / 2**30,
            total / 2**30, free / 2**30,
            ": it will likely stop while starting" if short else "")
    return short


def numa_memory() -> list[tuple[int, int]]:
    """(total, free) bytes of each NUMA node, free counting the page cache it may drop."""
    import glob
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node*/meminfo")):
        fields = {}
        try:
            with open(path, encoding="ascii") as src:
                for line in src:
                    parts = line.split()
                    if len(parts) >= 4 and parts[-1] == "kB":
                        fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
        except (OSError, ValueError):
            continue
        if "MemTotal" in fields and "MemFree" in fields:
            nodes.append((fields["MemTotal"], fields["MemFree"] + fields.get("Inactive(file)", 0)))
    return nodes
