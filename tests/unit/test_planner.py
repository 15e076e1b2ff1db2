"""The Planner: shapes of plans over depths, layer counts, lanes and layer sets."""

import dataclasses

import pytest

from ringflow import NodeKind, Planner, PlanError, check_hazards
from ringflow.orchestrator.budget import PoolLayout
from ringflow.orchestrator.dag import COMPUTE_STREAM, EventRole


def layouts(depth, lanes=("kv",), slot_bytes=1000):
    return [PoolLayout.fit(lane, slot_bytes, depth, slot_bytes * 64) for lane in lanes]


def kinds(dag, kind, lane=None):
    return [n for n in dag.nodes if n.kind is kind and (lane is None or n.lane == lane)]


@pytest.mark.parametrize("synchronous", [False, True], ids=["prefetch", "synchronous"])
@pytest.mark.parametrize("layers", [1, 2, 7, 61])
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_every_layer_is_gathered_once_and_computed_once_at_every_depth(layers, depth,
                                                                       synchronous):
    dag = Planner(layers, layouts(depth), synchronous=synchronous).plan()
    # plan() proved the Dag and check_hazards trusts a proven Dag: a copy starts unproven
    assert check_hazards(dataclasses.replace(dag)).proven
    writers = kinds(dag, NodeKind.GATHER) + kinds(dag, NodeKind.SYNC_GATHER)
    assert sorted(n.layer for n in writers) == list(range(layers))
    assert [n.layer for n in kinds(dag, NodeKind.COMPUTE)] == list(range(layers))
    assert len(kinds(dag, NodeKind.RELEASE)) == layers
    if synchronous:  # every gather on the compute stream, whatever the ring size
        assert not kinds(dag, NodeKind.GATHER) and dag.streams == (COMPUTE_STREAM,)
    else:  # a ring of one slot prefetches too
        assert not kinds(dag, NodeKind.SYNC_GATHER)
        slots = depth + 1
        assert [n.slot for n in kinds(dag, NodeKind.GATHER)] == [i % slots for i in range(layers)]


@pytest.mark.parametrize("layers", [7, 61])
def test_a_layer_count_not_divisible_by_the_ring_reuses_slots_strictly_in_rotation(layers):
    dag = Planner(layers, layouts(2)).plan()  # ring of 3
    gathers = kinds(dag, NodeKind.GATHER)
    for g in gathers[3:]:
        waits = [n for n in dag.nodes if n.kind is NodeKind.WAIT and n.stream == g.stream
                 and n.id == g.id - 1]
        assert waits and waits[0].event == f"kv/retire/L{g.layer - 3}"


def test_first_ring_full_is_issued_at_the_start_of_the_forward():
    dag = Planner(8, layouts(2)).plan()
    first_compute = kinds(dag, NodeKind.COMPUTE)[0].id
    early = [g.layer for g in kinds(dag, NodeKind.GATHER) if g.id < first_compute]
    assert early == [0, 1, 2]


def test_a_gather_follows_the_release_of_its_slot_not_a_fixed_lookahead():
    # weights streaming: the last 2 of every 8 layers offloaded, a ring of 2 slots
    gathered = [l for l in range(32) if l % 8 >= 6]
    dag = Planner(32, layouts(1), gathered=gathered).plan()
    gathers = {g.layer: g for g in kinds(dag, NodeKind.GATHER)}
    releases = {r.layer: r for r in kinds(dag, NodeKind.RELEASE)}
    computes = {c.layer: c for c in kinds(dag, NodeKind.COMPUTE)}
    assert sorted(gathers) == gathered
    assert gathers[6].id < computes[0].id and gathers[7].id < computes[0].id
    for layer, prev in [(14, 6), (15, 7), (22, 14), (23, 15), (30, 22), (31, 23)]:
        # issued right after the release of the slot's previous lease: while layers
        # prev+2 .. layer-1 (mostly resident) compute
        between = [n for n in dag.nodes if releases[prev].id < n.id < gathers[layer].id]
        assert all(n.stream != COMPUTE_STREAM or n.kind is not NodeKind.COMPUTE for n in between)
        assert gathers[layer].id < computes[prev + 1].id


def test_resident_layers_compute_without_a_slot():
    dag = Planner(8, layouts(1), gathered=[2, 5]).plan()
    resident = [c for c in kinds(dag, NodeKind.COMPUTE) if c.slot is None]
    assert [c.layer for c in resident] == [0, 1, 3, 4, 6, 7]


def test_ineligible_layers_gather_synchronously_in_their_turn_of_the_rotation():
    dag = Planner(8, layouts(1), ineligible=[3, 4]).plan()
    sync = kinds(dag, NodeKind.SYNC_GATHER)
    assert [(n.layer, n.slot, n.stream) for n in sync] == [(3, 1, COMPUTE_STREAM),
                                                           (4, 0, COMPUTE_STREAM)]
    # the synchronous gather comes after the previous reader of its slot...
    compute1 = next(c for c in kinds(dag, NodeKind.COMPUTE) if c.layer == 1)
    assert dag.happens_before(compute1.id, sync[0].id)
    # ...and the next prefetch into that slot waits for the synchronous lease's retire
    gather5 = next(g for g in kinds(dag, NodeKind.GATHER) if g.layer == 5)
    compute3 = next(c for c in kinds(dag, NodeKind.COMPUTE) if c.layer == 3)
    assert dag.happens_before(compute3.id, gather5.id)


def test_retire_is_recorded_only_when_the_next_writer_is_on_another_stream():
    dag = Planner(6, layouts(1), ineligible=[2, 3]).plan()
    retired = sorted(n.layer for n in dag.nodes if n.role is EventRole.RETIRE
                     and n.kind is NodeKind.RECORD)
    # leases: 0 s0, 1 s1, 2 s0 (sync), 3 s1 (sync), 4 s0, 5 s1
    assert retired == [2, 3]


def test_each_lane_has_its_own_gather_stream_pool_fork_and_join():
    dag = Planner(5, layouts(1, lanes=("a", "b"))).plan()
    assert set(dag.streams) == {COMPUTE_STREAM, "gather/a", "gather/b"}
    for lane in ("a", "b"):
        roles = [n.role for n in dag.nodes if n.lane == lane and n.role in (EventRole.FORK,
                                                                             EventRole.JOIN)]
        assert roles == [EventRole.FORK, EventRole.FORK, EventRole.JOIN, EventRole.JOIN]
    per_layer = [(c.layer, c.lane) for c in kinds(dag, NodeKind.COMPUTE)]
    assert per_layer == [(l, lane) for l in range(5) for lane in ("a", "b")]


def test_lanes_may_have_different_depths():
    pools = [PoolLayout.fit("a", 100, 3, 400), PoolLayout.fit("b", 100, 3, 150)]
    dag = Planner(6, pools).plan()
    assert max(n.slot for n in kinds(dag, NodeKind.GATHER, "a")) == 3
    # lane b's budget holds one slot: depth 0, still prefetched on its own stream, each gather
    # waiting for the previous layer's compute (the slot's previous reader)
    assert not kinds(dag, NodeKind.SYNC_GATHER)
    assert {n.slot for n in kinds(dag, NodeKind.GATHER, "b")} == {0}
    retires = [n.event for n in dag.nodes if n.lane == "b" and n.kind is NodeKind.WAIT
               and n.role is EventRole.RETIRE]
    assert retires == [f"b/retire/L{l}" for l in range(5)]


def test_a_one_slot_ring_gathers_behind_the_resident_layers_before_it():
    """Ring size is memory, not lookahead: with one slot, the gather of an offloaded layer
    starts when the previous offloaded layer's compute is done, before the resident layers
    between them."""
    gathered = [l for l in range(16) if l % 8 >= 6]  # 6, 7, 14, 15
    dag = Planner(16, layouts(0), gathered=gathered).plan()
    computes = {c.layer: c.id for c in kinds(dag, NodeKind.COMPUTE)}
    gathers = {g.layer: g.id for g in kinds(dag, NodeKind.GATHER)}
    assert gathers[6] < computes[0]                        # at the forward's start
    assert computes[7] < gathers[14] < computes[8]         # right after its slot's last reader
    assert not kinds(dag, NodeKind.SYNC_GATHER)


@pytest.mark.parametrize("bad", [dict(layers=0), dict(layers=True), dict(gathered=[9]),
                                 dict(ineligible=[-1]), dict(ineligible=["3"])])
def test_bad_requests_are_plan_errors(bad):
    layers = bad.pop("layers", 4)
    with pytest.raises(PlanError):
        Planner(layers, layouts(1), **bad).plan()


def test_a_plan_needs_a_lane():
    with pytest.raises(PlanError, match="at least one lane"):
        Planner(3, [])


def test_node_ids_are_stable_across_plans():
    a = Planner(9, layouts(2), ineligible=[4]).plan()
    b = Planner(9, layouts(2), ineligible=[4]).plan()
    assert a == b and [n.nvtx_name for n in a.nodes] == [n.nvtx_name for n in b.nodes]
    assert a.nodes[2].nvtx_name == "ringflow/kv/gather/L0"


@pytest.mark.parametrize("pools,gathered,needle", [
    ([None], None, "pools must be PoolLayouts"),
    (["kv"], None, "pools must be PoolLayouts"),
    ("layout", 5, "gathered must be a collection of layer indices"),
    ("layout", "01", "gathered must be a collection of layer indices"),
])
def test_a_planner_given_the_wrong_things_says_what_it_takes(pools, gathered, needle):
    from ringflow import PlanError
    from ringflow.orchestrator.budget import PoolLayout

    if pools == "layout":
        pools = [PoolLayout.fit("kv", 1000, 1, 10_000)]
    with pytest.raises(PlanError, match=needle):
        Planner(8, pools, gathered=gathered)
