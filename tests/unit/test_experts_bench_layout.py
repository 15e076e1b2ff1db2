"""The experts bench's layout of vLLM's prefetch offloader: every offloaded layer reads its own
weights, under vLLM 0.26's buffer rule (tools/vllm_prefetch_slots.py checks the rule itself on a
GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("experts_bench", ROOT / "tools/experts_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wrong_reads(layers: int, group: int, num: int, step: int, passes: int = 3) -> list[int]:
    """The offloaded layers that read another layer's weights, replaying vLLM's
    ``PrefetchOffloader``: offloaded layer ``k`` (in order) owns buffer ``k % step``, the first
    ``step`` are copied at start-up, and after ``k`` runs ``(k + step) % n`` is copied into its
    buffer (one copy stream: in issue order)."""
    offloaded = [i for i in range(layers) if i % group >= group - num]
    n = len(offloaded)
    held = {}
    for k in range(min(step, n)):
        held[k % step] = k
    wrong = set()
    for _ in range(passes):
        for k in range(n):
            if held.get(k % step) != k:
                wrong.add(offloaded[k])
            nxt = (k + step) % n
            held[nxt % step] = nxt
    return sorted(wrong)


def test_the_replay_finds_the_layout_the_bench_ran_before():
    # 4 layers, 3 ahead: layer 0's refill lands in layer 3's buffer before layer 3 runs
    assert wrong_reads(4, 1, 1, 3) == [3]
    assert wrong_reads(8, 1, 1, 4) == []


@pytest.mark.parametrize("layers", [2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("share", [0.25, 0.5])
def test_prefetch_layout_fills_the_memory_and_gives_each_layer_its_weights(layers, share):
    bench = _bench()
    memory = layers * share + 2 if layers * share + 2 < layers else layers - 1
    group, num, step = bench.prefetch_layout(layers, memory)
    offloaded = sum(1 for i in range(layers) if i % group >= group - num)
    assert offloaded >= 1 and layers - offloaded + step <= memory
    assert wrong_reads(layers, group, num, step) == []
    # nothing that fits uses more memory
    for g in range(1, layers + 1):
        for n in range(1, g + 1):
            k = sum(1 for i in range(layers) if i % g >= g - n)
            for s in range(1, k + 1):
                if not wrong_reads(layers, g, n, s) and layers - k + s <= memory:
                    assert layers - k + s <= layers - offloaded + step


def test_the_bench_gives_four_layers_two_resident_and_one_buffer():
    assert _bench().prefetch_layout(4, 3.0) == (2, 1, 1)


@pytest.mark.parametrize("layers", [4, 8])
def test_the_held_lane_gets_the_memory_of_the_others_and_no_more(layers):
    """``ringflow-held``: the held layers' slots spread over the cached layers, so its slots
    and ring never exceed the device memory every peer gets (``device_layers``)."""
    bench = _bench()
    section = bench.configs(layers)["ringflow-held"]["additional_config"]["ringflow"]["experts"]
    assert section["decode_from_ring"] and section["layer_buffers"] == bench.RING
    cached = layers - bench.RING
    memory = cached * section["slots"] / 128 + bench.RING
    assert bench.device_layers(layers) - cached / 128 < memory <= bench.device_layers(layers)


def uva_offloaded_layers(layers: int, cpu_offload_gb: float, expert_bytes: int) -> float:
    """Layers' worth of experts vLLM 0.26's UVA offloader moves off the device: it walks the
    layers' parameters in order (each layer's ``w13`` then ``w2``) and offloads each whole
    while its count is under ``int(cpu_offload_gb * 2**30)`` bytes."""
    limit, done = int(cpu_offload_gb * 1024**3), 0
    w13, w2 = 128 * expert_bytes * 2 // 3, 128 * expert_bytes // 3
    for _ in range(layers):
        for size in (w13, w2):
            if done >= limit:
                return done / (128 * expert_bytes)
            done += size
    return done / (128 * expert_bytes)


@pytest.mark.parametrize("fp8", [None, "block"])
@pytest.mark.parametrize("layers", [4, 8])
def test_the_uva_offloader_keeps_on_the_device_what_the_lane_keeps(layers, fp8):
    """``vllm-uva`` offloads the layers the lane's memory would not hold, no more: at 4 layers
    one, so three stay resident (a whole GiB rounded up offloaded two)."""
    bench = _bench()
    gb = bench.configs(layers, fp8)["vllm-uva"]["cpu_offload_gb"]
    offloaded = uva_offloaded_layers(layers, gb, bench.expert_bytes(fp8))
    assert offloaded == pytest.approx(layers - bench.device_layers(layers))
    for name in bench.LANES:  # ringflow puts its layers' experts in host memory itself
        assert "cpu_offload_gb" not in bench.configs(layers, fp8)[name], name


@pytest.mark.parametrize("layers", [4, 8])
def test_the_arena_lane_offloads_its_layers_and_keeps_the_memory_of_the_others(layers):
    """``ringflow-arena``: ringflow moves the chosen layers' experts to host memory (all but
    layers 0 and ``layers // 2``: at 4 layers 1 and 3, as the prefetch offloader's layout), so
    two stay resident, and those two with the slots hold no more than every peer's memory;
    the slots hold at least one whole layer (a window)."""
    bench = _bench()
    config = bench.configs(layers)["ringflow-arena"]
    section = config["additional_config"]["ringflow"]["experts"]
    assert section["layer_buffers"] == "slots" and "cpu_offload_gb" not in config
    resident = [i for i in range(layers) if i not in section["layers"]]
    assert resident == [0, layers // 2] and len(section["layers"]) == layers - bench.RING
    first = bench.configs(layers)["ringflow-arena-first"]["additional_config"]["ringflow"]
    assert first["experts"] == {**section, "layers": list(range(layers - bench.RING))}
    if layers == 4:
        group, num, _ = bench.prefetch_layout(layers, bench.device_layers(layers))
        assert section["layers"] == [i for i in range(layers) if i % group >= group - num]
    chosen = layers - bench.RING
    assert chosen * section["slots"] >= 128
    assert chosen * section["slots"] / 128 + bench.RING <= bench.device_layers(layers)


@pytest.mark.parametrize("layers", [4, 8, 16])
def test_the_whole_lane_has_the_peers_memory_with_its_resident_layers_whole(layers):
    """``ringflow-whole``: every layer chosen (in host memory), the arena's resident layers
    with all 128 experts in their slots and its chosen ones ``held_slots`` each, the rows its
    rounding leaves one each to those nearest after a whole layer: exactly the device memory
    every peer keeps (``device_layers``), one arena, started early."""
    bench = _bench()
    whole = bench.configs(layers)["ringflow-whole"]["additional_config"]["ringflow"]["experts"]
    arena = bench.configs(layers)["ringflow-arena"]["additional_config"]["ringflow"]["experts"]
    assert whole["layers"] == "all" and whole["layer_buffers"] == "slots"
    assert whole["early_start"] is True
    rows = bench.device_layers(layers) * 128
    slots = [whole["slots"][str(i)] for i in range(layers)]
    assert sum(slots) == rows
    assert [i for i, n in enumerate(slots) if n == 128] == \
        [i for i in range(layers) if i not in arena["layers"]]
    assert {slots[i] for i in arena["layers"]} <= {arena["slots"], arena["slots"] + 1}
    if layers == 8:  # the 4 rounded-off rows: the two layers after each whole one
        assert slots == [128, 43, 43, 42, 128, 43, 43, 42]
    plan = bench.configs(layers)["ringflow-whole-plan"]
    assert plan["additional_config"]["ringflow"]["experts"] == whole
    host = bench.configs(layers)["ringflow-whole-host-plan"]["additional_config"]["ringflow"]
    assert host["experts"] == {**whole, "host_share": "auto", "host_tokens": 8}
    # the same rows with the whole layers first, the spare ones right after them
    front = bench.configs(layers)["ringflow-front-plan"]
    assert front["env"] == plan["env"]
    first = front["additional_config"]["ringflow"]["experts"]["slots"]
    first = [first[str(i)] for i in range(layers)]
    assert first[:bench.RING] == [128] * bench.RING and sum(first) == rows
    assert first[bench.RING:] == sorted(first[bench.RING:], reverse=True)
    assert set(first[bench.RING:]) <= {arena["slots"], arena["slots"] + 1}
    # the same layout without the early start, nothing else changed
    late = bench.configs(layers)["ringflow-front-late"]
    assert late["env"] == front["env"]
    late_experts = late["additional_config"]["ringflow"]["experts"]
    assert front["additional_config"]["ringflow"]["experts"]["early_start"] is True
    assert late_experts == {**front["additional_config"]["ringflow"]["experts"],
                            "early_start": False}


def test_every_lane_peer_is_a_lane_and_its_engine_switches_are_ringflows():
    """Every ringflow peer but whole-layer streaming reports the lane (``LANES``), and the
    switches a peer sets while its engine loads (``env``) are ringflow's own, popped before
    vLLM's engine sees its arguments."""
    from ringflow.envs import SWITCHES
    bench = _bench()
    peers = bench.configs(4)
    assert {n for n in peers if n.startswith("ringflow") and n != "ringflow-layers"} \
        == set(bench.LANES)
    switched = {n: c["env"] for n, c in peers.items() if "env" in c}
    assert switched == {name: {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"}
                        for name in ("ringflow-held-plan", "ringflow-held-host-plan",
                                     "ringflow-whole-plan", "ringflow-front-plan",
                                     "ringflow-front-late", "ringflow-whole-host-plan")}
    assert all(k in SWITCHES for env in switched.values() for k in env)


def test_the_host_share_prediction_takes_the_models_saving_off_the_copy_only_step():
    """#47's 'within 1.2x of the model's prediction': the copy-only sibling's measured step
    less each host layer's predicted saving (copy time less split time) at the step's size."""
    bench = _bench()
    split = {"copy_ms": 1.0, "layer_ms": 0.5, "cpu_ms": 0.5, "misses": 6, "to_host": 3}
    share = {"predicted": {1: split, "8": {**split, "layer_ms": 0.9}}}
    results = {"ringflow-host": {"report": [
        {"layer": i, "experts": 128, "slots": 32, "host_share": share} for i in range(4)] + [
        {"layer": 4, "experts": 128, "slots": 32},  # a layer without a share saves nothing,
        {"layer": 5, "experts": 128, "slots": 128, "host_share": share}]}}  # nor a whole one
    table = {"ringflow": {"decode_hard_b1_tok_s": {"median": 100.0},   # 10 ms a step
                          "decode_hard_b8_tok_s": {"median": 400.0}},  # 20 ms
             "ringflow-host": {"decode_hard_b1_tok_s": {"median": 120.0},
                               "decode_hard_b8_tok_s": {"median": 430.0},
                               "decode_hard_b64_tok_s": {"median": 900.0}}}
    table["ringflow"]["decode_easy_b1_tok_s"] = {"median": 300.0}  # the same experts each
    table["ringflow-host"]["decode_easy_b1_tok_s"] = {"median": 300.0}  # step: no misses
    bench.predict_host_share(table, results, "ringflow-host", "ringflow", [1, 8, 64],
                             ["hard", "easy"])
    assert "predicted_tok_s" not in table["ringflow-host"]["decode_easy_b1_tok_s"]
    b1, b8 = table["ringflow-host"]["decode_hard_b1_tok_s"], table["ringflow-host"][
        "decode_hard_b8_tok_s"]
    assert b1["predicted_tok_s"] == 125.0  # 10 ms less 4 x 0.5 ms
    assert b1["predicted_vs_ringflow"] == 1.25 and b1["measured_vs_predicted"] == 0.96
    assert b8["predicted_tok_s"] == round(8000 / (20 - 0.4), 1)  # keys as JSON gives them too
    assert "predicted_tok_s" not in table["ringflow-host"]["decode_hard_b64_tok_s"]  # no model
    # the model saving a whole step or more (its uniform misses outnumber the step's copies:
    # the whole-layer arena's batch 8 on the H100, 3.2 ms of 2.7): no prediction, and why
    table["ringflow"]["decode_hard_b8_tok_s"] = {"median": 8000 / 0.3}  # 0.3 ms a step
    bench.predict_host_share(table, results, "ringflow-host", "ringflow", [8], ["hard"])
    b8 = table["ringflow-host"]["decode_hard_b8_tok_s"]
    assert b8["predicted_tok_s"] is None and "outnumber" in b8["unpredicted"]
    assert "measured_vs_predicted" not in b8  # the first call's ratios gone with it
    table["ringflow"] = {"error": "did not start"}
    bench.predict_host_share(table, results, "ringflow-host", "ringflow", [1], ["hard"])  # no-op


def test_a_host_peer_at_a_forced_share_is_that_peer_with_the_share_set():
    """``--only ringflow-host@0.33``: the peer as configured, its host share forced; the
    configured table untouched; a peer without a share, or a share outside 0..1, refused."""
    bench = _bench()
    table = bench.configs(4, None)
    forced = bench.forced_share(table, "ringflow-host@0.33")
    assert forced["additional_config"]["ringflow"]["experts"]["host_share"] == 0.33
    assert table["ringflow-host"]["additional_config"]["ringflow"]["experts"][
        "host_share"] == "auto"
    held = bench.forced_share(table, "ringflow-held-host-plan@1")
    assert held["env"] == {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"}
    assert held["additional_config"]["ringflow"]["experts"]["decode_from_ring"] is True
    assert bench.forced_share(table, "ringflow") is table["ringflow"]
    for wrong in ("ringflow@0.5", "ringflow-host@1.5", "ringflow-host@x", "nothing@0.5"):
        with pytest.raises(SystemExit):
            bench.forced_share(table, wrong)


def test_one_peer_with_a_host_share_per_run():
    """Each host-share engine's worker polls a CPU while its engine lives: two in one run took
    cores from each other (the H200 run at 72829bc), so the bench refuses a second one."""
    import subprocess
    import sys
    bench = _bench()
    table = bench.configs(4, None)
    assert sorted(n for n, c in table.items() if bench.host_share_of(c) is not None) == [
        "ringflow-held-host", "ringflow-held-host-plan", "ringflow-host",
        "ringflow-whole-host-plan"]
    assert set(bench.HOST_SIBLINGS) == {n for n, c in table.items()
                                        if bench.host_share_of(c) is not None}
    assert bench.host_share_of(bench.forced_share(table, "ringflow-host@0.5")) == 0.5
    ran = subprocess.run([sys.executable, str(ROOT / "tools/experts_bench.py"), "--only",
                          "ringflow,ringflow-host,ringflow-host@0.33"],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and "one peer with a host share per run" in ran.stderr, ran


def test_hard_decode_cells_whose_caches_never_missed_are_marked_not_hard():
    """The fp8 dummy checkpoints' sampled decode repeated its experts (every layer's hit rate
    1.0 on the H100): such a run's hard-routing cells are marked; a lane whose cached layers
    missed, a whole layer's 1.0 beside them, and vLLM's peers (no report) are not."""
    bench = _bench()
    cells = {"decode_hard_b1_tok_s": {"median": 400.0}, "decode_easy_b1_tok_s": {"median": 500.0},
             "prefill_8192_tok_s": {"median": 9e4}}
    table = {name: {k: dict(v) for k, v in cells.items()}
             for name in ("fp8", "bf16", "vllm-uva")}
    table["broken"] = {"error": "did not start"}
    whole = {"experts": 128, "slots": 128, "hit_rate": 1.0}
    results = {"fp8": {"report": [whole, {"experts": 128, "slots": 64, "hit_rate": 0.9994}]},
               "bf16": {"report": [whole, {"experts": 128, "slots": 64, "hit_rate": 0.7059}]},
               "broken": {"error": "did not start"}}
    bench.flag_repeated_routing(table, results)
    assert table["fp8"]["decode_hard_b1_tok_s"]["routing_repeated"] == 0.9994
    assert all("routing_repeated" not in table["fp8"][k]
               for k in ("decode_easy_b1_tok_s", "prefill_8192_tok_s"))
    assert not any("routing_repeated" in cell for name in ("bf16", "vllm-uva")
                   for cell in table[name].values())


def test_every_timed_prompt_follows_the_same_decode():
    """Each prompt, alone and with its second token, comes right after a request decoding
    --decode-before tokens: the lane's lone prompt costs what the steps before it left in
    its slots, so the cells the run measures before it must not change it; 0 leaves none."""
    bench = _bench()
    calls = bench.prefill_calls([8192, 32768], 16)
    timed = [i for i, (kind, _) in enumerate(calls) if kind != "settle"]
    assert [calls[i] for i in timed] == [("first", 8192), ("second", 8192),
                                         ("first", 32768), ("second", 32768)]
    assert all(calls[i - 1] == ("settle", 16) for i in timed)
    assert bench.prefill_calls([8192], 0) == [("first", 8192), ("second", 8192)]
    assert bench.prefill_calls([], 16) == []


def test_a_round_starts_only_if_one_as_long_as_the_last_ends_by_the_deadline():
    """--deadline bounds when the last round ends, not when it starts: a deadline just under
    the GPU's limit gets every round that fits and none that would be cut off."""
    fits = _bench().round_fits
    assert fits(400.0, 20.0, 565.0)  # 145 s left: a 20 s round fits
    assert not fits(550.0, 20.0, 565.0)  # it would end at 570
    assert fits(545.0, 20.0, 565.0)  # it ends at 565, the deadline itself
    assert fits(10_000.0, 1_000.0, None)  # no deadline: every round
