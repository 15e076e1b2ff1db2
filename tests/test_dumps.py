"""JSON, DOT and text dumps of a Dag."""

import json

import pytest

from ringflow import Planner, PlanError, from_json, to_dot, to_json, to_text
from ringflow.orchestrator import dumps
from ringflow.orchestrator.budget import PoolLayout


def plan():
    pools = [PoolLayout.fit(l, 4096, 2, 20_000) for l in ("a", "b")]
    return Planner(7, pools, ineligible=[3], gathered=[0, 1, 2, 3, 5, 6]).plan()


def cross_plan():
    pools = [PoolLayout.fit("w", 4096, 1, 20_000)]
    return Planner(8, pools, gathered=[0, 1, 2, 5, 6], cross_forward=["w"]).plan()


@pytest.mark.parametrize("make", [plan, cross_plan], ids=["plain", "cross-forward"])
def test_json_round_trips_exactly(make):
    dag = make()
    again = from_json(to_json(dag))
    assert again == dag and again.edges == dag.edges and again.meta == dag.meta
    assert again.prime == dag.prime and again.carried == dag.carried


def test_json_has_a_versioned_stable_schema():
    doc = json.loads(to_json(plan()))
    assert (doc["schema"], doc["version"]) == ("ringflow.dag", 2)
    assert set(doc["nodes"][0]) == {"id", "kind", "stream", "lane", "layer", "slot", "event",
                                    "role", "forward", "nvtx"}
    assert doc["pools"][0]["reserved_bytes"] == 3 * 4096
    assert to_json(plan()) == to_json(plan())  # stable bytes


def test_a_version_1_dump_still_loads():
    doc = json.loads(to_json(plan()))
    doc["version"] = 1
    del doc["prime"]
    for node in doc["nodes"]:
        del node["forward"]
    assert dumps.from_dict(doc) == plan()


def test_text_names_the_carried_leases_and_marks_the_tail_gathers():
    text = to_text(cross_plan())
    assert "carried into every forward, filled by the previous one's tail: w L0 (slot 0)" in text
    assert "0@F+1" in text


def test_json_from_another_version_or_edited_edges_is_refused():
    doc = json.loads(to_json(plan()))
    with pytest.raises(PlanError, match="version 3 is not supported"):
        dumps.from_dict({**doc, "version": 3})
    doc["edges"] = doc["edges"][1:]
    with pytest.raises(PlanError, match="edges disagree"):
        dumps.from_dict(doc)
    with pytest.raises(PlanError, match="not JSON"):
        from_json("{")


def test_dot_has_one_cluster_per_stream_and_dashed_event_edges():
    dag = plan()
    dot = to_dot(dag)
    assert dot.count("subgraph cluster_") == len(dag.streams) == 3
    events = sum(1 for e in dag.edges if e.kind == "event")
    assert dot.count("style=dashed") == events > 0
    assert dot.count(" -> ") == len(dag.edges)


def test_text_lists_every_node_and_the_budget_arithmetic():
    dag = plan()
    text = to_text(dag, kv_token_bytes=64)
    assert "lane 'a': slot 4,096 B; depth 2 wants 3 slot(s)" in text
    assert "total reserved: 24,576 B" in text
    assert "KV cost: 24,576 B / (64 B/token/layer x 7 layers) = 54 KV tokens" in text
    rows = [l for l in text.splitlines() if l[:5].strip().isdigit()]
    assert len(rows) == len(dag.nodes)
