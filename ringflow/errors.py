"""Typed errors: one class per kind of failure, each message a sentence that says what to change.

Every failure ringflow raises on purpose derives from :class:`RingflowError`, so a caller (the
CLI, the vLLM plugin) can turn any of them into one clear line without a traceback, and the
class says which failure it was: a malformed profile, a Python API given a value it cannot use,
a plan that is unsafe, a model ringflow cannot serve, an engine event out of order. Where a
failure has a cause (an allocator's, the file system's), it is chained (``raise ... from exc``).

The profile vocabulary (``field 'offload.workspace_mib'``) appears only in :class:`ProfileError`,
raised where a profile is read or applied; APIs that never saw a profile name their own
arguments. This module imports nothing of ringflow: every room imports it.
"""

from __future__ import annotations

from collections.abc import Iterable


class RingflowError(Exception):
    """Base class of every error ringflow raises on purpose."""


class ProfileError(RingflowError, ValueError):
    """A profile (YAML file, mapping, vLLM ``additional_config``) is malformed, or asks for
    something the model it is applied to does not have.

    Args:
        field: dotted name of the offending field (``"slot.dtype"``), or ``None`` for the document.
        message: what is wrong and what is accepted.
        source: where the profile came from (a path, ``RINGFLOW_PROFILE=...``, ``<dict>``).
    """

    def __init__(self, field: str | None, message: str, source: str | None = None):
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}{what}{message}")


class ConfigError(RingflowError, ValueError):
    """A Python API, a command-line option or a ``RINGFLOW_*`` switch was given a value it
    cannot use; the message names the argument and what it accepts."""


class BudgetError(ConfigError):
    """A ring's budget holds not even one slot. ``slot_bytes`` and ``budget_bytes`` say by how
    much; where the budget came from a profile, the caller re-raises it as a ProfileError."""

    def __init__(self, lane: str, slot_bytes: int, budget_bytes: int, what: str = "slot",
                 hint: str = ", or a smaller slot"):
        self.lane, self.slot_bytes, self.budget_bytes = lane, slot_bytes, budget_bytes
        mib = 1 << 20
        need = -(-slot_bytes * 1000 // mib) / 1000  # rounded up: a budget of this many MiB fits
        super().__init__(
            f"lane '{lane}': a budget of {budget_bytes / mib:.3f} MiB is smaller than one {what} "
            f"({slot_bytes:,} B = {slot_bytes / mib:.3f} MiB); give at least {need:.3f} MiB"
            f"{hint}")


class AllocationError(RingflowError):
    """Device or pinned host memory could not be allocated; the allocator's error is the cause."""


class PlanError(RingflowError, ValueError):
    """A plan cannot be built from the given request (bad layer sets, pools that do not match)."""


class HazardError(RingflowError):
    """A Dag (or an expert step's trace) is unsafe to run. ``nodes`` are the ids of the offending
    nodes (the indices of the offending operations)."""

    def __init__(self, kind: str, message: str, nodes: Iterable[int]):
        self.kind = kind
        self.nodes = tuple(nodes)
        where = f" (nodes {', '.join(map(str, self.nodes))})" if self.nodes else ""
        super().__init__(f"{kind}: {message}{where}")


class SlotPoolExhausted(RingflowError):
    """``acquire()`` found no free slot. The pool never allocates to make room."""

    def __init__(self, lane: str, depth: int, slots: int, budget_bytes: int, detail: str = ""):
        self.lane, self.depth, self.slots, self.budget_bytes = lane, depth, slots, budget_bytes
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"slot pool of lane '{lane}' is exhausted: all {slots} slots (depth {depth}, "
            f"budget {budget_bytes} bytes) are leased.{extra} Release a lease first, or raise "
            f"the depth or the budget; ringflow never allocates more slots."
        )


class LeaseError(RingflowError):
    """A lease was used out of order (double release, read before ready, release while writing)."""


class CaptureError(RingflowError):
    """A plan cannot run inside a CUDA graph capture under its ``capture`` policy."""


class KernelError(RingflowError, ValueError):
    """A gather kernel was given tensors it cannot use (shape, dtype, device or pinning)."""


class ExecutorError(RingflowError):
    """An executor cannot run the given Dag here (wrong device, pools that do not match the plan)."""


class DeviceError(RingflowError):
    """The work needs CUDA devices (one, or several of one host) that this machine lacks."""


class LifecycleError(RingflowError):
    """A call came in an order that would make a budget lie or a gather read stale memory: a
    ring requested after the KV cache was sized, a re-plan in the middle of a step, a step
    begun before any plan."""


class UnsupportedModelError(RingflowError):
    """The model is built in a way ringflow cannot stream or prefetch as asked (weights shared
    between layers, a decoder stack vLLM's helpers did not build, a layer with no weights)."""


class EngineError(RingflowError):
    """The engine runs in a configuration ringflow cannot work beside (its own weight
    offloader on, a communicator the gather lane cannot make)."""


class MeasurementError(RingflowError):
    """A benchmark's own check failed (outputs that differ, a transport that fell back), so its
    numbers would not measure what they name."""


class OutputError(RingflowError):
    """A result (a dump, a benchmark record) cannot be written; the file system's error is the
    cause."""
