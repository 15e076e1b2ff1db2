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
    assert result["captured_vs_predicted"] == ms["captured"] / pred["captured"]
    row = next(line for line in bench.table([result]).splitlines()
               if line.startswith("beside ") and f"{pred['captured']:.3f}" in line)
    assert row.split()[-1] == f"{pred['slowdown']:.3f}"  # the table reads the row back
