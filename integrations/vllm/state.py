"""What the vLLM plugin knows in one process, in one object that every hook receives.

vLLM calls the plugin's hooks from its own classes (workers, model runners, attention layers,
metadata builders), so the hooks cannot be handed arguments of ringflow's; they are installed
bound to the process's :data:`STATE` instead (``hooks.wrap``), and tests build a fresh
:class:`PluginState` of their own rather than patching module globals.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger("ringflow")


class StepFunctions:
    """vLLM's per-step functions every hooked layer call needs: whether a forward context is
    there, the context, the micro-batch id. Looked up in vLLM once, when the first attention
    layer attaches; until then (and without vLLM) there is no context and one micro-batch."""

    context_available = staticmethod(lambda: False)
    context = staticmethod(lambda: None)
    ubatch = staticmethod(lambda: 0)
    resolved = False  # looked up in vLLM (attention.resolve_step_functions)


@dataclass
class PluginState:
    """One process's plugin state.

    ``lifecycle``: what happened, in order (``"kv-ring-allocated"``, ``"ring-allocated"``,
    ``"kv-cache-initialized"``): the order is what keeps the KV budget honest, and tests assert
    it. ``surfaces``: what ``compat.install`` found in this vLLM (hooks, what is off).
    ``streamers``: each model runner's weight streamer, the one owner of it (it dies with the
    runner); ``boundaries``: likewise the stand-in of ``RINGFLOW_LAYER_OPS_ONLY``.
    ``profiles``: each profile parsed once per source (:meth:`profile`).
    ``models``: each model load's full-KV lanes, by model group (weak: they live as long as
    their attention layers); ``context_models``: likewise each load's MLA context-chunk ring
    (``context_ring.py``); ``expert_lanes``: each model's expert lane (``experts.py``: its
    caches, its layer ring, the MoE modules it serves), the one owner of it; nothing of it is
    kept on vLLM's modules. ``kv_sized``: the KV cache of the current load is sized, so no
    ring may be allocated any more. ``plain_weights``: a model load is in progress whose linear
    layers must keep plain weights (streaming; ``RINGFLOW_CPU_PLAIN_GEMM``). ``steps``: vLLM's
    per-step lookups (:class:`StepFunctions`).
    """

    lifecycle: list[str] = field(default_factory=list)
    surfaces: object = None
    streamers: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    boundaries: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    latest_streamer: weakref.ref | None = None
    profiles: dict = field(default_factory=dict)
    models: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    #: each attention layer with full-KV lanes -> (its model's lanes, its index)
    kv_layers: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    #: each MLA layer's implementation with a context ring -> (its context model, its index)
    context_impls: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary)
    #: each metadata builder -> the live list of layer names it was built for
    builder_layers: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary)
    context_models: weakref.WeakValueDictionary = field(
        default_factory=weakref.WeakValueDictionary)
    #: each model with an expert lane (the profile's experts section) -> its ExpertLane
    expert_lanes: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    kv_sized: bool = False
    plain_weights: bool = False
    logged: set[str] = field(default_factory=set)
    steps: StepFunctions = field(default_factory=StepFunctions)
    #: the model load in progress (each load is its own group: a draft model never shares a
    #: lane with its target)
    model_group: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("ringflow_model_group", default=0))
    _groups: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def record(self, event: str) -> None:
        self.lifecycle.append(event)

    def log_once(self, key: str, message: str, *args, level: int = logging.WARNING) -> None:
        """A line (a warning unless ``level`` says otherwise) the first time ``key`` comes up
        in this process, never again."""
        if key not in self.logged:
            self.logged.add(key)
            log.log(level, message, *args)

    def latest(self):
        """The most recently built weight streamer that is still alive, or None."""
        return None if self.latest_streamer is None else self.latest_streamer()

    def add_streamer(self, runner, streamer) -> None:
        """``streamer`` streams ``runner``'s model; the state owns it while the runner lives."""
        self.streamers[runner] = streamer
        self.latest_streamer = weakref.ref(streamer)

    def ring_bytes(self) -> int:
        """Device bytes of every KV ring (full-KV lanes, context rings) alive in this process."""
        return sum(m.reserved_bytes for m in self.models.values()) + \
            sum(m.reserved_bytes for m in self.context_models.values())

    def expert_bytes(self) -> int:
        """Bytes of every expert lane's slots and ring alive in this process."""
        return sum(lane.bytes for lane in self.expert_lanes.values())

    def profile(self, vllm_config):
        """The profile ``vllm_config`` was started with (None: ringflow is off), parsed once per
        source (the ``additional_config`` section, ``RINGFLOW_PROFILE`` and the named file's
        modification time): vLLM's hooks ask for it once per layer and per step.

        Raises:
            ProfileError: as :func:`config.profile_from`, every time it is asked.
        """
        from ringflow.integrations.vllm.config import profile_from, source_key
        try:
            key = source_key(vllm_config)
        except (TypeError, ValueError):  # a section json cannot key: parse it every time
            return profile_from(vllm_config)
        if key not in self.profiles:
            try:
                self.profiles[key] = profile_from(vllm_config)
            except Exception as exc:  # kept: the same source raises the same error again
                self.profiles[key] = exc
        found = self.profiles[key]
        if isinstance(found, Exception):
            raise found
        return found

    def new_model_load(self) -> None:
        """A worker starts loading a model: rings may be allocated again until its KV cache is
        sized (tests build several engines in one process)."""
        self.kv_sized = False

    @contextlib.contextmanager
    def loading_with_plain_weights(self, plain: bool) -> Iterator[None]:
        """While vLLM's loader runs, linear layers keep plain weights when ``plain``."""
        self.plain_weights = plain
        try:
            yield
        finally:
            self.plain_weights = False

    @contextlib.contextmanager
    def model_load(self) -> Iterator[int]:
        """One model load (vLLM's ``BaseModelLoader.load_model``) as a group of its own."""
        token = self.model_group.set(next(self._groups))
        try:
            yield self.model_group.get()
        finally:
            self.model_group.reset(token)


#: this process's state: the one the installed hooks are bound to
STATE = PluginState()


def dump_rank() -> int | None:
    """This worker's rank where several workers run one model (tensor parallelism), for the
    files ``RINGFLOW_DUMP`` writes (``dumps.dump_stem``); None in a single process."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None
