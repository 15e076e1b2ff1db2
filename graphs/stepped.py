"""LayerStepper: issue a planned forward from inside an engine's own layer loop.

An engine such as vLLM runs its layers itself; ringflow cannot call them. The engine (through
ringflow's hooks) calls :meth:`LayerStepper.before` and :meth:`LayerStepper.after` around each
layer. ``before(l)`` issues the plan's nodes up to layer l's compute node (its wait for the
slot, or its synchronous gather, and whatever gathers the plan puts earlier); ``after(l)``
issues the nodes that follow, up to the next layer's compute: the retire record, the release,
and the gathers that the freed slot lets start. The compute node itself runs nothing: the
engine's layer is the compute.

A layer index that does not increase starts a new forward: an engine that abandoned a forward
(an exception inside a layer) leaves leases behind, which are handed back first.

Note [Boundary layers]
    An engine need not call ``before``/``after`` around every layer, only around the
    :attr:`LayerStepper.boundaries`: ``before(b)`` issues everything up to ``b``'s compute, so
    the nodes after a skipped layer's compute are issued at the next boundary's ``before``,
    which is on time exactly when they are that next layer's own compute-stream wait (or
    synchronous gather). A layer is a boundary when it starts or ends the forward, when such a
    node of its own precedes its compute, or when anything else follows its compute (a retire,
    a release, the gathers a freed slot lets start, the join). With weights streaming that is
    the first and last layers and the offloaded ones: every gather follows an offloaded layer's
    compute or the forward's start (Note [When a gather is issued] in planner.py). In an engine
    that compiles its model into pieces split at the boundary ops (vLLM), resident layers are
    then no longer cut at their own boundaries (vLLM still cuts at its attention ops). An
    engine that skips a boundary (a compiled graph cached for another plan) is refused at the
    next ``before``: the skipped layer's wait would come after its read.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

from ringflow.errors import LifecycleError, PlanError
from ringflow.graphs.executor import DagExecutor
from ringflow.graphs.slots import poison
from ringflow.orchestrator.dag import COMPUTE_STREAM, NodeKind

log = logging.getLogger("ringflow")


def engine_computes(layer: int, lane: str, slot) -> None:
    """The compute callable of a stepped plan: the engine's own layer is the compute."""


def _owned_by(node, layer: int) -> bool:
    """``node`` is ``layer``'s own step on the compute stream before its compute."""
    return node.stream == COMPUTE_STREAM and node.layer == layer and node.kind in (
        NodeKind.WAIT, NodeKind.SYNC_GATHER, NodeKind.COMPUTE)


def boundary_layers(dag) -> tuple[int, ...]:
    """The layers an engine must call ``before``/``after`` around (Note [Boundary layers])."""
    at = [i for i, n in enumerate(dag.nodes) if n.kind is NodeKind.COMPUTE]
    order = [dag.nodes[i].layer for i in at]
    need = {order[0], order[-1]}
    for k, layer in enumerate(order):
        start = at[k - 1] + 1 if k else 0
        if any(_owned_by(n, layer) for n in dag.nodes[start: at[k]]):
            need.add(layer)  # its own wait (or synchronous gather) precedes its compute
        stop = at[k + 1] if k + 1 < len(at) else len(dag.nodes)
        following = order[k + 1] if k + 1 < len(order) else None
        if not all(_owned_by(n, following) for n in dag.nodes[at[k] + 1: stop]):
            need.add(layer)  # its end issues work that must not wait for the next boundary
    return tuple(sorted(need))


class LayerStepper:
    """Drives ``executor``'s single-lane plan around an external layer loop.

    Args:
        executor: an Eager or Sync executor whose ``compute`` callable does nothing (the engine
            computes). Inside a CUDA graph capture the eager executor's capture policy picks the
            path for the whole forward.
        poison: after each layer, fill its slot with NaN bytes (debug).
    """

    def __init__(self, executor: DagExecutor, *, poison: bool = False) -> None:
        dag = executor.dag
        if len(dag.lanes) != 1:
            raise PlanError(f"LayerStepper drives a single-lane plan; '{dag.name}' has lanes "
                            f"{list(dag.lanes)}; give each lane a stepper of its own")
        self.executor = executor
        self.lane = dag.lanes[0]
        self.poison = poison
        computes = [n for n in dag.nodes if n.kind is NodeKind.COMPUTE]
        self._position = {n.layer: n.id for n in computes}
        self._order = [n.layer for n in computes]
        self._next = {a: self._position[b] for a, b in zip(self._order, self._order[1:])}
        self._end = len(dag.nodes)
        first = self._order[0]
        self._ahead = next(i for i, n in enumerate(dag.nodes)  # the first layer's own nodes
                           if _owned_by(n, first))
        self.boundaries = boundary_layers(dag)
        self._path: DagExecutor | None = None
        self._cursor = 0
        self._layer = -1
        self.forwards = 0
        self.on_forward_done: Callable[[], None] | None = None

    @property
    def in_forward(self) -> bool:
        return self._path is not None

    def start(self) -> None:
        """Start a forward and issue what the plan puts ahead of the first layer's wait (its
        first gathers), so they run while the engine still does other work; ``before`` of the
        first layer then waits for its slot.

        Raises:
            PlanError: a forward is already in flight.
        """
        if self._path is not None:
            raise PlanError(f"start() of plan '{self.executor.dag.name}' with a forward in "
                            f"flight; finish it or abandon() it first")
        self._begin_forward()
        self._issue(self._ahead)

    def _begin_forward(self) -> None:
        self._path = self.executor.path_for_current_stream()
        self._path.start_forward()
        self._cursor = 0

    def before(self, layer: int) -> None:
        """Issue the plan up to ``layer``'s compute; the engine runs the layer next."""
        if layer not in self._position:
            raise PlanError(f"layer {layer} is not in plan '{self.executor.dag.name}' "
                            f"(layers 0..{self.executor.dag.layers - 1})")
        following = self._boundary_after(self._layer) if self._path is not None else None
        if following is not None and self._layer < layer and following < layer:
            raise PlanError(f"plan '{self.executor.dag.name}': the engine went from layer "
                            f"{self._layer} to {layer} without layer {following}'s begin and "
                            f"end, a boundary of this plan (its wait would come after its "
                            f"read); a compiled graph traced for another plan? clear the "
                            f"engine's compile cache")
        if self._path is not None and layer <= self._layer:
            log.warning("layer %d came after layer %d: the previous forward was abandoned; "
                        "handing its slots back and starting a new one", layer, self._layer)
            self._reset(abandon=True)
        if self._path is None:
            if layer != self._order[0]:
                raise PlanError(f"a forward must start at layer {self._order[0]}, not {layer}")
            self._begin_forward()
        self._issue(self._position[layer] + 1)
        self._layer = layer

    def _boundary_after(self, layer: int) -> int | None:
        at = bisect.bisect_right(self.boundaries, layer)
        return self.boundaries[at] if at < len(self.boundaries) else None

    def after(self, layer: int) -> None:
        """Issue the plan from ``layer``'s compute up to the next layer's."""
        if self._path is None or layer != self._layer:
            raise PlanError(f"after({layer}) without a matching before({layer}); the engine "
                            f"must call both around every boundary layer "
                            f"{list(self.boundaries)}")
        if self.poison:
            lease = self.lease(layer)
            if lease is not None:
                poison(lease.tensor)
        self._issue(self._next.get(layer, self._end))
        if self._cursor == self._end:
            self._reset(abandon=False)
            self.forwards += 1
            if self.on_forward_done is not None:
                self.on_forward_done()

    def sources_changed(self, lane: str) -> None:
        """What ``lane`` gathers has changed: the next forward re-gathers every slot
        (``DagExecutor.sources_changed``).

        Raises:
            LifecycleError: a forward is in flight.
        """
        if self._path is not None:
            raise LifecycleError(f"'{self.executor.dag.name}': lane {lane!r}'s sources changed "
                                 f"in the middle of a forward (at layer {self._layer}); change "
                                 f"them between forwards")
        self.executor.sources_changed(lane)

    def lease(self, layer: int):
        """The lease ``layer`` holds in the forward in flight (None outside one)."""
        return None if self._path is None else self._path.lease(self.lane, layer)

    def abandon(self, reason: str | None = None) -> None:
        """Hand back every slot of the forward in flight and forget it (host-syncs); a caller
        with a ``reason`` logs it (see ``DagExecutor.abandon``)."""
        self._reset(abandon=True, reason=reason)

    def _issue(self, stop: int) -> None:
        try:
            self._path.issue_steps(self._cursor, stop)  # hands leases back if a step raises
        except BaseException:
            self._reset(abandon=False)
            raise
        self._cursor = stop

    def _reset(self, *, abandon: bool, reason: str | None = None) -> None:
        if abandon and self._path is not None:
            self._path.abandon(reason)
        self._path = None
        self._cursor = 0
        self._layer = -1
