"""ChunkPrefetcher: an engine's per-(layer, chunk) gathers issued one unit ahead into a ring.

An attention over a long context gathers it, layer by layer and chunk by chunk, from the paged
cache into one workspace and reads it from there (vLLM's MLA prefill over context). Here every
(layer, chunk) of a step is a *unit*, in execution order ``layer * chunks + chunk``; the plan
gathers unit ``u + depth`` into a ring slot shaped like the workspace while unit ``u``'s
up-projection and attention run, and the engine reads the slot instead of gathering. The fill
is the engine's own gather with that unit's arguments (the caller supplies it), so the slot's
rows are exactly what the engine's read expects.

Note [Chunk plans]
    A step's chunk count is known only once the engine has gathered its first layer, so a plan
    covers ``layers x chunks`` units and is built (hazard-checked, like every plan) the first
    time a step has that many chunks, then kept. The units of one step share one lease ring:
    the slot a unit read is handed back after its reads were issued, and the plan's gather
    into that slot waits for them (the retire event), so a slot is never refilled under a
    read. A step the engine does not finish as planned is abandoned (host sync: every lease
    back), and the engine gathers for itself until the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ringflow.errors import BudgetError, LifecycleError
from ringflow.graphs.eager import executor_for
from ringflow.graphs.slots import SlotPool
from ringflow.graphs.stepped import LayerStepper, engine_computes
from ringflow.orchestrator.planner import Planner
from ringflow.units import mib

log = logging.getLogger("ringflow")

#: fill(layer, chunk, slot): gather unit (layer, chunk) into ``slot`` on the current stream
Fill = Callable[[int, int, torch.Tensor], None]


class ChunkPrefetcher:
    """A ring of workspace-shaped slots and the plans that fill them one unit ahead.

    Args:
        shape, dtype: the engine's gather workspace (one slot each).
        depth: units of lookahead; the ring holds ``depth + 1`` slots (reduced to fit).
        workspace_bytes: device budget of the ring.
        device: where the ring lives (CUDA: eager on a gather stream; CPU: synchronous).
        capture, gather_priority, poison: as for every executor.
        storage: the ring, allocated by the caller (``SlotPool``'s; the DCP context ring
            lies in memory every rank maps).

    Raises:
        BudgetError: the budget holds not one slot.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, *, depth: int,
                 workspace_bytes: int, device: torch.device | str, capture: str = "join",
                 gather_priority: str = "normal", poison: bool = False,
                 name: str = "context", lane: str = "ctx",
                 storage: torch.Tensor | None = None) -> None:
        try:
            self.pool = SlotPool(lane, tuple(shape), dtype, depth=depth,
                                 workspace_bytes=workspace_bytes, device=device,
                                 storage=storage)
        except BudgetError as exc:
            raise BudgetError(lane, exc.slot_bytes, workspace_bytes,
                              what=f"context-chunk slot ({shape[0]:,} rows, the engine's "
                                   f"gather workspace)") from exc
        self.name, self.lane, self.device = name, lane, torch.device(device)
        self.shape, self.dtype = tuple(shape), dtype
        self._options = dict(capture=capture, gather_priority=gather_priority)
        self.poison = poison
        self._steppers: dict[int, LayerStepper] = {}  # units -> stepper over its plan
        self.stepper: LayerStepper | None = None
        self.dag = None
        self._fill: Fill | None = None
        self._chunks = 0
        self._open: int | None = None
        self.steps = 0  # steps whose units were prefetched
        self.consumed = 0  # units the engine read from a slot
        self.abandoned: dict[str, int] = {}  # steps given up part-way, by reason
        #: called with each new plan once it is proven (the vLLM plugin's RINGFLOW_DUMP)
        self.on_plan: Callable | None = None

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes

    @property
    def in_step(self) -> bool:
        return self.stepper is not None and self.stepper.in_forward

    def describe(self) -> str:
        return (f"context-chunk ring '{self.name}': {self.pool.slots} slot(s) x "
                f"{mib(self.pool.slot_bytes)} ({self.shape[0]:,} rows of {self.shape[1:]}), "
                f"depth {self.pool.depth}")

    def start(self, layers: int, chunks: int, fill: Fill) -> None:
        """A step of ``layers`` layers of ``chunks`` chunks each: plan it (first time only)
        and issue the gathers ahead of its first unit on the gather stream.

        Raises:
            LifecycleError: a step is in flight (end or abandon it first).
        """
        if self.in_step:
            raise LifecycleError(f"'{self.name}': a step started with another in flight; "
                                 f"abandon() it first")
        units = layers * chunks
        self.stepper = self._steppers.get(units)
        if self.stepper is None:
            dag = Planner(units, [self.pool.layout], gathered=range(units),
                          name=f"{self.name}/{layers}x{chunks}",
                          meta={"layers": layers, "chunks": chunks}).plan()
            executor = executor_for(dag, [self.pool], self._gather, engine_computes,
                                    poison=False, **self._options)
            self.stepper = self._steppers[units] = LayerStepper(executor, poison=self.poison)
            if self.on_plan is not None:
                self.on_plan(executor.dag)
        self.dag = self.stepper.executor.dag
        self._fill, self._chunks, self._open = fill, chunks, None
        self.steps += 1
        self.stepper.start()

    def begin(self, layer: int, chunk: int) -> torch.Tensor:
        """Before unit (``layer``, ``chunk``) is read: the current stream waits for its gather
        and the gathers the plan puts here are issued; returns its slot. Ends the unit before
        it, whose reads the engine has issued by now."""
        unit = layer * self._chunks + chunk
        if self._open is not None:
            self.end()
        self.stepper.before(unit)
        self._open = unit
        self.consumed += 1
        return self.stepper.lease(unit).tensor

    def end(self) -> None:
        """After the open unit's reads were issued: its slot retires (the step ends after the
        last unit)."""
        if self._open is not None:
            unit, self._open = self._open, None
            self.stepper.after(unit)
        if not self.in_step:
            self._fill = None

    def abandon(self, reason: str) -> None:
        """Give the step in flight up (host sync: every lease back); the engine gathers itself
        until the next step. Logged the first time per reason, then every 1000th."""
        if self.stepper is not None and self.stepper.in_forward:
            self.stepper.abandon(reason)
        self.pool.reclaim(sync=True)
        self._fill, self._open = None, None
        count = self.abandoned[reason] = self.abandoned.get(reason, 0) + 1
        if count == 1 or count % 1000 == 0:
            log.warning("'%s': %s; the engine gathers for itself for the rest of this step (%d "
                        "such step(s))", self.name, reason, count)

    def _gather(self, unit: int, lane: str, slot: torch.Tensor) -> None:
        self._fill(unit // self._chunks, unit % self._chunks, slot)
