"""JSON, DOT and text dumps of a Dag."""

import json
import re
import shutil
import subprocess
import time

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


def _drawn(dot: str) -> list[str]:
    """The DOT node statements (plan nodes ``nN`` and summary nodes ``sN``)."""
    return re.findall(r"^\s+([ns]\d+) \[label=\"([^\"]*)\"", dot, flags=re.M)


def mla_plan():
    from ringflow import load_profile

    return Planner.from_profile(load_profile("mla_ckv_dcp")).plan()


def test_dot_of_a_61_layer_plan_is_condensed_and_accounts_for_every_node():
    dag = mla_plan()
    dot = to_dot(dag)
    drawn = _drawn(dot)
    assert len(dag.nodes) == 854 and len(drawn) < 150
    summaries = [label for name, label in drawn if name.startswith("s")]
    inside = sum(int(re.search(r": (\d+) nodes", label).group(1)) for label in summaries)
    assert len(summaries) == len(dag.streams) and inside + len(drawn) - len(summaries) == 854
    assert summaries[0].startswith("L2..L58 (ubatch0, ubatch1): 456 nodes")
    assert dot.count("subgraph cluster_") == len(dag.streams)
    assert "--full draws every node" in dot


def test_full_dot_draws_every_node_and_edge():
    dag = mla_plan()
    dot = to_dot(dag, full=True)
    assert len(_drawn(dot)) == len(dag.nodes) and dot.count(" -> ") == len(dag.edges)


def test_small_plans_are_drawn_in_full_by_default():
    dag = plan()
    assert dag.layers <= dumps.DOT_FULL_MAX_LAYERS and to_dot(dag) == to_dot(dag, full=True)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz (`dot`) is not installed")
def test_graphviz_renders_the_default_dot_of_a_61_layer_plan_in_seconds(tmp_path):
    path = tmp_path / "plan.dot"
    path.write_text(to_dot(mla_plan()))
    start = time.perf_counter()
    subprocess.run(["dot", "-Tsvg", str(path), "-o", str(tmp_path / "plan.svg")], check=True,
                   timeout=60)
    assert time.perf_counter() - start < 20


def test_compute_nodes_name_their_lane_when_a_plan_has_two_lanes():
    two = to_dot(plan())  # lanes a and b share the compute stream
    computes = [label for _, label in _drawn(two) if " compute " in label]
    assert computes and all(label.endswith((" (a)", " (b)")) for label in computes)
    one = to_dot(cross_plan())  # one lane: nothing to tell apart
    assert not any(label.endswith(" (w)") for _, label in _drawn(one))


def test_ringflow_dump_to_a_directory_writes_named_files_inside_it(tmp_path):
    """#38: ``RINGFLOW_DUMP=/some/dir/`` used to write the hidden ``dir/.json``."""
    from ringflow.orchestrator.dumps import dump_stem, write_files
    assert dump_stem(f"{tmp_path}/") == str(tmp_path / "ringflow-plan")
    assert dump_stem(str(tmp_path)) == str(tmp_path / "ringflow-plan")  # it exists
    assert dump_stem(str(tmp_path / "plan.json")) == str(tmp_path / "plan")
    assert dump_stem(str(tmp_path / "plan")) == str(tmp_path / "plan")
    dag = Planner(4, [PoolLayout.fit("w", 64, 1, 1 << 10)], gathered=[1, 3]).plan()
    js, dot = write_files(dag, dump_stem(f"{tmp_path}/"), executor="sync: one stream")
    assert js.name == "ringflow-plan.json" and dot.name == "ringflow-plan.dot"
    assert json.loads(js.read_text())["executor"] == "sync: one stream"
    assert 'label="ran by: sync: one stream"' in dot.read_text()
    assert "executor" not in json.loads(write_files(dag, str(tmp_path / "plain"))[0].read_text())


def test_each_rank_dumps_to_its_own_files(tmp_path):
    """Under tensor parallelism every worker writes: ``.rank<R>`` keeps the ranks apart, and
    the JSON writer turns an unwritable path into one typed error."""
    from ringflow.errors import OutputError
    from ringflow.orchestrator.dumps import dump_stem, write_json
    assert dump_stem(str(tmp_path / "plan.json"), 1) == str(tmp_path / "plan.rank1")
    assert dump_stem(f"{tmp_path}/", 0) == str(tmp_path / "ringflow-plan.rank0")
    assert dump_stem(str(tmp_path / "plan")) == str(tmp_path / "plan")  # one process
    written = write_json(f"{dump_stem(str(tmp_path / 'lane'), 3)}.experts.json", {"a": 1})
    assert written.name == "lane.rank3.experts.json" and json.loads(written.read_text()) == {"a": 1}
    with pytest.raises(OutputError, match="RINGFLOW_DUMP"):
        write_json(tmp_path / "missing" / "x.json", {})
