"""One hand-mutated Dag per hazard kind: the check names the kind and the offending nodes."""

import dataclasses

import pytest

from ringflow import Dag, HazardError, NodeKind, Planner, check_hazards
from ringflow.orchestrator.budget import PoolLayout
from ringflow.orchestrator.dag import COMPUTE_STREAM, EventRole, Node


def plan(layers=6, depth=1, lanes=("kv",), **kw):
    return Planner(layers, [PoolLayout.fit(l, 1000, depth, 10_000) for l in lanes], **kw).plan()


def rebuild(dag, nodes, pools=None):
    """A Dag with ``nodes`` (renumbered in the given order) and optionally other pools."""
    nodes = [dataclasses.replace(n, id=i) for i, n in enumerate(nodes)]
    return Dag(dag.name, dag.layers, tuple(pools or dag.pools), tuple(nodes))


def find(dag, kind, role=None, layer=None, stream=None):
    return next(n for n in dag.nodes if n.kind is kind and (role is None or n.role is role)
                and (layer is None or n.layer == layer) and (stream is None or n.stream == stream))


def without(dag, node):
    return rebuild(dag, [n for n in dag.nodes if n.id != node.id])


def changed(dag, node, **fields):
    """The Dag with ``node``'s ``fields`` changed, every other node as it was."""
    return rebuild(dag, [dataclasses.replace(n, **fields) if n.id == node.id else n
                         for n in dag.nodes])


def test_a_valid_plan_passes_and_comes_back_proven():
    dag = plan()
    assert dag.proven  # plan() proves every plan before anyone can run it
    fresh = dataclasses.replace(dag)
    proved = check_hazards(fresh)
    assert proved.proven and not fresh.proven and proved == fresh
    assert check_hazards(proved) is proved  # a proven Dag is not checked again


def test_a_wait_whose_event_was_never_recorded_is_caught():
    dag = plan()
    wait = find(dag, NodeKind.WAIT, EventRole.READY, layer=2)
    bad = changed(dag, wait, event="kv/ready/L99")
    with pytest.raises(HazardError, match="wait-without-record") as info:
        check_hazards(bad)
    assert info.value.nodes == (wait.id,)


def test_a_wait_issued_before_its_record_is_caught():
    dag = plan()
    wait = find(dag, NodeKind.WAIT, EventRole.READY, layer=0)
    nodes = [n for n in dag.nodes if n.id != wait.id]
    nodes.insert(0, wait)  # waits before the gather recorded ready: orders nothing
    with pytest.raises(HazardError, match="wait-without-record"):
        check_hazards(rebuild(dag, nodes))


def test_a_compute_that_does_not_wait_for_its_gather_is_read_after_write():
    dag = plan()
    wait = find(dag, NodeKind.WAIT, EventRole.READY, layer=3)
    with pytest.raises(HazardError, match="read-after-write") as info:
        check_hazards(without(dag, wait))
    gather = find(dag, NodeKind.GATHER, layer=3)
    assert gather.id in info.value.nodes


def test_a_compute_reading_another_slot_than_was_written_is_read_after_write():
    dag = plan()
    compute = find(dag, NodeKind.COMPUTE, layer=2)
    bad = changed(dag, compute, slot=1)
    with pytest.raises(HazardError, match="read-after-write"):
        check_hazards(bad)


def test_a_gather_that_does_not_wait_for_the_previous_reader_is_write_after_read():
    dag = plan()
    wait = find(dag, NodeKind.WAIT, EventRole.RETIRE, layer=4)  # gather L4 waits retire L2
    with pytest.raises(HazardError, match="write-after-read") as info:
        check_hazards(without(dag, wait))
    assert find(dag, NodeKind.COMPUTE, layer=2).id in info.value.nodes


def test_a_sync_gather_not_ordered_after_a_side_stream_reader_is_write_after_read():
    # The hand-written ring's bug: the fallback gather into a slot another stream still reads.
    dag = plan(layers=6, ineligible=[4])  # slot 0 holds layers 0, 2, then 4 (synchronous)
    reader = "reader/kv"
    ready2 = find(dag, NodeKind.WAIT, EventRole.READY, layer=2)
    compute2 = find(dag, NodeKind.COMPUTE, layer=2)
    # Layer 2 is read on a side stream, after its gather; that stream records when the read is
    # done, and the compute stream waits for the record: only the wait's position varies.
    done = Node(0, NodeKind.RECORD, reader, "kv", layer=2, slot=0, event="kv/retire/L2",
                role=EventRole.RETIRE)
    join = dataclasses.replace(done, kind=NodeKind.WAIT, stream=COMPUTE_STREAM)

    def wait_before(node):
        nodes = []
        for n in dag.nodes:
            if n.id == node.id:
                nodes.append(join)
            moved = n.id in (ready2.id, compute2.id)
            nodes.append(dataclasses.replace(n, stream=reader) if moved else n)
            if n.id == compute2.id:
                nodes.append(done)
        return rebuild(dag, nodes)

    bad = wait_before(find(dag, NodeKind.WAIT, EventRole.JOIN))  # too late: after the gather
    with pytest.raises(HazardError) as info:
        check_hazards(bad)
    assert info.value.kind == "write-after-read"
    assert info.value.nodes == (find(bad, NodeKind.COMPUTE, layer=2).id,
                                find(bad, NodeKind.SYNC_GATHER, layer=4).id)
    good = wait_before(find(dag, NodeKind.SYNC_GATHER, layer=4))
    assert check_hazards(good).proven  # that ordering was the plan's only hazard


def test_a_release_issued_before_the_read_is_a_lease_overlap():
    dag = plan()
    release = find(dag, NodeKind.RELEASE, layer=1)
    compute = find(dag, NodeKind.COMPUTE, layer=1)
    nodes = [n for n in dag.nodes if n.id != release.id]
    nodes.insert(nodes.index(compute), release)  # hands the slot back while it is still read
    with pytest.raises(HazardError, match="lease-overlap"):
        check_hazards(rebuild(dag, nodes))


def test_a_lease_never_released_is_a_lease_overlap():
    dag = plan()
    with pytest.raises(HazardError, match="lease-overlap.*released 0 times"):
        check_hazards(without(dag, find(dag, NodeKind.RELEASE, layer=5)))


def test_a_slot_leased_again_before_release_is_a_lease_overlap():
    dag = plan(depth=1)
    # slot 0: L0 then L2. Issue L2's gather (and its wait) before L0's release.
    release0 = find(dag, NodeKind.RELEASE, layer=0)
    moved = [n for n in dag.nodes if n.stream == "gather/kv" and n.layer == 2]
    nodes = [n for n in dag.nodes if n not in moved]
    at = nodes.index(release0)
    nodes[at:at] = moved
    bad = rebuild(dag, nodes)
    with pytest.raises(HazardError) as info:
        check_hazards(bad)
    assert info.value.kind == "lease-overlap"
    assert info.value.nodes == (find(bad, NodeKind.RELEASE, layer=0).id,
                                find(bad, NodeKind.GATHER, layer=2).id)


def test_two_lanes_sharing_a_pool_are_a_lease_overlap():
    dag = plan(lanes=("a", "b"))
    a, b = dag.pools
    shared = [a, dataclasses.replace(b, pool=a.pool)]
    with pytest.raises(HazardError, match="lease-overlap.*share pool"):
        check_hazards(rebuild(dag, dag.nodes, shared))


def test_a_slot_index_outside_its_pool_is_a_lease_overlap():
    dag = plan(depth=1)
    gather = find(dag, NodeKind.GATHER, layer=0)
    bad = changed(dag, gather, slot=5)
    with pytest.raises(HazardError, match="lease-overlap.*slot 5"):
        check_hazards(bad)


def test_side_stream_work_not_joined_before_the_end_is_unjoined():
    dag = plan()
    join_wait = find(dag, NodeKind.WAIT, EventRole.JOIN)
    with pytest.raises(HazardError, match="unjoined") as info:
        check_hazards(without(dag, join_wait))
    assert find(dag, NodeKind.RECORD, EventRole.JOIN).id in info.value.nodes


def test_a_gather_stream_that_does_not_fork_from_the_forward_is_isolated():
    dag = plan()
    fork_wait = find(dag, NodeKind.WAIT, EventRole.FORK)
    with pytest.raises(HazardError, match="isolated"):
        check_hazards(without(dag, fork_wait))


def test_hazard_errors_carry_the_kind_and_node_ids():
    dag = plan()
    try:
        check_hazards(without(dag, find(dag, NodeKind.WAIT, EventRole.JOIN)))
    except HazardError as exc:
        assert exc.kind == "unjoined" and exc.nodes and "nodes" in str(exc)
    else:
        pytest.fail("expected a HazardError")


def test_compute_stream_is_the_first_and_last_stream():
    dag = plan()
    assert dag.nodes[0].stream == COMPUTE_STREAM and dag.nodes[-1].stream == COMPUTE_STREAM


@pytest.mark.parametrize("broken", ["no nodes", "a layer never computed", "a layer twice",
                                    "layers out of order"])
def test_a_plan_that_is_no_forward_of_the_model_is_incomplete(broken):
    """Every lane computes every layer once, in order: otherwise the plan is refused, even
    when every ordering it does have is safe."""
    dag = plan(lanes=("a", "b"))
    computes = [n for n in dag.nodes if n.kind is NodeKind.COMPUTE and n.lane == "b"]
    if broken == "no nodes":
        bad = rebuild(dag, [])
    elif broken == "a layer never computed":
        bad = without(dag, computes[3])
    elif broken == "a layer twice":
        bad = changed(dag, computes[3], layer=2)
    else:
        bad = rebuild(dag, [computes[4] if n.id == computes[3].id else
                            computes[3] if n.id == computes[4].id else n for n in dag.nodes])
    needle = ("incomplete: plan 'plan' has no nodes; it computes none of its 6 layers$"
              if broken == "no nodes" else
              "incomplete: lane '(a|b)' must compute layers 0..5 once each")
    with pytest.raises(HazardError, match=needle):
        check_hazards(bad)


def test_check_hazards_of_something_that_is_not_a_dag_says_what_it_takes():
    from ringflow import ConfigError

    with pytest.raises(ConfigError, match="check_hazards proves a Dag .*not str"):
        check_hazards("not a dag")
