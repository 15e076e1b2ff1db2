"""CapturedExecutor: the same Dag captured into one CUDA graph per shape bucket, then replayed.

The capture records exactly what :class:`EagerExecutor` issues: gather streams fork from the
capturing stream after capture begins and join back before it ends, so the graph holds the
gather branch parallel to compute with only the planned edges between them. A replay is one
graph launch: no Python per layer, no allocation, no host sync.

Buckets (a token count, a batch size) each get a graph; all of them share one memory pool, so
they must never replay concurrently: every replay is ordered after the previous one, even when
the caller switches streams. A plan that carries leases across forwards (Note [Forward boundary]
in dag.py) is captured in its steady form; when its slots are not primed (the first run, after a
reclaim) the prime runs eagerly before the replay.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping

import torch

from ringflow.errors import CaptureError
from ringflow.graphs import nvtx_ranges
from ringflow.graphs.eager import EagerExecutor
from ringflow.graphs.executor import (ComputeFn, GatherFn, check_option, cuda_device_of,
                                      pools_by_lane)
from ringflow.graphs.streams import dedicated_streams
from ringflow.orchestrator.dag import Dag
from ringflow.orchestrator.hazards import check_hazards
from ringflow.orchestrator.vocab import CAPTURE_POLICIES
from ringflow.graphs.slots import SlotPool

log = logging.getLogger("ringflow")


class CapturedExecutor:
    """Captures and replays a Dag, one CUDA graph per bucket.

    Args:
        dag, pools, gather, compute: as for :class:`EagerExecutor`. The callables must only touch
            static buffers (allocated before capture) for replays to see fresh inputs.
        gather_priority: stream priority of the gather lanes.
        poison: fill each slot with NaN after its last read, in every replay (debug).
        capture: ``"join"`` or ``"error"`` capture the side streams; ``"sync"`` captures the
            synchronous path. A capture that fails falls back to eager runs of that bucket with
            a log line, except under ``"error"``, which raises :class:`CaptureError`.
        keep_graph: keep the CUDA graph after instantiation so :mod:`ringflow.graphs.graph_view`
            can read it back.
        warmup: eager forwards before each capture (lazy library state must not start inside it).
    """

    kind = "captured"

    def __init__(self, dag: Dag, pools: Mapping[str, SlotPool] | Iterable[SlotPool],
                 gather: GatherFn, compute: ComputeFn, *, gather_priority: str = "normal",
                 poison: bool | None = None, capture: str = "join", keep_graph: bool = False,
                 warmup: int = 1) -> None:
        check_option("capture", capture, CAPTURE_POLICIES)
        self.dag = check_hazards(dag)  # once: every bucket's executor gets the proven Dag
        self.pools = pools_by_lane(pools)
        cuda_device_of(self.pools.values(), "CapturedExecutor")
        self.capture_policy = capture
        self.keep_graph = keep_graph
        self.warmup = warmup
        self._options = dict(gather_priority=gather_priority, poison=poison)
        self._default = (gather, compute)
        first = EagerExecutor(dag, self.pools, gather, compute, **self._options)
        self.device = first.device
        self.poison = first.poison
        self._runners: dict[Hashable, EagerExecutor] = {None: first}
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._eager_only: set[Hashable] = set()
        self._replay_ranges: dict[Hashable, object] = {}
        self.pool_handle = torch.cuda.graph_pool_handle()  # shared by every bucket's graph
        self._capture_stream = dedicated_streams(self, self.device, ["capture"], 0)["capture"]
        self._replayed = torch.cuda.Event()
        self._last_stream: torch.cuda.Stream | None = None

    @property
    def graphs(self) -> dict[Hashable, torch.cuda.CUDAGraph]:
        return dict(self._graphs)

    def _runner(self, bucket: Hashable, gather: GatherFn | None,
                compute: ComputeFn | None) -> EagerExecutor:
        runner = self._runners.get(bucket)
        if runner is None or gather is not None or compute is not None:
            g, c = gather or self._default[0], compute or self._default[1]
            runner = EagerExecutor(self.dag, self.pools, g, c, **self._options)
            self._runners[bucket] = runner
        return runner

    def capture(self, bucket: Hashable = None, *, gather: GatherFn | None = None,
                compute: ComputeFn | None = None) -> torch.cuda.CUDAGraph | None:
        """Capture ``bucket``'s graph (callables default to the constructor's).

        Returns the graph, or ``None`` when the capture failed and the bucket now runs eagerly.
        """
        runner = self._runner(bucket, gather, compute)
        issue = runner.sync_path.run if self.capture_policy == "sync" else runner.issue
        current = torch.cuda.current_stream(self.device)
        self._capture_stream.wait_stream(current)
        with torch.cuda.stream(self._capture_stream):
            for _ in range(self.warmup):  # cuBLAS handles and workspaces start here, not inside
                issue()
        current.wait_stream(self._capture_stream)
        graph = torch.cuda.CUDAGraph(keep_graph=self.keep_graph)
        try:
            with torch.cuda.graph(graph, pool=self.pool_handle, stream=self._capture_stream):
                issue()
        except Exception as exc:  # the capture ended with an error; nothing of it ran
            for pool in self.pools.values():
                pool.reclaim(sync=False)
            if self.capture_policy == "error":
                raise CaptureError(f"capturing plan '{self.dag.name}' (bucket {bucket!r}) failed: "
                                   f"{exc}; fix the callable that broke the capture, or use "
                                   f"capture: join to fall back to eager runs") from exc
            log.warning("capturing plan '%s' (bucket %r) failed (%s); running that bucket "
                        "eagerly from now on", self.dag.name, bucket, exc)
            # a new runner with events and streams of its own; the abandoned one's streams are
            # recycled once it is collected, their capture ended (Note [Dedicated streams])
            self._runners[bucket] = EagerExecutor(self.dag, self.pools, runner.gather,
                                                  runner.compute, **self._options)
            self._eager_only.add(bucket)
            return None
        self._graphs[bucket] = graph
        label = "default" if bucket is None else bucket
        self._replay_ranges[bucket] = nvtx_ranges.handle(f"ringflow/replay/{label}")
        return graph

    def run(self, bucket: Hashable = None) -> None:
        """Replay ``bucket``'s graph on the current stream, capturing it on first use."""
        graph = self._graphs.get(bucket)
        if graph is None:
            if bucket in self._eager_only:
                self._runners[bucket].run()
                return
            graph = self.capture(bucket)
            if graph is None:
                self._runners[bucket].run()
                return
        runner = self._runners.get(bucket, self._runners[None])
        if not runner.primed():  # the graph starts with carried slots filled: fill them first
            runner.prime()
        current = torch.cuda.current_stream(self.device)
        if self._last_stream is not None and self._last_stream != current:
            current.wait_event(self._replayed)  # buckets share a pool: never overlap replays
        nvtx_ranges.push(self._replay_ranges[bucket])
        try:
            graph.replay()
        finally:
            nvtx_ranges.pop()
        self._replayed.record(current)
        self._last_stream = current

    def sources_changed(self, lane: str) -> None:
        """What ``lane`` gathers has changed: the next replay (or eager run) of every bucket
        re-fills the carried slots first (``DagExecutor.sources_changed``)."""
        for runner in self._runners.values():
            runner.sources_changed(lane)

    def reset(self) -> None:
        """Drop every captured graph (after the caller synchronized); pools stay allocated."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._eager_only.clear()
