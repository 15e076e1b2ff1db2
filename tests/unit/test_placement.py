"""The placement planner (orchestrator/placement.py, Note [Placement model]): its forward-time
model on cases worked by hand, and the placements it chooses (deterministic given the times)."""

import itertools
import random

import pytest

from ringflow.errors import ConfigError, ProfileError
from ringflow.orchestrator.placement import choose, forward_ms
from ringflow.orchestrator.profile import Profile

EVERY_8_LAST_2 = [i for i in range(32) if i % 8 >= 6]


def test_nothing_offloaded_is_the_sum_of_the_layers():
    assert forward_ms([1.0, 2.0, 3.0], [9.0] * 3, [], 1) == 6.0


def test_a_copy_hides_behind_the_compute_before_it_and_shows_when_it_cannot():
    # one slot, layer 1 offloaded: its copy (2 ms) starts once layer 1 of the last forward
    # computed, and has layers 2, 0 (4 ms) to hide behind: nothing exposed
    assert forward_ms([2.0, 1.0, 2.0], [2.0] * 3, [1], 1) == 5.0
    # a 7 ms copy: exposed by 7 - 4 = 3 ms per forward
    assert forward_ms([2.0, 1.0, 2.0], [7.0] * 3, [1], 1) == 8.0


def test_without_cross_forward_the_first_copy_waits_for_its_forward():
    # copy of layer 0 (5 ms) cannot start in the previous forward's tail: all of it is exposed
    assert forward_ms([1.0, 1.0], [5.0, 5.0], [0], 1, cross_forward=False) == 7.0
    assert forward_ms([1.0, 1.0], [5.0, 5.0], [0], 1, cross_forward=True) == 6.0


def test_a_hidden_copy_slows_the_compute_beside_it_by_the_slowdown():
    # one slot, layer 2 offloaded: its 2 ms copy starts when layer 2 of the last forward
    # finished and runs beside layers 3 and 0 (1 ms each): 2 ms shared, 0.25 ms each lost
    compute, copy = [1.0] * 4, [2.0] * 4
    assert forward_ms(compute, copy, [2], 1) == 4.0
    assert forward_ms(compute, copy, [2], 1, slowdown=0.25) == pytest.approx(4.5)
    # a copy longer than what hides it: the layers beside it are slower, but layer 2 waits for
    # the copy to land either way, so the forward is not
    assert forward_ms(compute, [5.0] * 4, [2], 1) == 6.0
    assert forward_ms(compute, [5.0] * 4, [2], 1, slowdown=0.25) == 6.0
    # two slots: the copies run back to back beside every layer but the first forward's
    assert forward_ms(compute, copy, [1, 3], 2, slowdown=0.25) > forward_ms(compute, copy,
                                                                             [1, 3], 2)
    # nothing offloaded: nothing to slow
    assert forward_ms(compute, copy, [], 1, slowdown=0.5) == 4.0
    with pytest.raises(ConfigError, match="slowdown"):
        forward_ms(compute, copy, [2], 1, slowdown=-0.1)


def test_adjacent_layers_behind_one_slot_expose_a_copy_that_spacing_hides():
    """The issue's case: last 2 of every 8 through one slot is slower than its ideal; 8 layers
    one every four, placed by the planner, hide behind the resident layers between them."""
    compute, copy = [1.0] * 32, [3.0] * 32
    grouped = forward_ms(compute, copy, EVERY_8_LAST_2, 1)
    placed = choose(compute, copy, 8, 1)
    assert grouped > 1.2 * 32
    assert placed.layers == (3, 7, 11, 15, 19, 23, 27, 31)
    assert placed.forward_ms == placed.resident_ms == 32.0 and placed.ratio == 1.0
    # one every four from layer 0 ties in the steady state; the tie goes to the placement
    # whose first forward (nothing carried in) hides its first copy too
    first = (0, 4, 8, 12, 16, 20, 24, 28)
    assert forward_ms(compute, copy, first, 1) == placed.forward_ms
    assert forward_ms(compute, copy, placed.layers, 1, cross_forward=False) == 32.0 < \
        forward_ms(compute, copy, first, 1, cross_forward=False)


@pytest.mark.parametrize("seed", range(6))
def test_the_choice_is_never_worse_than_the_patterns_a_user_would_pick(seed):
    rng = random.Random(seed)
    layers = rng.randint(8, 40)
    compute = [rng.uniform(0.2, 3.0) for _ in range(layers)]
    copy = [rng.uniform(0.5, 6.0) for _ in range(layers)]
    count, slots = rng.randint(1, layers // 2), rng.randint(1, 3)
    placed = choose(compute, copy, count, slots)
    assert len(placed.layers) == count == len(set(placed.layers))
    assert placed.forward_ms == forward_ms(compute, copy, placed.layers, slots)
    for rival in (list(range(count)), list(range(layers - count, layers)),
                  sorted(rng.sample(range(layers), count))):
        assert placed.forward_ms <= forward_ms(compute, copy, rival, slots) + 1e-9
    assert choose(compute, copy, count, slots) == placed  # deterministic


def test_uneven_layers_reach_the_best_placement_an_exhaustive_search_finds():
    # layers 4..7 compute 4 ms, the rest 0.5: a 4 ms copy hides only behind a long layer
    compute, copy = [0.5] * 4 + [4.0] * 4 + [0.5] * 8, [4.0] * 16
    placed = choose(compute, copy, 3, 1)
    best = min(forward_ms(compute, copy, c, 1) for c in itertools.combinations(range(16), 3))
    assert placed.forward_ms == best < forward_ms(compute, copy, [0, 5, 10], 1)


def test_bad_requests_are_refused():
    with pytest.raises(ConfigError, match="cannot offload 5 of 4"):
        choose([1.0] * 4, [1.0] * 4, 5, 1)
    with pytest.raises(ConfigError, match="one compute and one copy time per layer"):
        forward_ms([1.0] * 4, [1.0] * 3, [0], 1)
    with pytest.raises(ConfigError, match="at least one slot"):
        choose([1.0] * 4, [1.0] * 4, 1, 0)


def test_a_profile_asks_for_a_count_and_the_model_decides_the_layers():
    spec = Profile.from_mapping({"name": "p", "offload": {"layers": {"count": 3},
                                                           "workspace_mib": 64}}).offload
    assert spec.resolve(12) == [1, 5, 9]  # equal layers: evenly spaced, the first copy hidden
    compute = [0.5] * 6 + [4.0] * 6
    assert spec.resolve(12, costs=(compute, [4.0] * 12), slots=1) == \
        list(choose(compute, [4.0] * 12, 3, 1).layers)
    with pytest.raises(ProfileError, match=r"\{count: 3\} asks for more layers than the "
                                           r"model's 2"):
        spec.resolve(2)
    with pytest.raises(ProfileError, match="offload.layers"):
        Profile.from_mapping({"offload": {"layers": {"count": 0}, "workspace_mib": 64}})


def test_the_bench_prediction_spreads_the_measured_totals_over_the_layers():
    """``ringflow bench``'s predicted column: gather-only 6 ms over layers 0 and 2 (3 ms each),
    compute-only 4 ms over 4 layers, two slots. Without cross-forward layer 0 waits for its
    whole copy (3 ms) and layer 2's copy, queued behind it on the copy engine, lands 1 ms after
    layer 1: 8 ms. With it, the copies of the next forward start in this one's tail: 6 ms.
    A run recorded before ``beside`` was measured predicts with no slowdown."""
    from ringflow.bench.scenarios import predicted_ms, table

    ms = {"compute": 4.0, "gather": 6.0}
    got = predicted_ms(ms, 4, {0, 2}, 2)
    assert got["captured"] == forward_ms([1.0] * 4, [3.0, 0, 3.0, 0], [0, 2], 2, False)
    assert got["cross"] == forward_ms([1.0] * 4, [3.0, 0, 3.0, 0], [0, 2], 2, True)
    assert got["captured"] == got["captured_unslowed"] == 8.0
    assert got["cross"] == got["cross_unslowed"] == 6.0 and got["slowdown"] == 0.0
    row = {"scenario": "s", "ms": {k: 1.0 for k in ("sync", "eager", "captured", "hand")},
           "ideal_ms": 1.0, "ratios": {k: 1.0 for k in (
               "speedup_vs_sync", "captured_vs_ideal", "captured_vs_hand",
               "gather_hidden_pct")}, "eager_dispatch_us_per_node": 1.0,
           "outputs_equal_to_sync": {"eager": True}, "steady_ms": {k: 2.0 for k in (
               "sync", "captured", "cross", "hand")}, "steady_cross_vs_ideal": 2.0,
           "steady_cross_hidden_pct": 0.0, "carried": [], "predicted_ms": got,
           "captured_vs_predicted": 1 / 8, "steady_cross_vs_predicted": 2 / 6}
    line = next(l for l in table([row]).splitlines() if l.startswith("s ") and "8.000" in l)
    assert line.split()[1:] == ["8.000", "8.000", "1.000", "0.125", "0.125", "6.000", "2.000",
                                "0.333", "0.000", "0.000", "0.00"]


def test_the_bench_charges_the_slowdown_its_beside_graph_measured():
    """Gather-only 2 ms, compute-only 8 ms, the two side by side 8.5 ms: 0.25 ms lost per ms
    beside a copy. Layer 2's 2 ms copy hides behind layers 0 and 1 (one slot, cross-forward:
    behind the tail and layer 0), so the forward is 8 + 0.25 * 2 ms. SM gathers that
    serialise (beside = gather + compute) are a slowdown of 1; beside faster than the ideal
    (noise) is none."""
    from ringflow.bench.scenarios import predicted_ms, slowdown

    ms = {"compute": 8.0, "gather": 2.0, "beside": 8.5}
    assert slowdown(ms) == 0.25
    got = predicted_ms(ms, 4, {2}, 1)
    assert got["cross"] == pytest.approx(8.5) and got["cross_unslowed"] == 8.0
    assert got["captured"] > got["captured_unslowed"]
    assert slowdown({"compute": 8.0, "gather": 2.0, "beside": 10.0}) == 1.0
    assert slowdown({"compute": 8.0, "gather": 2.0, "beside": 7.9}) == 0.0
    assert slowdown({"compute": 8.0, "gather": 2.0}) == 0.0


def test_each_copy_compute_handoff_is_on_the_path_where_layers_are_short():
    """One slot, three layers, each computing 1 ms with a 2 ms copy: every copy waits for the
    layer before it to end (the first for the previous forward's last layer) and every layer
    for its copy, so each layer is two hand-offs, a copy and a compute: 3 (2h + c + k) = 12 ms
    with h = 0.5 (9 with none). Behind two slots and long layers the hand-offs hide: 8 ms
    layers leave the 2 ms copies 6 ms to spare."""
    compute, copy = [1.0] * 3, [2.0] * 3
    assert forward_ms(compute, copy, [0, 1, 2], 1, False) == 9.0
    assert forward_ms(compute, copy, [0, 1, 2], 1, False, handoff_ms=0.5) == 12.0
    long = [8.0] * 3
    assert forward_ms(long, copy, [1, 2], 2, True, handoff_ms=0.5) == 24.0
    with pytest.raises(ConfigError, match="handoff_ms"):
        forward_ms(compute, copy, [0], 1, handoff_ms=-1.0)


def test_the_bench_measures_the_handoff_from_its_sync_graph():
    """The sync graph is every gather and compute in one chain, two hand-offs per gathered
    layer: sync 10 ms over gather 3 + compute 5 with 4 gathered layers is 0.25 ms per
    hand-off. Noise below the sum is none; a run without a sync time has none."""
    from ringflow.bench.scenarios import handoff_ms, predicted_ms

    ms = {"sync": 10.0, "gather": 3.0, "compute": 5.0}
    assert handoff_ms(ms, 4) == 0.25
    assert handoff_ms({**ms, "sync": 7.9}, 4) == 0.0
    assert handoff_ms({"gather": 3.0, "compute": 5.0}, 4) == 0.0
    got = predicted_ms(ms, 4, {0, 1, 2, 3}, 1)
    assert got["handoff_ms"] == 0.25
    assert got["captured"] == forward_ms([1.25] * 4, [0.75] * 4, [0, 1, 2, 3], 1, False, 0.0,
                                         0.25)
    no_sync = {"gather": 3.0, "compute": 5.0}
    assert got["captured"] > predicted_ms(no_sync, 4, {0, 1, 2, 3}, 1)["captured"]


@pytest.mark.parametrize("compute,copy,needle", [
    ([1.0, float("nan")], [1.0, 1.0], "finite and >= 0"),
    ([1.0, 1.0], [float("inf"), 1.0], "finite and >= 0"),
    ([1.0] * 257, [1.0] * 257, "up to 256 layers"),
])
def test_times_that_are_no_times_and_models_past_the_cap_are_refused(compute, copy, needle):
    with pytest.raises(ConfigError, match=needle):
        choose(compute, copy, 1, 1)


def test_the_placed_bench_scenario_is_the_planners_choice_for_one_slots_measured_times():
    """profiles/bench/one_slot_placed.yaml lists the layers offload {count: 8} picks from the
    per-layer times ``one-slot`` measured on the H200 (bench-boundary-h200.json): planner and
    file agree, and the model predicts the all-resident time for it, 1.275x for one-slot's
    hand-picked last 2 of every 8."""
    import json
    from pathlib import Path

    from ringflow.orchestrator.profile import load_profile
    root = Path(__file__).resolve().parents[2] / "profiles"
    placed = load_profile(root / "bench" / "one_slot_placed.yaml")
    hand = load_profile(root / "bench" / "one_slot.yaml")
    runs = json.loads((root / "results" / "bench-boundary-h200.json").read_text())
    [run] = [r for r in runs.get("results") or runs["rows"] if r["scenario"] == "one-slot"]
    compute = [run["ms"]["compute"] / 32] * 32
    copy = [run["ms"]["gather"] / 8] * 32
    choice = choose(compute, copy, 8, slots=1)
    assert choice.layers == tuple(sorted(placed.gathered_layers))
    assert choice.ratio == pytest.approx(1.0)
    hand_ms = forward_ms(compute, copy, sorted(hand.gathered_layers), 1)
    assert hand_ms / choice.resident_ms == pytest.approx(1.275, abs=0.001)
    assert (placed.layers, placed.depth, placed.slot, placed.workload) == (
        hand.layers, hand.depth, hand.slot, hand.workload)


def test_the_search_ends_where_steady_times_differ_below_the_gain_threshold():
    """Times a few 1e-9 ms apart (layers one parameter apart, in vLLM's estimates): a move
    may not trade a tiny steady loss for a cold gain, or the search cycles (it did)."""
    import threading
    compute = [1.0000000024, 1.0000000016, 1.0, 1.0000000008, 1.0000000008, 1.000000002]
    copy = [2.0000000024, 2.0, 2.4e-09, 3.0000000012, 3.0000000024, 3.000000002]
    found = []
    worker = threading.Thread(target=lambda: found.append(choose(compute, copy, 4, 1)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert found, "choose() did not return"
    assert len(found[0].layers) == 4
