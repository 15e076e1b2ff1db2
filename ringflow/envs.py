"""Every ``RINGFLOW_*`` environment switch: its name, default and meaning, and one parser.

Note [Switches]
    A switch is read when the code that needs it runs, so a test or an engine process can set it
    per run (``RINGFLOW_NVTX`` when ``ringflow.graphs.nvtx_ranges`` is first imported: the
    backend is chosen once). Flags accept ``1``/``true``/``yes``/``on`` and ``0``/``false``/
    ``no``/``off`` (any case; unset or empty is the default); anything else raises
    :class:`~ringflow.errors.ConfigError` naming the variable, because a typo must never
    silently turn a check off or a feature on. Text switches are taken as given (empty: unset).
    The README's knob table lists exactly :data:`SWITCHES` (``tests/docs`` holds it to them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ringflow.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One environment switch. ``kind``: ``flag`` or ``text``; ``scope``: who reads it."""

    name: str
    kind: str
    default: bool | None
    meaning: str
    scope: str = "runtime"
    #: it changes what vLLM traces, compiles or captures: vLLM's compile-cache key holds it
    #: (``integrations/vllm/cache_key.py``)
    compiled: bool = False


#: name -> :class:`Switch`, in the order the README's knob table lists them
SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("RINGFLOW_POISON", "flag", False,
           "executors fill each slot with NaN after its last read, so a stale read shows (debug)",
           compiled=True),
    Switch("RINGFLOW_NVTX", "flag", True, "an NVTX range around every node of a plan"),
    Switch("RINGFLOW_TORCH_RANGES", "flag", False,
           "ringflow's NVTX ranges also open in torch's profiler (record_function), so a "
           "torch.profiler trace such as vLLM's shows them beside vLLM's ops; with "
           "RINGFLOW_NVTX off, none"),
    Switch("RINGFLOW_PROFILE", "text", None,
           "the profile the vLLM plugin enables: a path or a built-in name", "vllm", compiled=True),
    Switch("RINGFLOW_DUMP", "text", None,
           "the vLLM plugin writes the plan that ran to PATH.json and PATH.dot after the first "
           "forward (a directory: DIR/ringflow-plan.json and .dot), and an experts section's "
           "layout to PATH.experts.json at start-up; under tensor parallelism each rank "
           "writes its own, .rank<R> after the stem", "vllm"),
    Switch("RINGFLOW_CPU_PLAIN_GEMM", "flag", False,
           "on a CPU, linear layers keep plain F.linear without streaming (an A/B baseline "
           "with the kernels streaming uses)", "vllm", compiled=True),
    Switch("RINGFLOW_LAYER_OPS_ONLY", "flag", False,
           "decoder layers run between ringflow's layer ops with nothing streamed (a baseline "
           "with the compiled partition streaming uses)", "vllm", compiled=True),
    Switch("RINGFLOW_EXPERT_PLAN_KERNEL", "flag", False,
           "on a GPU, an expert cache plans a one-pass decode step (its hits, victims, "
           "installs and map) in one Triton kernel instead of about 45 small torch kernels "
           "(Note [One kernel plans the step]); off by default (on an H100: exact in vLLM's "
           "engine, batch-1 decode 1.02x the torch path)",
           compiled=True),
    Switch("RINGFLOW_HOST_IDLE_MS", "text", None,
           "the expert lane's host-share worker parks after about this many milliseconds "
           "without a doorbell, so an idle engine keeps no CPU busy, and enters its loop "
           "again at the next step (Note [An idle worker parks]); unset: it never parks. "
           "Not yet run on a GPU", "vllm"),
    Switch("RINGFLOW_HOOK_FRAMES", "flag", False,
           "an error vLLM raises under one of ringflow's hooks keeps ringflow's frames in its "
           "traceback (by default they are dropped: the traceback is vLLM's alone; debug)",
           "vllm"),
    Switch("RINGFLOW_PLANS", "text", None,
           "how many random plans the simulator tests check (default 10000)", "tests"),
    Switch("RINGFLOW_REQUIRE_VLLM", "flag", False,
           "the vLLM end-to-end tests fail instead of skipping when vLLM is missing (CI)",
           "tests"),
    Switch("RINGFLOW_MUTANT", "text", None,
           "the executor mutant tests/helpers/mutants.py applies in this process", "tests",
           compiled=True),
)}


def _switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise ConfigError(f"{name} is not a ringflow switch; switches: "
                          f"{', '.join(SWITCHES)}") from None


def flag(name: str) -> bool:
    """The value of flag ``name`` (Note [Switches]).

    Raises:
        ConfigError: the variable holds something that is not a flag value.
    """
    switch = _switch(name)
    if switch.kind != "flag":
        raise ConfigError(f"{name} is a {switch.kind} switch, not a flag")
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return bool(switch.default)
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    default = "on" if switch.default else "off"
    raise ConfigError(f"{name}={raw!r} is not a flag; accepted: {', '.join(_TRUE)} (on), "
                      f"{', '.join(_FALSE)} (off), any case, or unset ({default}); {name} "
                      f"means: {switch.meaning}")


def text(name: str) -> str | None:
    """The value of text switch ``name``; None when unset or empty."""
    switch = _switch(name)
    if switch.kind != "text":
        raise ConfigError(f"{name} is a {switch.kind} switch, not text")
    return os.environ.get(name) or None


def unknown() -> list[str]:
    """``RINGFLOW_*`` variables set in this environment that are no switch (typos, mostly),
    each with the switch it most resembles: ``"RINGFLOW_POISN (did you mean RINGFLOW_POISON?)"``.
    """
    import difflib

    prefix = len("RINGFLOW_")  # shared by every name: compare what follows it
    known = [s[prefix:] for s in SWITCHES]
    found = []
    for name in sorted(os.environ):
        if name.startswith("RINGFLOW_") and name not in SWITCHES:
            close = difflib.get_close_matches(name[prefix:], known, n=1)
            found.append(name + (f" (did you mean RINGFLOW_{close[0]}?)" if close else ""))
    return found


def warn_unknown(log) -> None:
    """One warning line naming every unknown ``RINGFLOW_*`` variable (nothing when none)."""
    names = unknown()
    if names:
        log.warning("ignoring %s: not a ringflow switch; switches: %s", ", ".join(names),
                    ", ".join(SWITCHES))
