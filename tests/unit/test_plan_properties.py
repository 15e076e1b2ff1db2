"""Property: every plan over random layers, depths, lanes and layer sets passes the hazard check
and, run by the SyncExecutor, makes every read see the write the plan intends."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringflow import Planner, SlotPool, SyncExecutor, check_hazards
from ringflow.testing.tracing import TracingWorkload


@st.composite
def requests(draw):
    layers = draw(st.integers(1, 40))
    lanes = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    depths = [draw(st.integers(0, 4)) for _ in lanes]
    gathered = draw(st.one_of(st.none(), st.sets(st.integers(0, layers - 1))))
    pool = set(range(layers)) if gathered is None else gathered
    ineligible = draw(st.sets(st.sampled_from(sorted(pool)))) if pool else set()
    return layers, lanes, depths, gathered, ineligible


@settings(max_examples=150, deadline=None)
@given(requests())
def test_every_plan_is_safe_and_computes_the_reference(request):
    layers, lanes, depths, gathered, ineligible = request
    pools = [SlotPool(lane, (3,), torch.float32, depth=d, workspace_bytes=12 * (d + 1))
             for lane, d in zip(lanes, depths)]
    dag = Planner(layers, [p.layout for p in pools], gathered=gathered,
                  ineligible=ineligible).plan()
    # plan() proved the Dag and check_hazards trusts a proven Dag: a copy starts unproven
    assert check_hazards(dataclasses.replace(dag)).proven
    trace = TracingWorkload(lanes, layers, (3,), gathered=gathered)
    ex = SyncExecutor(dag, pools, trace.gather, trace.compute)
    for _ in range(2):
        trace.new_forward()
        ex.run()
        trace.check()
    assert all(p.free_count == p.slots for p in pools)
