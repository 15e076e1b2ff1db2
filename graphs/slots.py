"""SlotPool and Lease: a bounded, preallocated ring of workspace slots and who owns each slot.

Note [Lease lifecycle]
    A lease is one slot for one use::

        FREE --acquire--> WRITING --mark_ready--> READY --begin_read--> READING
             <--release-- RETIRING <----------------retire----------------'

    ``mark_ready`` carries the event recorded after the write; ``retire`` the event recorded
    after the last read (or none when the slot's next writer runs on the reader's stream). The
    device-side ordering itself is the Dag's job: executors issue the plan's ``record``/``wait``
    nodes, and the hazard check has proven that a slot's next writer waits for its previous
    retire. The lease is the host-side ownership record: it makes misuse (reading before ready,
    releasing while writing, releasing twice) a :class:`LeaseError` at the line that did it, and
    it remembers the events that teardown must wait for.

    Teardown (:meth:`SlotPool.close`, :meth:`SlotPool.reclaim`) may host-sync; it is the only
    place that does, and it never hands back a slot whose writer or reader may still run.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Sequence

import torch

from ringflow.errors import (AllocationError, ConfigError, DeviceError, LeaseError,
                             SlotPoolExhausted)
from ringflow.orchestrator.budget import MAX_SLOT_BYTES, PoolLayout
from ringflow.orchestrator.vocab import DTYPE_BYTES

log = logging.getLogger("ringflow")


class LeaseState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"
    READING = "reading"
    RETIRING = "retiring"


class Lease:
    """Ownership of one slot for one use; see Note [Lease lifecycle]."""

    __slots__ = ("pool", "slot", "tensor", "tag", "state", "ready_event", "retire_event")

    def __init__(self, pool: SlotPool, slot: int, tensor: torch.Tensor, tag: object) -> None:
        self.pool = pool
        self.slot = slot
        self.tensor = tensor
        self.tag = tag
        self.state = LeaseState.WRITING
        self.ready_event: torch.cuda.Event | None = None
        self.retire_event: torch.cuda.Event | None = None

    def __repr__(self) -> str:
        return f"Lease(lane={self.pool.lane!r}, slot={self.slot}, tag={self.tag!r}, {self.state.value})"

    def _misuse(self, what: str, fix: str) -> LeaseError:
        return LeaseError(f"{what}: {self!r}. {fix}")

    def mark_ready(self, event: torch.cuda.Event | None = None) -> None:
        """WRITING -> READY. ``event`` was recorded on the producer stream after the write."""
        if self.state is not LeaseState.WRITING:
            raise self._misuse("mark_ready on a lease that is not being written",
                               "Call mark_ready once, right after the gather that fills the slot.")
        self.ready_event = event
        self.state = LeaseState.READY

    def begin_read(self) -> torch.Tensor:
        """READY/READING -> READING; returns the slot. Readers must wait on ``ready_event``."""
        if self.state is LeaseState.WRITING:
            raise self._misuse("read before ready",
                               "Wait for the gather's ready event (mark_ready) before reading.")
        if self.state not in (LeaseState.READY, LeaseState.READING):
            raise self._misuse("read after retire",
                               "A retired or released lease may be overwritten; acquire a new one.")
        self.state = LeaseState.READING
        return self.tensor

    def retire(self, event: torch.cuda.Event | None = None) -> None:
        """READING -> RETIRING. ``event`` was recorded after the last read (None: same stream)."""
        if self.state is not LeaseState.READING:
            raise self._misuse("retire on a lease that is not being read",
                               "Retire once, after the last reader was issued.")
        self.retire_event = event
        self.state = LeaseState.RETIRING

    def release(self) -> None:
        """RETIRING -> FREE: the slot returns to the pool; its next writer waits on the retire event."""
        if self.state is LeaseState.FREE:
            raise self._misuse("double release", "Release each lease exactly once.")
        if self.state is LeaseState.WRITING:
            raise self._misuse("release while writing",
                               "The gather may still be writing the slot; mark it ready, read it "
                               "and retire it first.")
        if self.state is not LeaseState.RETIRING:
            raise self._misuse("release before retire",
                               "Retire the lease after its last read, then release it.")
        self.pool._give_back(self)


_DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}  # the slot dtypes profiles name


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def poison(slot: torch.Tensor) -> None:
    """Fill ``slot`` with bytes that read as NaN in every float format (255 in integer slots),
    so that a later read of it without a new gather shows (debug)."""
    slot.fill_(float("nan") if slot.dtype.is_floating_point else 255)


def _dtype(dtype: object) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigError(f"slot dtype: got {dtype!r}; accepted: a torch.dtype or one of "
                      f"{', '.join(_DTYPES)}")


def _shape(shape: object) -> tuple[int, ...]:
    dims = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ConfigError(f"slot shape: got {shape!r}; accepted: a non-empty sequence of "
                          f"integers >= 1")
    return dims


class SlotPool:
    """A lane's ring of ``depth + 1`` slots in one allocation, made once, here.

    Make it before the KV cache is sized so that the cache budget is honest. The depth is
    reduced to fit ``workspace_bytes`` (logged once, with the arithmetic). :meth:`acquire` never
    allocates: with no free slot it raises :class:`SlotPoolExhausted`.

    Args:
        lane: name of the lane that owns this pool.
        slot_shape: shape of one slot.
        dtype: element type.
        depth: requested prefetch lookahead (0 = synchronous, one slot).
        workspace_bytes: budget of the whole ring.
        device: where the slots live.
        storage: the ring itself, allocated by the caller (the DCP lane's ring lies in memory
            its peers map): exactly ``(slots, *slot_shape)`` of ``dtype`` on ``device``, where
            ``slots`` is what :meth:`fit` says. None: the pool allocates it, here.

    Raises:
        BudgetError: the budget holds not one slot.
        DeviceError: ``device`` is not one this torch can use (no CUDA, an unknown name).
        AllocationError: the ring cannot be allocated (the allocator's error is the cause).
    """

    def __init__(self, lane: str, slot_shape: Sequence[int], dtype: torch.dtype | str, *,
                 depth: int, workspace_bytes: int, device: torch.device | str = "cpu",
                 storage: torch.Tensor | None = None) -> None:
        self.dtype = _dtype(dtype)
        self.slot_shape = _shape(slot_shape)
        self.layout = self.fit(lane, self.slot_shape, self.dtype, depth, workspace_bytes)
        if self.layout.reduced:
            log.warning("%s", self.layout.arithmetic())
        # The one allocation of this lane: every slot is a view of it; nothing allocates later.
        shape = (self.layout.slots, *self.slot_shape)
        device = _device(device, lane)
        if storage is None:
            try:
                storage = torch.empty(shape, dtype=self.dtype, device=device)
            except (RuntimeError, MemoryError) as exc:  # out of memory, or past any device
                raise AllocationError(
                    f"lane '{lane}': the ring of {self.layout.slots} slot(s) x "
                    f"{self.layout.slot_bytes:,} B cannot be allocated on {device} "
                    f"({str(exc).splitlines()[0]}); give a smaller depth or budget") from exc
        elif (tuple(storage.shape), storage.dtype, storage.device.type) != \
                (shape, self.dtype, device.type):
            raise ConfigError(f"lane '{lane}': the storage given is {tuple(storage.shape)} "
                              f"{storage.dtype} on {storage.device}; the ring is {shape} "
                              f"{self.dtype} on {device} (SlotPool.fit says how many slots)")
        self.storage = storage
        self._leases: list[Lease | None] = [None] * self.layout.slots
        self._free: deque[int] = deque(range(self.layout.slots))
        self._closed = False
        #: leases filled for the next forward, by (lane, layer) (Note [Forward boundary])
        self.carried: dict[tuple[str, int], Lease] = {}

    @staticmethod
    def fit(lane: str, slot_shape: Sequence[int], dtype: torch.dtype | str, depth: int,
            workspace_bytes: int) -> PoolLayout:
        """The layout a pool of these arguments has, without allocating anything.

        Raises:
            ConfigError: a shape, dtype or slot size that cannot be a slot.
            BudgetError: the budget holds not one slot.
        """
        dtype, slot_shape = _dtype(dtype), _shape(slot_shape)
        slot_bytes = math.prod(slot_shape) * dtype.itemsize
        if slot_bytes > MAX_SLOT_BYTES:
            raise ConfigError(f"lane '{lane}': one slot of {slot_bytes:,} bytes exceeds the "
                              f"{MAX_SLOT_BYTES:,}-byte limit; give a smaller slot shape")
        return PoolLayout.fit(lane, slot_bytes, depth, workspace_bytes)

    @classmethod
    def for_profile(cls, profile, lane: str, device: torch.device | str = "cpu") -> SlotPool:
        """The pool of ``lane`` as ``profile`` describes it (same arithmetic as ``ringflow plan``).

        Raises:
            ProfileError: the profile has only vLLM sections (``offload``, ``kv_prefetch``): the
                plugin sizes those rings from the model it loads, so there is no slot to build.
            ConfigError: the profile has no such lane.
            DeviceError: the device is not one this torch can use (no CUDA, unknown name).
        """
        if not hasattr(profile, "require_run_fields"):  # a name or a path: say how to load it
            raise ConfigError(f"SlotPool.for_profile takes a Profile, not "
                              f"{type(profile).__name__} ({profile!r:.60}); load it first: "
                              f"ringflow.load_profile(...)")
        profile.require_run_fields()
        if lane not in profile.lanes:
            raise ConfigError(f"profile '{profile.name}' has no lane {lane!r}; its lanes: "
                              f"{', '.join(profile.lanes)}")
        return cls(lane, profile.slot.shape, profile.slot.dtype, depth=profile.depth,
                   workspace_bytes=profile.workspace_bytes, device=device)

    # -- what it reports ----------------------------------------------------------------------

    @property
    def lane(self) -> str:
        return self.layout.lane

    @property
    def depth(self) -> int:
        return self.layout.depth

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.layout.reserved_bytes

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def free_count(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        """Whether ``slot`` is leased by nobody (``acquire(slot)`` would take it)."""
        return self._leases[slot] is None

    def leases(self) -> list[Lease]:
        """Leases currently out (not FREE)."""
        return [x for x in self._leases if x is not None]

    # -- leasing ------------------------------------------------------------------------------

    def acquire(self, slot: int | None = None, *, tag: object = None) -> Lease:
        """Lease a slot for writing: ``slot`` if given, else the longest-free one.

        Raises:
            SlotPoolExhausted: the slot (or every slot) is leased; nothing is allocated.
            LeaseError: the pool is closed, or ``slot`` does not exist.
        """
        if self._closed:
            raise LeaseError(f"slot pool of lane '{self.lane}' is closed; build a new pool")
        if slot is None:
            if not self._free:
                raise self._exhausted("")
            slot = self._free.popleft()
        else:
            if not 0 <= slot < self.slots:
                raise LeaseError(f"lane '{self.lane}' has slots 0..{self.slots - 1}, not {slot}; "
                                 f"plan with this pool's layout")
            if self._leases[slot] is not None:
                raise self._exhausted(f"Slot {slot} is held by {self._leases[slot]!r}.")
            self._free.remove(slot)
        lease = Lease(self, slot, self.storage[slot], tag)
        self._leases[slot] = lease
        return lease

    def _exhausted(self, detail: str) -> SlotPoolExhausted:
        return SlotPoolExhausted(self.lane, self.depth, self.slots, self.layout.budget_bytes, detail)

    def _give_back(self, lease: Lease) -> None:
        if self._leases[lease.slot] is not lease:
            raise LeaseError(f"{lease!r} does not hold slot {lease.slot} any more (double release)")
        self._free_slot(lease)

    def _free_slot(self, lease: Lease) -> None:
        lease.state = LeaseState.FREE
        self._leases[lease.slot] = None
        self._free.append(lease.slot)

    # -- teardown (may host-sync) -------------------------------------------------------------

    def _wait_idle(self) -> None:
        # Teardown only: a lease still WRITING has no event yet, so wait for the whole device.
        if self.storage.is_cuda:
            torch.cuda.synchronize(self.storage.device)

    def reclaim(self, *, sync: bool = True) -> int:
        """Return every outstanding lease to the pool after a fault; returns how many.

        Waits for the device first (``sync=False`` only where the work can never run, such as a
        capture that was abandoned), so no slot goes back while its writer or reader may run.
        """
        out = self.leases()
        if out and sync:
            self._wait_idle()
        for lease in out:
            self._free_slot(lease)
        self.carried.clear()  # the next forward fills its slots again (it primes)
        return len(out)

    def forget_carried(self) -> None:
        """Hand back the slots of carried leases without waiting (host bookkeeping only).

        For a forward that re-fills them itself: its gathers are ordered after everything the
        previous forward issued (it joined its gather stream), so the slots are free on the
        device by the time they are rewritten.
        """
        for lease in self.carried.values():
            self._free_slot(lease)
        self.carried.clear()

    def close(self) -> None:
        """Wait for every writer and reader, then drop the storage. Idempotent."""
        if self._closed:
            return
        self._wait_idle()
        self.reclaim(sync=False)
        self._closed = True
        self.storage = self.storage.new_empty(0)

    def __enter__(self) -> SlotPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SlotPool(lane={self.lane!r}, slots={self.slots}, depth={self.depth}, "
                f"slot_bytes={self.slot_bytes}, reserved_bytes={self.reserved_bytes}, "
                f"free={self.free_count})")


def _device(device: torch.device | str, lane: str) -> torch.device:
    """``device`` as a torch device this process can allocate on."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"lane '{lane}': {device!r} is not a device torch knows; give 'cpu' or "
                          f"'cuda' (or 'cuda:N')") from exc
    if found.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"lane '{lane}': the ring asks for {device!r}, and this torch has no "
                          f"CUDA device; give 'cpu' (the executors run synchronously there)")
    return found
