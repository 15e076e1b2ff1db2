"""Typed errors. Every message is a sentence that says what to change.

All of ringflow's failures derive from :class:`RingflowError`, so a caller (the CLI, the vLLM
plugin) can turn any of them into one clear line without a traceback. This module imports
nothing of ringflow: every layer imports it.
"""

from __future__ import annotations

from collections.abc import Iterable


class RingflowError(Exception):
    """Base class of every error ringflow raises on purpose."""


class ProfileError(RingflowError, ValueError):
    """A profile (YAML file, dict or override) is malformed.

    Args:
        field: dotted name of the offending field (``"slot.dtype"``), or ``None`` for the document.
        message: what is wrong and what is accepted.
        source: where the profile came from (a path or ``"<dict>"``).
    """

    def __init__(self, field: str | None, message: str, source: str | None = None):
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}{what}{message}")


class PlanError(RingflowError, ValueError):
    """A plan cannot be built from the given request (bad layer sets, pools that do not match)."""


class HazardError(RingflowError):
    """A Dag is unsafe to run. ``nodes`` are the ids of the offending nodes."""

    def __init__(self, kind: str, message: str, nodes: Iterable[int]):
        self.kind = kind
        self.nodes = tuple(nodes)
        super().__init__(f"{kind}: {message} (nodes {', '.join(map(str, self.nodes))})")


class SlotPoolExhausted(RingflowError):
    """``acquire()`` found no free slot. The pool never allocates to make room."""

    def __init__(self, lane: str, depth: int, slots: int, budget_bytes: int, detail: str = ""):
        self.lane, self.depth, self.slots, self.budget_bytes = lane, depth, slots, budget_bytes
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"slot pool of lane '{lane}' is exhausted: all {slots} slots (depth {depth}, "
            f"budget {budget_bytes} bytes) are leased.{extra} Release a lease first, or raise "
            f"'depth'/'workspace_mib' in the profile; ringflow never allocates more slots."
        )


class LeaseError(RingflowError):
    """A lease was used out of order (double release, read before ready, release while writing)."""


class CaptureError(RingflowError):
    """A plan cannot run inside a CUDA graph capture under the profile's ``capture`` policy."""


class KernelError(RingflowError, ValueError):
    """A gather kernel was given tensors it cannot use (shape, dtype, device or pinning)."""


class ExecutorError(RingflowError):
    """An executor cannot run the given Dag here (wrong device, pools that do not match the plan)."""


class LifecycleError(RingflowError):
    """An engine event came in an order that would make a budget lie or a gather read stale
    memory (a ring requested after the KV cache was sized)."""
