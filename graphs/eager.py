"""EagerExecutor: the Dag on real CUDA streams and events, issued from Python each forward.

Compute nodes run on the stream that is current when :meth:`run` is called (so the executor
follows the caller, vLLM's stream included); each lane's gathers run on a side stream of their
own, created once with the requested priority. One ``torch.cuda.Event`` per planned event is
created once and re-recorded every forward; a wait binds to the latest record issued before it,
which is exactly what the plan's issue order encodes (Note [Issue order and edges]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch

from ringflow.errors import ExecutorError
from ringflow.graphs.executor import ComputeFn, DagExecutor, GatherFn
from ringflow.orchestrator.dag import COMPUTE_STREAM, Dag, Node
from ringflow.orchestrator.slots import SlotPool

PRIORITIES = {"normal": 0, "high": -1}


class EagerExecutor(DagExecutor):
    """Runs a Dag with one side stream per gather lane.

    Args:
        dag: the plan (hazard-checked again here).
        pools: one :class:`SlotPool` per lane, on a CUDA device.
        gather, compute: the user's callables (see ``graphs/executor.py``).
        gather_priority: ``"normal"`` or ``"high"`` (a CUDA stream priority; high lets copies
            and gathers jump ahead of queued compute kernels).
        poison: fill each slot with NaN after its last read (debug; default ``RINGFLOW_POISON``).
    """

    kind = "eager"

    def __init__(self, dag: Dag, pools: Mapping[str, SlotPool] | Iterable[SlotPool],
                 gather: GatherFn, compute: ComputeFn, *, gather_priority: str = "normal",
                 poison: bool | None = None) -> None:
        pools = dict(pools) if isinstance(pools, Mapping) else {p.lane: p for p in pools}
        devices = {p.device for p in pools.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ExecutorError(f"EagerExecutor needs every pool on one CUDA device, got "
                                f"{sorted(map(str, devices))}; use SyncExecutor on the CPU")
        if gather_priority not in PRIORITIES:
            raise ExecutorError(f"gather_priority must be one of {', '.join(PRIORITIES)}, "
                                f"got {gather_priority!r}")
        self.device = next(iter(devices))
        self.gather_priority = gather_priority
        self._side = {s: torch.cuda.Stream(self.device, priority=PRIORITIES[gather_priority])
                      for s in dag.streams if s != COMPUTE_STREAM}
        self._events = {n.event: torch.cuda.Event() for n in dag.nodes if n.event}
        self._current: torch.cuda.Stream | None = None
        super().__init__(dag, pools, gather, compute, poison=poison)

    def stream(self, name: str) -> torch.cuda.Stream:
        """The CUDA stream that runs the plan's stream ``name`` in the current forward."""
        return self._current if name == COMPUTE_STREAM else self._side[name]

    def run(self) -> None:
        self._current = torch.cuda.current_stream(self.device)
        super().run()

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
