"""Lease transitions, misuse, and the pool's budget arithmetic."""

import logging

import pytest
import torch

from ringflow import Lease, LeaseError, LeaseState, SlotPool, SlotPoolExhausted
from ringflow.errors import BudgetError, ConfigError
from ringflow.orchestrator.budget import PoolLayout
from ringflow.units import MIB


def pool(depth=1, budget=MIB, shape=(64, 32)):
    return SlotPool("kv", shape, torch.float32, depth=depth, workspace_bytes=budget)


def test_a_lease_walks_free_writing_ready_reading_retiring_free():
    p = pool()
    lease = p.acquire()
    assert isinstance(lease, Lease) and lease.state is LeaseState.WRITING
    assert p.free_count == 1
    lease.mark_ready()
    assert lease.state is LeaseState.READY
    slot = lease.begin_read()
    assert lease.state is LeaseState.READING and slot.data_ptr() == p.storage[lease.slot].data_ptr()
    lease.retire()
    assert lease.state is LeaseState.RETIRING
    lease.release()
    assert lease.state is LeaseState.FREE and p.free_count == 2


def test_a_released_lease_cannot_read_or_release_its_slot_once_it_is_leased_again():
    p = pool(depth=0)  # one slot: the next lease gets the same slot
    old = p.acquire()
    old.mark_ready(), old.begin_read(), old.retire(), old.release()
    new = p.acquire()
    assert new is not old and new.slot == old.slot and new.state is LeaseState.WRITING
    with pytest.raises(LeaseError, match="read after retire"):
        old.begin_read()  # would read the next writer's half-written data
    with pytest.raises(LeaseError, match="double release"):
        old.release()  # would hand the new lease's slot to a third writer
    assert p.leases() == [new] and p.free_count == 0 and new.state is LeaseState.WRITING


def test_read_before_ready_is_a_lease_error():
    lease = pool().acquire()
    with pytest.raises(LeaseError, match="read before ready"):
        lease.begin_read()


def test_release_while_writing_is_a_lease_error():
    p = pool()
    lease = p.acquire()
    with pytest.raises(LeaseError, match="release while writing"):
        lease.release()
    assert p.free_count == 1  # the slot was not handed back


def test_double_release_is_a_lease_error():
    lease = pool().acquire()
    lease.mark_ready()
    lease.begin_read()
    lease.retire()
    lease.release()
    with pytest.raises(LeaseError, match="double release"):
        lease.release()


def test_release_before_retire_and_read_after_retire_are_lease_errors():
    lease = pool().acquire()
    lease.mark_ready()
    with pytest.raises(LeaseError, match="release before retire"):
        lease.release()
    lease.begin_read()
    lease.retire()
    with pytest.raises(LeaseError, match="read after retire"):
        lease.begin_read()
    with pytest.raises(LeaseError):
        lease.mark_ready()


def test_depth_is_reduced_to_fit_the_budget_and_logged_once_with_the_arithmetic(caplog):
    slot_bytes = 64 * 32 * 4
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        p = pool(depth=5, budget=3 * slot_bytes + 100)
    assert (p.depth, p.slots, p.slot_bytes) == (2, 3, slot_bytes)
    assert p.reserved_bytes == 3 * slot_bytes
    assert p.storage.numel() * 4 == p.reserved_bytes  # one allocation, exactly the ring
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "depth reduced to 2" in lines[0] and "depth 5 wants 6" in lines[0]


def test_depth_zero_is_one_slot_and_the_arithmetic_says_what_it_overlaps():
    p = pool(depth=0)
    assert (p.depth, p.slots) == (0, 1)
    assert "one slot: gathers overlap only layers that gather nothing" in p.layout.arithmetic()


def test_a_budget_smaller_than_one_slot_is_a_budget_error_with_the_numbers():
    """The pool never saw a profile: it names the lane and the bytes, not a profile field."""
    with pytest.raises(BudgetError, match=r"lane 'kv': a budget of 0\.000 MiB is smaller than "
                                          r"one slot") as info:
        pool(budget=100)
    assert (info.value.budget_bytes, info.value.lane) == (100, "kv")
    assert info.value.slot_bytes > 100 and "workspace_mib" not in str(info.value)


def test_exhaustion_raises_naming_lane_depth_and_budget_and_never_allocates():
    p = pool(depth=1)
    storage = p.storage.data_ptr()
    p.acquire(), p.acquire()
    with pytest.raises(SlotPoolExhausted) as info:
        p.acquire()
    msg = str(info.value)
    assert "'kv'" in msg and "depth 1" in msg and f"budget {MIB} bytes" in msg
    assert p.storage.data_ptr() == storage and p.free_count == 0


def test_acquiring_a_held_slot_is_exhaustion_and_a_missing_slot_is_a_lease_error():
    p = pool(depth=1)
    p.acquire(1)
    with pytest.raises(SlotPoolExhausted, match="Slot 1 is held"):
        p.acquire(1)
    with pytest.raises(LeaseError, match="slots 0..1"):
        p.acquire(7)
    assert p.acquire().slot == 0


def test_slots_come_back_in_ring_order():
    p = pool(depth=2)
    order = []
    for _ in range(7):
        lease = p.acquire()
        order.append(lease.slot)
        lease.mark_ready(), lease.begin_read(), lease.retire(), lease.release()
    assert order == [0, 1, 2, 0, 1, 2, 0]


def test_reclaim_returns_every_outstanding_lease_and_close_refuses_new_ones():
    p = pool(depth=2)
    a, b = p.acquire(), p.acquire()
    a.mark_ready()
    assert p.reclaim() == 2 and p.free_count == 3
    assert a.state is LeaseState.FREE and b.state is LeaseState.FREE
    p.close()
    p.close()  # idempotent
    with pytest.raises(LeaseError, match="closed"):
        p.acquire()


def test_layout_fit_matches_the_pool_and_reports_slot_ranges():
    layout = PoolLayout.fit("kv", 1000, 3, 2500)
    assert (layout.slots, layout.depth, layout.reserved_bytes, layout.reduced) == (2, 1, 2000, True)
    ranges = layout.slot_ranges()
    assert [(r.offset, r.end) for r in ranges] == [(0, 1000), (1000, 2000)]
    assert {r.pool for r in ranges} == {"pool/kv"}



def test_a_pool_on_a_device_this_torch_cannot_use_says_so(monkeypatch):
    from ringflow import DeviceError, Profile
    profile = Profile.load("demo")
    with pytest.raises(DeviceError, match="'tpu' is not a device torch knows"):
        SlotPool.for_profile(profile, "kv", "tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="this torch has no CUDA device"):
        SlotPool.for_profile(profile, "kv", "cuda")
    with pytest.raises(ConfigError, match="has no lane 'weights'; its lanes: kv"):
        SlotPool.for_profile(profile, "weights", "cpu")
