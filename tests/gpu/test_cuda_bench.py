"""``ringflow bench`` on a GPU: one scenario measured end to end, and the ``beside`` graph the
placement model's slowdown comes from (Note [Placement model])."""

import pytest

from ringflow import Profile
from ringflow.bench import scenarios as bench

pytestmark = pytest.mark.cuda


def test_a_scenario_measures_every_variant_and_predicts_with_the_slowdown_beside_measured():
    profile = Profile.load("demo").replace(slot={"shape": [4096, 1024], "dtype": "bfloat16"},
                                           workspace_mib=64)
    result = bench.run_profile("beside", profile, replays=3).to_dict()
    ms = result["ms"]
    assert all(result["outputs_equal_to_sync"].values())
    # the two branches share nothing: no faster than the longer one alone (5% timing noise),
    # no slower than the two one after the other
    assert 0.95 * max(ms["gather"], ms["compute"]) <= ms["beside"]
    assert ms["beside"] <= 1.05 * (ms["gather"] + ms["compute"])
    pred = result["predicted_ms"]
    assert pred["slowdown"] == bench.slowdown(ms) and 0.0 <= pred["slowdown"] <= 1.0
    assert pred["captured"] >= pred["captured_unslowed"]
    # the hand-off from the sync graph, two per gathered layer
    gathered = profile.layers if profile.gathered_layers is None else len(profile.gathered_layers)
    assert pred["handoff_ms"] == bench.handoff_ms(ms, gathered) >= 0.0
    assert result["captured_vs_predicted"] == ms["captured"] / pred["captured"]
    # back to back: the cross-forward prediction from compute-only, beside and sync timed that
    # way (the hand-off from the sync graph back to back)
    steady, ahead = result["steady_ms"], result["predicted_steady_ms"]
    assert ahead["handoff_ms"] == bench.handoff_ms(
        {"sync": steady["sync"], "gather": ms["gather"], "compute": steady["compute"]}, gathered)
    assert ahead["slowdown"] == bench.slowdown({"gather": ms["gather"],
                                                "compute": steady["compute"],
                                                "beside": steady["beside"]})
    assert result["steady_cross_vs_predicted"] == steady["cross"] / ahead["cross"]
    assert result["steady_cross_vs_resident"] == steady["cross"] / steady["compute"]
    row = next(line for line in bench.table([result]).splitlines()
               if line.startswith("beside ") and f"{pred['captured']:.3f}" in line)
    # the table reads the row back
    assert row.split()[-3:] == [f"{pred['slowdown']:.3f}", f"{ahead['slowdown']:.3f}",
                                f"{1000 * pred['handoff_ms']:.2f}"]


def test_a_scenarios_timeline_is_named_by_the_scenario_and_the_gpu(tmp_path):
    """A timeline file says what it measured and where (``beside-h200.trace.json`` on an H200):
    the plot's name takes the same stem."""
    from ringflow.bench import records
    profile = Profile.load("demo").replace(slot={"shape": [1024, 256], "dtype": "bfloat16"},
                                           workspace_mib=8)
    result = bench.run_profile("beside", profile, replays=2, trace_dir=tmp_path).to_dict()
    name = result["timeline_trace"]
    assert name == f"beside-{records.gpu_slug()}.trace.json" and (tmp_path / name).exists()
    assert records.gpu_slug() not in ("cpu", "gpu")
