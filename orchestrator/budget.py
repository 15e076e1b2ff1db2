"""Budget arithmetic of a lane's slot ring: how many slots fit, what they reserve.

Pure arithmetic with no torch, so ``ringflow plan`` can report exactly what :class:`SlotPool`
will allocate without allocating it (the two share :meth:`PoolLayout.fit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringflow.errors import BudgetError, ConfigError
from ringflow.units import mib
MAX_SLOT_BYTES = 1 << 40  # 1 TiB: anything larger is a typo, not a slot
MAX_LAYERS = 8192  # deeper than any model; keeps every plan small enough to check in a second


@dataclass(frozen=True)
class SlotRange:
    """Byte range of one slot inside its pool's single allocation."""

    lane: str
    index: int
    pool: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class PoolLayout:
    """Shape of one lane's ring: ``slots`` slots of ``slot_bytes`` in one allocation named ``pool``.

    ``depth`` is the prefetch lookahead in layers; a ring of ``depth + 1`` slots holds the slot
    being read plus ``depth`` slots being written ahead. Depth 0 (one slot) still prefetches
    behind layers that gather nothing (Note [When a gather is issued] in planner.py).
    """

    lane: str
    slot_bytes: int
    slots: int
    requested_depth: int
    budget_bytes: int
    pool: str = ""

    def __post_init__(self) -> None:
        if not self.pool:
            object.__setattr__(self, "pool", f"pool/{self.lane}")

    @classmethod
    def fit(cls, lane: str, slot_bytes: int, depth: int, budget_bytes: int) -> PoolLayout:
        """The largest ring of at most ``depth + 1`` slots that fits ``budget_bytes``.

        Raises:
            ConfigError: a lane name, slot size, depth or budget that is not one.
            BudgetError: the budget holds not even one slot (the one place this is decided:
                a caller that took the budget from a profile names its field).
        """
        if not isinstance(lane, str) or not lane:
            raise ConfigError(f"lane: expected a non-empty name, got {lane!r}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ConfigError(f"lane '{lane}': a slot must hold at least one byte, got "
                              f"{slot_bytes!r}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < MAX_LAYERS:
            raise ConfigError(f"lane '{lane}': depth must be an integer in 0..{MAX_LAYERS - 1} (a "
                              f"ring holds depth + 1 slots; no plan has more layers), got {depth!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) \
                or not math.isfinite(budget_bytes) or budget_bytes <= 0:
            raise ConfigError(f"lane '{lane}': the budget must be a positive number of bytes, "
                              f"got {budget_bytes!r}")
        budget_bytes = int(budget_bytes)
        fitting = budget_bytes // slot_bytes
        if fitting < 1:
            raise BudgetError(lane, slot_bytes, budget_bytes)
        return cls(lane, slot_bytes, min(depth + 1, fitting), depth, budget_bytes)

    @property
    def depth(self) -> int:
        """Effective lookahead after fitting the budget (``slots - 1``)."""
        return self.slots - 1

    @property
    def reserved_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def reduced(self) -> bool:
        return self.depth < self.requested_depth

    def slot_ranges(self) -> tuple[SlotRange, ...]:
        return tuple(
            SlotRange(self.lane, i, self.pool, i * self.slot_bytes, self.slot_bytes)
            for i in range(self.slots)
        )

    def arithmetic(self) -> str:
        """One line a user can check by hand: requested ring, budget, what was kept."""
        want = (self.requested_depth + 1) * self.slot_bytes
        line = (
            f"lane '{self.lane}': slot {self.slot_bytes:,} B; depth {self.requested_depth} wants "
            f"{self.requested_depth + 1} slot(s) = {mib(want)}; budget "
            f"{mib(self.budget_bytes)}"
        )
        if self.reduced:
            line += (
                f" holds {self.budget_bytes // self.slot_bytes} -> depth reduced to {self.depth} "
                f"({self.slots} slot(s), {mib(self.reserved_bytes)} reserved)"
            )
        else:
            line += f" -> depth {self.depth}, {mib(self.reserved_bytes)} reserved"
        if self.depth == 0:
            line += " (one slot: gathers overlap only layers that gather nothing)"
        return line
