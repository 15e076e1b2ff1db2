"""EagerExecutor: the Dag on real CUDA streams and events, issued from Python each forward.

Compute nodes run on the stream that is current when :meth:`run` is called (so the executor
follows the caller, vLLM's stream included); each lane's gathers run on a side stream of their
own, created once with the requested priority (Note [Dedicated streams]). One
``torch.cuda.Event`` per planned event is created once and re-recorded every forward; a wait binds
to the latest record issued before it, which is exactly what the plan's issue order encodes
(Note [Issue order and edges]).

Note [Running inside a capture]
    When :meth:`EagerExecutor.run` finds the current stream capturing a CUDA graph that ringflow
    did not open (vLLM's graph wrapper, a user's ``torch.cuda.graph``), the profile's
    ``capture`` policy decides:

    * ``join``: issue the plan as usual. The fork record/wait pulls each gather stream into the
      capture after it began and the join brings it back before it ends, so the capture has no
      unjoined work and waits on nothing issued before it (the hazard check proved both). If the
      plan cannot join safely here (a gather stream is already part of another capture), run
      the synchronous path instead and log why, once.
    * ``sync``: run the SyncExecutor path on the capturing stream, and log it once. Nothing is
      pending on the side streams then: every forward joins them before it ends.
    * ``error``: raise :class:`CaptureError` naming the reason.

    Either way nothing inside a capture host-syncs, queries an event, allocates a slot or pins
    memory: streams, events and pools were all made at construction.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping

import torch

from ringflow.errors import CaptureError
from ringflow.graphs.executor import (ComputeFn, DagExecutor, GatherFn, check_option,
                                      cuda_device_of, pools_by_lane)
from ringflow.graphs.streams import dedicated_streams
from ringflow.graphs.sync import SyncExecutor
from ringflow.orchestrator.dag import COMPUTE_STREAM, Dag, Node
from ringflow.orchestrator.vocab import CAPTURE_POLICIES, GATHER_PRIORITIES
from ringflow.graphs.slots import SlotPool

log = logging.getLogger("ringflow")


class EagerExecutor(DagExecutor):
    """Runs a Dag with one side stream per gather lane.

    Args:
        dag: the plan (hazard-checked again here).
        pools: one :class:`SlotPool` per lane, on a CUDA device.
        gather, compute: the user's callables (see ``graphs/executor.py``).
        gather_priority: ``"normal"`` or ``"high"`` (a CUDA stream priority; high lets copies
            and gathers jump ahead of queued compute kernels).
        poison: fill each slot with NaN after its last read (debug; default ``RINGFLOW_POISON``).
        capture: policy inside a CUDA graph capture ringflow did not open: ``"join"``,
            ``"sync"`` or ``"error"`` (Note [Running inside a capture]).
    """

    kind = "eager"

    def __init__(self, dag: Dag, pools: Mapping[str, SlotPool] | Iterable[SlotPool],
                 gather: GatherFn, compute: ComputeFn, *, gather_priority: str = "normal",
                 poison: bool | None = None, capture: str = "join") -> None:
        pools = pools_by_lane(pools)
        check_option("gather_priority", gather_priority, GATHER_PRIORITIES)
        check_option("capture", capture, CAPTURE_POLICIES)
        self.device = cuda_device_of(pools.values(), "EagerExecutor")
        self.gather_priority = gather_priority
        self.capture_policy = capture
        self._logged: set[str] = set()
        # streams of our own, never PyTorch's shared pool (Note [Dedicated streams])
        self._side = dedicated_streams(self, self.device,
                                       [s for s in dag.streams if s != COMPUTE_STREAM],
                                       GATHER_PRIORITIES[gather_priority])
        self._events = {n.event: torch.cuda.Event() for n in dag.nodes if n.event}
        self._current: torch.cuda.Stream | None = None
        super().__init__(dag, pools, gather, compute, poison=poison)
        # the capture-safe fallback: same plan, pools and callables, one stream
        self.sync_path = SyncExecutor(self.dag, pools, gather, compute, poison=self.poison)

    def stream(self, name: str) -> torch.cuda.Stream:
        """The CUDA stream that runs the plan's stream ``name`` in the current forward."""
        return self._current if name == COMPUTE_STREAM else self._side[name]

    def issue(self) -> None:
        """Issue the plan on streams, with no policy check (CapturedExecutor's own capture)."""
        self.start_forward()
        self.issue_steps(0, len(self.steps))

    def start_forward(self) -> None:
        self._current = torch.cuda.current_stream(self.device)
        super().start_forward()

    def prime(self) -> None:
        self._current = torch.cuda.current_stream(self.device)
        super().prime()

    def capture_blockers(self) -> list[str]:
        """Why joining the current capture would be unsafe (empty when it is safe)."""
        reasons = []
        for name, stream in self._side.items():
            with torch.cuda.stream(stream):
                if torch.cuda.is_current_stream_capturing():
                    reasons.append(f"gather stream '{name}' is already part of another capture")
        return reasons

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("%s", message)

    def path_for_current_stream(self) -> DagExecutor:
        """Self, or the synchronous path inside a capture that cannot be joined (policy)."""
        if not torch.cuda.is_current_stream_capturing():
            return self
        capturing_on = torch.cuda.current_stream().device
        if capturing_on != self.device:
            raise CaptureError(f"plan '{self.dag.name}' cannot run in a capture on {capturing_on}: "
                               f"its pools live on {self.device}; capture on that device")
        reasons = self.capture_blockers()
        if self.capture_policy == "error":
            why = "; ".join(reasons) or "the profile's capture policy is 'error'"
            raise CaptureError(
                f"plan '{self.dag.name}' was run inside a CUDA graph capture ringflow did not open "
                f"({why}); set capture: join to fork and join its gather streams inside the "
                f"capture, or capture: sync to run it synchronously")
        if self.capture_policy == "sync" or reasons:
            why = "; ".join(reasons) if reasons else "capture policy is 'sync'"
            self._log_once(f"plan '{self.dag.name}' inside a CUDA graph capture runs the "
                           f"synchronous path ({why})")
            return self.sync_path
        return self

    def _stream_context(self, stream: str) -> contextlib.AbstractContextManager:
        if stream == COMPUTE_STREAM:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._side[stream])

    def _record(self, node: Node) -> torch.cuda.Event:
        event = self._events[node.event]
        event.record(self.stream(node.stream))
        return event

    def _wait(self, node: Node) -> None:
        self.stream(node.stream).wait_event(self._events[node.event])

    def _may_sync(self) -> bool:
        return not torch.cuda.is_current_stream_capturing()


def executor_for(dag: Dag, pools: Iterable[SlotPool], gather: GatherFn, compute: ComputeFn, *,
                 capture: str = "join", gather_priority: str = "normal",
                 poison: bool | None = None) -> DagExecutor:
    """The executor that runs ``dag`` where its pools live: :class:`EagerExecutor` (side
    streams) on a CUDA device, :class:`SyncExecutor` (one stream, in plan order) elsewhere."""
    pools = list(pools)
    if all(p.device.type == "cuda" for p in pools):
        return EagerExecutor(dag, pools, gather, compute, capture=capture,
                             gather_priority=gather_priority, poison=poison)
    return SyncExecutor(dag, pools, gather, compute, poison=poison)
