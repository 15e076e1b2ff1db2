"""Deliberate ordering bugs in the executors, for checking that the GPU tests catch them.

``pytest -m cuda --mutant NAME`` (or ``RINGFLOW_MUTANT=NAME`` in a test's subprocess) patches
the executors in this process before any test runs; ``tools/gpu-mutants`` runs the GPU suite
once per mutant and reports which tests killed it. Each mutant is one way a hand-written
prefetch ring goes wrong (ARCHITECTURE.md, "Hazards"): nothing here is imported by ringflow itself.
"""

from __future__ import annotations

import os

import pytest

from ringflow.graphs.captured import CapturedExecutor
from ringflow.graphs.eager import EagerExecutor
from ringflow.graphs.executor import DagExecutor
from ringflow.orchestrator.dag import EventRole, NodeKind


def _skip_wait(role: EventRole):
    original = EagerExecutor._wait

    def wait(self, node):
        if node.role is role:
            return  # the stream no longer waits: whatever it runs next may race
        original(self, node)

    EagerExecutor._wait = wait


def _retire_before_read() -> None:
    """The slot's retire event is recorded before its compute reads it (a lease handed back
    before its last read): the next writer waits on nothing."""
    original_bind, original_record = EagerExecutor._bind_compute, EagerExecutor._record

    def bind_compute(self, node):
        step = original_bind(self, node)
        retire = next((n for n in self.dag.nodes if n.kind is NodeKind.RECORD
                       and n.role is EventRole.RETIRE and n.lane == node.lane
                       and n.layer == node.layer), None)
        if retire is None:
            return step

        def early():
            self._events[retire.event].record(self.stream(retire.stream))
            step()

        return early

    def record(self, node):
        if node.role is EventRole.RETIRE:
            return self._events[node.event]  # already recorded, before the read
        return original_record(self, node)

    EagerExecutor._bind_compute = bind_compute
    EagerExecutor._record = record


def _retire_wait_on_a_stale_event() -> None:
    """A gather into a reused slot waits on an event recorded before the slot's last read
    (the forward's fork), not on the retire that follows the read."""
    original = EagerExecutor._wait

    def wait(self, node):
        if node.role is EventRole.RETIRE:
            fork = f"{node.lane}/{EventRole.FORK}"
            self.stream(node.stream).wait_event(self._events[fork])
            return
        original(self, node)

    EagerExecutor._wait = wait


def _no_replay_order() -> None:
    """Replays on different streams are not ordered after each other (buckets share a pool)."""
    original = CapturedExecutor.run

    def run(self, bucket=None):
        original(self, bucket)
        self._last_stream = None  # forget the previous replay: the next never waits for it

    CapturedExecutor.run = run


def _skip_replay_prime() -> None:
    """A captured replay runs without first filling carried slots that are not there (after a
    reclaim): the graph's first layers read whatever the slots hold."""
    original = CapturedExecutor.run

    def run(self, bucket=None):
        for runner in self._runners.values():
            runner.primed = lambda: True  # the replay believes the carried slots are filled
        original(self, bucket)

    CapturedExecutor.run = run


def _skip_prime_at_write() -> None:
    """Sources that change (a weight reload) only forget the carried slots, as before Note
    [Prime at the write]: the next forward ringflow issues re-fills them, but a graph the engine
    replays first reads the old data."""

    def sources_changed(self, lane):
        self.pools[lane].forget_carried()

    DagExecutor.sources_changed = sources_changed


def _expert_fetch_without_wait() -> None:
    """The expert cache's fetch runs on a side stream, ~10 ms late, and vLLM's stream does not
    wait for it (Note [Expert cache]: the fetch and the MoE share one stream): the MoE reads
    slots that still hold poison or an evicted expert."""
    import torch

    from ringflow.integrations.torch import expert_cache
    original, sides = expert_cache.fetch_experts, {}

    def fetch(host, cache, *args, **kwargs):
        if not cache.is_cuda:
            return original(host, cache, *args, **kwargs)
        side = sides.setdefault(cache.device, torch.cuda.Stream(cache.device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            return original(host, cache, *args, **kwargs)

    expert_cache.fetch_experts = fetch


def _lookahead_without_join() -> None:
    """The lookahead's installs on the side stream start ~10 ms late and the next layer does
    not wait for them (Note [Expert lookahead], step 3): they land while later steps read the
    slots they overwrite."""
    import torch

    from ringflow.integrations.torch import expert_lookahead
    from ringflow.integrations.torch.expert_cache import ExpertCache
    original = ExpertCache.prefetch

    def late_prefetch(self, topk_ids):
        if self.device.type == "cuda":
            torch.cuda._sleep(20_000_000)
        return original(self, topk_ids)

    def join(self):
        self.pending, self._guess = False, None

    ExpertCache.prefetch = late_prefetch
    expert_lookahead.Lookahead.join = join


def _layer_refill_before_retire() -> None:
    """The expert layer ring's copy stream refills a slot without waiting for the retire event
    of its last read (Note [Expert layer ring]): the next layer's copy may overwrite the
    experts a layer is still computing with."""
    from ringflow.integrations.torch.expert_layers import ExpertLayerRing
    original = ExpertLayerRing._fill

    def fill(self, position, lease):
        self._retired[lease.slot] = False  # as if the slot had never been read
        original(self, position, lease)

    ExpertLayerRing._fill = fill


MUTANTS = {
    "skip-ready-wait": lambda: _skip_wait(EventRole.READY),
    "skip-retire-wait": lambda: _skip_wait(EventRole.RETIRE),
    "skip-fork-wait": lambda: _skip_wait(EventRole.FORK),
    "skip-join-wait": lambda: _skip_wait(EventRole.JOIN),
    "retire-before-read": _retire_before_read,
    "retire-wait-on-stale-event": _retire_wait_on_a_stale_event,
    "no-replay-order": _no_replay_order,
    "skip-replay-prime": _skip_replay_prime,
    "skip-prime-at-write": _skip_prime_at_write,
    "expert-fetch-without-wait": _expert_fetch_without_wait,
    "lookahead-without-join": _lookahead_without_join,
    "layer-refill-before-retire": _layer_refill_before_retire,
}

ENV = "RINGFLOW_MUTANT"


def apply(name: str) -> None:
    """Patch the executors with mutant ``name`` for the rest of this process (and its
    children, which read ``RINGFLOW_MUTANT``)."""
    if name not in MUTANTS:
        raise pytest.UsageError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    MUTANTS[name]()
    os.environ[ENV] = name


def apply_from_env() -> None:
    name = os.environ.get(ENV)
    if name:
        apply(name)
