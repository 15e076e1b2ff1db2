"""Routed experts from host memory inside vLLM's CUDA engine (vLLM 0.26 on the H200; Note
[Experts in vLLM]), bit for bit what all-resident vLLM computes (Note [Same bits as resident]).

A Qwen3-MoE-shaped model (4 layers, 128 experts of intermediate 96, top-8: vLLM has tuned H200
tiles for that layer and none for a cache's slots; seeded random weights of real scale, bf16),
one request at a time (FIELD_NOTES: batched outputs of two GPU engines differ), prompts of 3, 8,
14 and 70 tokens, greedy and sampled (temperature 1, a seed per request), in eager mode and
vLLM's default FULL_AND_PIECEWISE graphs:

* ``resident`` / ``resident-sampled``: vLLM alone, every expert in device memory, Triton MoE;
* ``lane-32`` / ``lane-32-sampled``: every layer's experts in pinned host memory (ringflow puts
  them there as vLLM builds the layers: no offload flags), 32 slots per layer and a ring of 2 layers,
  ``layer_tokens: 8``: the prompts of 8 tokens or more through the ring, the rest through the
  cache (Note [Expert lane modes]); slots and ring buffers poisoned;
* ``lane-8`` / ``passes-8``: 8 slots, no ring: steps of more experts than the slots hold run
  in passes (the last in place from the host view, or all through the slots), summed once;
* ``lookahead-32``: each layer guesses the next one's experts on a side stream;
* ``held-64-sampled``: ``decode_from_ring``: layers 0 and 1 stay whole in the ring's buffers
  and decode computes them there (external event waits inside the FULL decode graphs), 64
  slots for layers 2 and 3 (Note [Small steps read the held layers]);
* ``arena-64-sampled`` / ``arena-all-64``: ``layer_buffers: slots``: the large steps compute
  each chosen layer from the slots' own rows, through an expert map over all of them (Note
  [Large steps stream through the slots]): layers 0 and 1 on 64 slots (one layer's worth of
  rows), or all four (two); ``arena-placed-13``: layers 1 and 3, with no offload flags:
  ringflow puts their experts in host memory as vLLM builds them (Note [Ringflow places the
  chosen experts]); ``arena-whole-13``: every layer, 0 and 2 with all 128 experts in their
  slots, 1 and 3 with 64, the large steps borrowing the whole layers' rows;
* fp8 experts (Note [fp8 experts]): an fp8 checkpoint in 128x128 blocks (``qwen3_moe128_fp8``,
  the layout of Qwen3-30B-A3B-FP8 and DeepSeek-V3) through the cache, the ring and passes, bit
  for bit its all-resident run; an fp8 checkpoint with one scale per matrix
  (``qwen3_moe128_fp8t``, per tensor, as ``quantization="fp8"`` makes at load): steps of one
  pass bit for bit; steps whose experts exceed the slots computed in one pass from the host
  store, bit for bit (Note [fp8 experts]). vLLM 0.26's UVA offloader cannot take weights quantized at load
  (``quantization="fp8"`` creates them on the meta device): that start ends on vLLM's error
  and ringflow's line naming it;
* a refusal: vLLM's prefetch offloader holding chosen layers' experts (the line names the
  layer and the fix). Other quantized formats are refused by name
  (tests/unit/test_experts_profile.py).

vLLM 0.26's V2 model runner makes no offloader, so these engines run its V1 runner.

``RINGFLOW_MUTANT=expert-fetch-without-wait`` (tests/helpers/mutants.py) must fail this module;
the layer ring's mutant (``layer-refill-before-retire``) is killed by
tests/unit/test_expert_layers.py.
"""

import importlib.util

import pytest

from tests.vllm_engine.test_cuda_vllm import POISON, collect, run
from tests.vllm_engine.test_vllm_plugin import max_logprob_diff

pytestmark = pytest.mark.cuda
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (tools/gpu-vllm installs the carried vLLM 0.26)",
                allow_module_level=True)

MODES = ("eager", "default")
MOE = "qwen3_moe128"
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # vLLM 0.26's V2 runner makes no offloader (0.33 does)
TRITON = {"moe_backend": "triton"}
UVA = {"cpu_offload_gb": 1, "cpu_offload_params": ["experts"], **TRITON}
SAMPLED = 1.0  # temperature of the sampled cases (seeded per request)
PLAN = {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"}  # Note [One kernel plans the step]


def lane(slots, **more):
    return {"ringflow": {"name": "experts", "experts": {"layers": "all", "slots": slots,
                                                        **more}}}


#: per case: the profile's experts section, and whether prompts are sampled. layer_tokens 8:
#: the prompts of 8, 14 and 70 tokens take the layer ring, the one of 3 and every decode step
#: the slot cache (both sides of the threshold); 8 slots: those 3 tokens x top-8 need more
#: experts than the slots hold, so steps run in passes (pass 0 and one in place, or, with
#: in_place_tokens 0, every pass through the slots)
LANES = {
    "lane-32": ({"slots": 32, "layer_tokens": 8}, False),
    "lane-32-sampled": ({"slots": 32, "layer_tokens": 8}, True),
    "lane-8": ({"slots": 8, "layer_buffers": 0}, False),
    "passes-8": ({"slots": 8, "layer_buffers": 0, "in_place_tokens": 0}, False),
    "lookahead-32": ({"slots": 32, "lookahead": True, "layer_buffers": 0}, False),
    # layers 0 and 1 held in the ring's buffers for decode too, layers 2 and 3 on 64 slots
    # (Note [Small steps read the held layers]): in FULL decode graphs their waits are
    # external event nodes
    "held-64-sampled": ({"slots": 64, "layer_tokens": 8, "decode_from_ring": True}, True),
    # the same two with each one-pass decode step planned by one kernel (Note [One kernel
    # plans the step]): eager and inside vLLM's FULL decode graphs
    "lane-32-sampled-plan": ({"slots": 32, "layer_tokens": 8, "env": PLAN}, True),
    "held-64-sampled-plan": ({"slots": 64, "layer_tokens": 8, "decode_from_ring": True,
                              "env": PLAN}, True),
}
#: large steps through windows of the slots' own rows (Note [Large steps stream through the
#: slots]): layers 0 and 1 on 64 slots each, one window (layers 2 and 3 are vLLM's, read in
#: place by its UVA offloader), and every layer on 64, two windows; in FULL decode graphs the
#: small steps wait for the carried fill as external event nodes. Processes of their own, so
#: that ``pytest -k arena`` starts only these two
ARENA_LANES = {
    "arena-64-sampled": ({"slots": 64, "layer_tokens": 8, "layers": [0, 1],
                          "layer_buffers": "slots", "engine": UVA}, True),
    "arena-all-64": ({"slots": 64, "layer_tokens": 8, "layer_buffers": "slots",
                      "engine": UVA}, False),
    # no offload flags: ringflow puts layers 1 and 3's experts in host memory as vLLM builds
    # them (Note [Ringflow places the chosen experts]); layers 0 and 2 resident, the prefetch
    # offloader's layout
    "arena-placed-13": ({"slots": 64, "layer_tokens": 8, "layers": [1, 3],
                         "layer_buffers": "slots", "engine": TRITON}, True),
    # the same, each prompt's step started at vLLM's execute_model (Note [Large steps start
    # early]): its top-up issued before vLLM prepares the inputs, on the stream the step runs on
    "arena-early-13": ({"slots": 64, "layer_tokens": 8, "layers": [1, 3],
                        "layer_buffers": "slots", "early_start": True, "engine": TRITON}, True),
    # every layer in host memory, layers 0 and 2 with all 128 experts in their slots (decode
    # computes them as resident layers), 1 and 3 with 64: one arena of their 384 rows, the
    # large steps copying 1 and 3's misses into rows of 0 (then 2) once it ran, the tail
    # copying 0's back: the same device memory as arena-early-13
    "arena-whole-13": ({"slots": {"0": 128, "1": 64, "2": 128, "3": 64}, "layer_tokens": 8,
                        "layer_buffers": "slots", "early_start": True, "engine": TRITON}, True),
}


FP8, FP8T = "qwen3_moe128_fp8", "qwen3_moe128_fp8t"
#: fp8 cases: (model, engine's quantization, the profile's experts section). Blocks: every
#: case exact. Per tensor: steps whose experts exceed the slots are one pass in place (exact)
FP8_LANES = {
    "fp8-lane-32": (FP8, None, {"slots": 32, "layer_tokens": 8}),
    "fp8-lane-8": (FP8, None, {"slots": 8, "layer_buffers": 0}),
    "fp8-passes-8": (FP8, None, {"slots": 8, "layer_buffers": 0, "in_place_tokens": 0}),
    "fp8t-lane-32": (FP8T, None, {"slots": 32, "layer_tokens": 8}),
    "fp8t-passes-8": (FP8T, None, {"slots": 8, "layer_buffers": 0, "in_place_tokens": 0}),
}


#: vLLM's graphs captured at batch 1 only: a batch-1 decode step replays with no padded rows,
#: longer steps run compiled without graphs (Note [fp8 experts])
UNPADDED = {"moe_backend": "triton", "compilation_config": {"cudagraph_capture_sizes": [1]}}
#: per-tensor fp8 under vLLM's CUDA graphs: the largest top-5 logprob gap to all-resident
#: allowed (measured on the H200: 0.53 and 0.59 at 32 slots, 0.49 at 8; eager steps exact):
#: vLLM's padded rows enter the step's one activation scale (Note [fp8 experts]; all-resident
#: vLLM alone, the prompts in the other order: 0.32)
PER_TENSOR_GRAPH_GAP = 0.75


def fp8_cases(mode):
    base = {"mode": mode, "max_tokens": 12, "serial": True, "long_prompt": True}
    cases = [{"name": f"{mode}/fp8-resident", **base, "model": FP8,
              "engine": {"moe_backend": "triton"}},
             {"name": f"{mode}/fp8t-resident", **base, "model": FP8T,
              "engine": {"moe_backend": "triton"}},
             # the control: all resident again, its KV cache elsewhere in memory
             {"name": f"{mode}/fp8t-resident-moved", **base, "model": FP8T,
              "engine": {"moe_backend": "triton", "kv_cache_memory_bytes": 384 << 20}}]
    for name, (model, _, section) in FP8_LANES.items():
        section = dict(section)
        cases.append({"name": f"{mode}/{name}", **base, "model": model, "env": POISON,
                      "engine": TRITON, "additional_config": lane(section.pop("slots"),
                                                                  **section)})
    if mode == "eager":  # vLLM's offloader and weights quantized at load: vLLM's own stop
        cases.append({"name": "refused/fp8-at-load", **base, "model": MOE,
                      "engine": {**UVA, "quantization": "fp8"},
                      "additional_config": lane(32)})
    return cases


def padding_cases(mode):
    """Per-tensor fp8, all resident, the prompts in both orders (what ran before each); under
    graphs also vLLM's graphs captured at batch 1 only, all resident and the lane (the
    harness captures size 4, so a batch-1 decode step pads 3 rows; size 1 pads none)."""
    base = {"mode": mode, "max_tokens": 12, "serial": True, "long_prompt": True, "model": FP8T}
    cases = [{"name": f"{mode}/fp8t-resident", **base, "engine": TRITON},
             {"name": f"{mode}/fp8t-resident-reversed", **base, "engine": TRITON,
              "reverse": True}]
    if mode != "eager":
        cases += [{"name": f"{mode}/fp8t-resident-unpadded", **base, "engine": UNPADDED},
                  {"name": f"{mode}/fp8t-lane-32-unpadded", **base, "env": POISON,
                   "engine": UNPADDED, "additional_config": lane(32, layer_tokens=8)}]
    return cases


def mode_cases(mode, lanes=LANES):
    base = {"model": MOE, "mode": mode, "max_tokens": 12, "serial": True, "long_prompt": True}
    cases = [{"name": f"{mode}/resident", **base, "engine": {"moe_backend": "triton"}},
             {"name": f"{mode}/resident-sampled", **base, "engine": {"moe_backend": "triton"},
              "temperature": SAMPLED}]
    for name, (section, sampled) in lanes.items():
        section = dict(section)
        slots, engine = section.pop("slots"), section.pop("engine", TRITON)
        env = {**POISON, **section.pop("env", {})}
        cases.append({"name": f"{mode}/{name}", **base, "engine": engine, "env": env,
                      "additional_config": lane(slots, **section),
                      **({"temperature": SAMPLED} if sampled else {}),
                      **({"repeat": True} if name == "lane-32" else {})})
    return cases


#: the host share (Note [Host split]): a decode step's misses split between the copy and the
#: host's CPU, forced (0.5, and 1.0: every miss on the CPU) and chosen from the host's rates
#: measured at start-up (auto); slots only, so every decode step takes the cache
HOST_LANES = {
    "host-half": {"slots": 32, "layer_buffers": 0, "host_share": 0.5},
    "host-all": {"slots": 32, "layer_buffers": 0, "host_share": 1.0},
    "host-auto": {"slots": 32, "layer_buffers": 0, "host_share": "auto"},
    # beside the bench's decode layouts: layers 0 and 1 held whole in the ring (no cache, so
    # no host share there), 2 and 3 on 64 slots; the arena over layers 1 and 3 (placed by
    # ringflow), its prompts through rows of the slots. Prompts of 8+ tokens take the
    # held ring or the window, decode steps the caches with half their misses on the CPU
    "host-held-half": {"slots": 64, "layer_tokens": 8, "decode_from_ring": True,
                       "host_share": 0.5},
    "host-arena-half": {"slots": 64, "layer_tokens": 8, "layers": [1, 3],
                        "layer_buffers": "slots", "host_share": 0.5},
    # whole layers in the arena (layers 0 and 2 keep all 128 experts: no misses to share),
    # 1 and 3 on 64 slots with half their decode misses on the CPU
    "host-whole-half": {"slots": {"0": 128, "1": 64, "2": 128, "3": 64}, "layer_tokens": 8,
                        "layer_buffers": "slots", "host_share": 0.5},
    # held layers, half the misses on the CPU, each decode step planned by one kernel that
    # marks the host's experts too (Note [One kernel plans the step])
    "host-held-half-plan": {"slots": 64, "layer_tokens": 8, "decode_from_ring": True,
                            "host_share": 0.5, "env": PLAN},
}
#: the CPU computes its experts' rows with its own GEMMs, rounded where vLLM's kernel rounds
#: but summed in another order (Note [Host rows round as the kernel]), and vLLM's moe_sum sums
#: them with the GPU's rows once (Note [Host experts]): the top-5 logprob gap to all-resident
#: allowed up to and with the first differing token (rows rounded before their router weight
#: measured 0.29-0.54 on the H200)
HOST_GAP = 0.1
#: host_tokens for every host case: the harness captures size 4, so a batch-1 decode step under
#: vLLM's FULL graphs runs 4 rows (3 padded), beyond host_tokens' default of 1; 8 keeps those
#: steps (and the prompt of 3) on the share, as these cases ran on the H100 at 7cc1b8b
HOST_TOKENS = 8
#: block-fp8 rows: vLLM's Triton fp8 GEMM does not sum exactly on Hopper. On an H100 its float32
#: outputs sit on another bf16 than the exact sums in 5.9-7.0% of elements (a float32 GEMM:
#: 0-0.05%; Note [fp8 sums on Hopper], profiles/results/fp8-dot-accuracy-h100.json), and the
#: fp8 requantization between the GEMMs can turn an ulp into a step of an fp8 code. The host
#: sums exactly, so its rows differ from the GPU's at about that rate: the likely cause of the
#: gap (not shown end to end: that needs all-resident vLLM with a GEMM that promotes every 32
#: products). The gap stated in the vLLM README, from the H100's 0.59 (eager, 2 of 4 sequences
#: diverged) and 0.31 (FULL_AND_PIECEWISE, 1) at b9654fc. Its limits: 2 diverged is the
#: measured eager count (no headroom: a third is a failure to look at, not noise to allow);
#: the host's earlier rows, the activation rounded to bf16 first (a44d416: 0.83 and 0.58, 2
#: and 3 of 4 diverged), fail it by the gap eager and by the count under graphs, so the bound
#: tells that from today's rows only just. Not yet run with this bound.
HOST_FP8_GAP = 0.75
HOST_FP8_DIVERGED = 2


def host_cases(mode):
    """The host lanes and their own all-resident controls (bf16, and fp8 in 128x128 blocks),
    in one process per mode (so that ``pytest -k host`` starts only these two)."""
    base = {"model": MOE, "mode": mode, "max_tokens": 12, "serial": True, "long_prompt": True}
    return [{"name": f"{mode}/host-resident", **base, "engine": {"moe_backend": "triton"}},
            {"name": f"{mode}/host-fp8-resident", **base, "model": FP8,
             "engine": {"moe_backend": "triton"}},
            {"name": f"{mode}/host-fp8-half", **base, "model": FP8, "engine": TRITON,
             "env": POISON, "additional_config": lane(32, layer_buffers=0, host_share=0.5,
                                                      host_tokens=HOST_TOKENS)}] + [
        {"name": f"{mode}/{name}", **base, "engine": TRITON,
         "env": {**POISON, **section.get("env", {})},
         "additional_config": lane(section["slots"], host_tokens=HOST_TOKENS,
                                   **{k: v for k, v in section.items()
                                      if k not in ("slots", "env")})}
        for name, section in HOST_LANES.items()]


#: vLLM's prefetch offloader on every other layer's experts (layers 1 and 3)
PREFETCH = {"offload_backend": "prefetch", "offload_group_size": 2, "offload_num_in_group": 1,
            "offload_prefetch_step": 1, "offload_params": ["experts"], **TRITON}
#: a process of its own, so that ``pytest -k prefetch_offloader`` starts only it
PREFETCH_REFUSAL = [{"name": "refused/prefetch-offloader", "model": MOE, "mode": "eager",
                     "engine": PREFETCH, "additional_config": lane(32)}]
AUTO = [
    # slots sized from vLLM's memory budget
    {"name": "auto/eager", "model": MOE, "mode": "eager", "max_tokens": 12, "serial": True,
     "long_prompt": True, "engine": TRITON, "env": POISON, "additional_config": lane("auto")},
]


@pytest.fixture(scope="module")
def runs():
    started = [run(mode_cases(mode), f"experts-{mode}", env=V1) for mode in MODES]
    started.append(run(AUTO, "experts-auto", env=V1))
    return collect(started)


@pytest.fixture(scope="module")
def fp8_runs():
    """The fp8 checkpoints' processes, one per mode (``pytest -k fp8`` starts only these)."""
    return collect([run(fp8_cases(mode), f"experts-fp8-{mode}", env=V1) for mode in MODES])


@pytest.fixture(scope="module")
def padding_runs():
    """Per-tensor fp8's padding cases, one process per mode (``pytest -k padded``)."""
    return collect([run(padding_cases(mode), f"experts-padding-{mode}", env=V1)
                    for mode in MODES])


@pytest.fixture(scope="module")
def prefetch_refusal():
    return collect([run(PREFETCH_REFUSAL, "experts-prefetch-refusal", env=V1)])


@pytest.fixture(scope="module")
def arena_runs():
    return collect([run(mode_cases(mode, ARENA_LANES), f"experts-arena-{mode}", env=V1)
                    for mode in MODES])


@pytest.fixture(scope="module")
def host_runs():
    """With DeepGEMM's power-of-two activation scales (vLLM's default on Hopper and later) the
    host's block-fp8 rows are refused (``host_rows_unlike_vllms``): these processes turn them off,
    for the all-resident controls too."""
    env = {**V1, "VLLM_USE_DEEP_GEMM_E8M0": "0"}
    return collect([run(host_cases(mode), f"experts-host-{mode}", env=env) for mode in MODES])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ARENA_LANES))
def test_large_steps_through_the_slots_give_the_resident_bits(arena_runs, mode, name):
    """``layer_buffers: slots`` (Note [Large steps stream through the slots]): the prompts of
    8, 14 and 70 tokens compute each chosen layer from rows of the slots' own (poisoned)
    rows through an expert map, the next prompt's first layer carried in the tail, and the
    decode steps (eager, or vLLM's FULL decode graphs waiting on the windows' fills) from the
    slots: vLLM's tokens and top-5 logprobs bit for bit, greedy and sampled."""
    test_experts_from_host_memory_give_the_resident_bits(arena_runs, mode, name, ARENA_LANES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LANES))
def test_experts_from_host_memory_give_the_resident_bits(runs, mode, name, lanes=LANES):
    """vLLM's tokens and top-5 logprobs, bit for bit (Note [Same bits as resident]), greedy and
    sampled, one request at a time, with 128 experts of real scale per layer in pinned host
    memory: prompts of 8, 14 and 70 tokens through the layer ring (whole layers copied ahead
    into poisoned buffers, poisoned again after each read), the prompt of 3 and every decode
    step through the slot cache (poisoned slots) with vLLM's kernel on the resident layer's
    tiles; with 8 slots the steps that need more run in passes summed once, the last in place
    from the host view, or, with ``in_place_tokens: 0``, all through the slots; with lookahead,
    decode steps (eager, or vLLM's FULL decode graphs) guess each next layer's experts."""
    section, sampled = lanes[name]
    want = runs[f"{mode}/resident-sampled" if sampled else f"{mode}/resident"]
    got = runs[f"{mode}/{name}"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) == 0.0, max_logprob_diff(got, want)
    layers = got["experts"]
    assert len(layers) == len(section.get("layers", range(4)))
    chosen = len(layers)
    if section.get("layer_buffers") == "slots":  # a layer's worth per 128 rows of the slots
        arena = layers[0]["ring"]
        rows = (sum(section["slots"].values()) if isinstance(section["slots"], dict)
                else chosen * section["slots"])
        assert arena["arena"] and arena["windows"] == rows // 128, arena
        assert arena["carried_steps"] >= arena["steps"] - 1 >= 2, arena
        if section.get("early_start"):  # the 8-, 14- and 70-token prompts, one at a time
            # every prepare used or dropped; eager runs every prompt's step from its prepare,
            # vLLM's graphs may replay the short ones (then dropped, Note [Large steps start
            # early])
            assert arena["early_starts"] == arena["early_used"] + arena["early_dropped"] >= 3
            if mode == "eager":
                assert arena["early_dropped"] == 0, arena
        else:
            assert arena["early_starts"] == 0, arena
    if section.get("decode_from_ring"):  # held layers: every small step reads their buffer
        assert [layer.get("held_in_ring_buffer") for layer in layers] == [0, 1, None, None]
        ring = layers[0]["ring"]
        assert ring["held_reads"] >= 2 and ring["carried_steps"] == ring["steps"] >= 3, ring
        layers = layers[2:]
    for layer in layers:
        slots = (section["slots"][str(layer["layer"])] if isinstance(section["slots"], dict)
                 else section["slots"])
        assert layer["slots"] == slots, layer
        if slots < 128:  # a whole layer's slots miss each expert at most once per large step
            assert layer["misses"] > slots, layer
        # RINGFLOW_EXPERT_PLAN_KERNEL: every one-pass decode step (44 per layer, replays
        # counted on the device) planned by one kernel; otherwise none
        planned = layer["planned_steps"]
        assert (planned >= 4 * 11) if section.get("env") == PLAN else planned == 0, layer
        ring = layer["ring"]
        if section.get("layer_buffers", 2):  # 3 long prompts, plus vLLM's warm-up steps
            assert ring["steps"] >= 3 and ring["fills"] >= chosen * ring["steps"], ring
        else:
            assert ring is None
        if section["slots"] == 8:
            assert (layer["in_place_steps"] > 0) == (name != "passes-8")
    if section["slots"] == 32:  # one-token decode steps reuse what the steps before brought in
        assert all(layer["hits"] > 0 for layer in layers)
    if name == "lane-32":
        assert got["repeat_same"]  # the same engine again: warm cache, same output
    if name == "lookahead-32":  # 4 prompts x 11 decode steps, top-8 guessed per layer
        assert "lookahead" not in layers[0]
        for layer in layers[1:]:
            guessed = layer["lookahead"]
            assert guessed["predicted"] >= 8 * 40 and guessed["chosen"] <= guessed["predicted"], \
                (got.get("cudagraph_mode"), [l for l in got["log"] if "lookahead" in l])
    said = [line for line in got["log"] if line.startswith("experts: layers")
            and "are not in experts.layers" not in line]  # (layers vLLM's offloader took)
    assert len(said) == 1, got["log"]
    placed = [line for line in got["log"] if line.startswith("experts: ringflow put layers")]
    if section.get("engine", TRITON) is TRITON:  # no offload flags: ringflow placed them all
        chosen = section.get("layers", list(range(4)))
        assert len(placed) == 1 and f"layers {chosen}'s" in placed[0], got["log"]
    else:  # vLLM's UVA offloader took every layer (1 GiB): nothing left to place
        assert not placed, got["log"]


def gap_until_divergence(got, want) -> tuple[float, int]:
    """The largest top-5 logprob gap over the positions whose context both runs share (up to
    and with the first differing token), and how many sequences diverged."""
    worst, diverged = 0.0, 0
    for tokens_a, tokens_b, steps_a, steps_b in zip(got["tokens"], want["tokens"], got["top5"],
                                                   want["top5"]):
        for i, (a, b) in enumerate(zip(steps_a, steps_b)):
            mine, theirs = dict(map(tuple, a)), dict(map(tuple, b))
            worst = max([worst] + [abs(mine[t] - theirs[t]) for t in mine if t in theirs])
            if tokens_a[i] != tokens_b[i]:
                diverged += 1
                break
    return worst, diverged


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FP8_LANES))
def test_fp8_experts_from_host_memory_give_the_resident_bits(fp8_runs, mode, name):
    """fp8 routed experts with their scales in the slots and the ring (Note [fp8 experts]):
    the 128x128-block checkpoint bit for bit its all-resident run in every mode of the lane
    (ring, cache, passes in place and through the slots); the per-tensor checkpoint bit for
    bit in eager mode, steps whose experts exceed the slots computed in one pass from the
    host store. Under vLLM's CUDA graphs the per-tensor lane is held to PER_TENSOR_GRAPH_GAP,
    while all-resident vLLM with its KV cache elsewhere must give its own bits."""
    model, _, section = FP8_LANES[name]
    want = fp8_runs[f"{mode}/fp8t-resident" if model == FP8T else f"{mode}/fp8-resident"]
    got = fp8_runs[f"{mode}/{name}"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    said = [line for line in got["log"] if line.startswith("experts: layers")]
    assert len(said) == 1 and "fp8, " in said[0], said
    layers = got["experts"]
    assert len(layers) == 4 and all(layer["whole_in_place"] == (model == FP8T)
                                    for layer in layers)
    if not (model == FP8T and name.endswith("passes-8") and mode != "eager"):
        # (under graphs every step there has 4 rows x top-8 > 8 slots: all in place)
        assert all(layer["misses"] > section["slots"] for layer in layers)
    if model == FP8T and name.endswith("passes-8"):  # steps beyond 8 slots: whole in place
        assert all(layer["in_place_steps"] > 0 for layer in layers)
    if model == FP8T and mode != "eager":  # graphs: the gap stated in the README
        control = fp8_runs[f"{mode}/fp8t-resident-moved"]
        gaps = [gap_until_divergence(r, want) for r in (got, control)]
        print(f"{mode}/{name}: top-5 logprob gap until divergence, diverged sequences: lane "
              f"{gaps[0]}, all resident with its KV cache moved {gaps[1]}")
        assert gaps[1] == (0.0, 0)  # vLLM alone is stable: the gap is the lane's
        assert gaps[0][0] <= PER_TENSOR_GRAPH_GAP, gaps
        return
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) == 0.0, max_logprob_diff(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_per_tensor_fp8_differs_under_graphs_only_through_padded_rows(padding_runs, mode):
    """Why the per-tensor lane is not all-resident's bits under vLLM's graphs (Note [fp8
    experts]): vLLM quantizes a step's activations by one scale, the largest value over the
    step's rows, padded rows included, and a replayed graph's padded rows hold whatever its
    memory held before. So all-resident vLLM's own bits depend on what ran before a request
    there, not in eager mode (no padding); and with graphs captured at batch 1 only (no
    padded decode rows) the lane is bit for bit all-resident under graphs too."""
    want = padding_runs[f"{mode}/fp8t-resident"]
    reversed_ = padding_runs[f"{mode}/fp8t-resident-reversed"]
    for r in (want, reversed_):
        assert "error" not in r, r["error"]
    order_gap = gap_until_divergence(reversed_, want)
    print(f"{mode}: all resident, the prompts in the other order: top-5 logprob gap until "
          f"divergence, diverged sequences {order_gap}")
    if mode == "eager":
        assert reversed_["tokens"] == want["tokens"]
        assert max_logprob_diff(reversed_, want) == 0.0
        return
    want = padding_runs[f"{mode}/fp8t-resident-unpadded"]
    got = padding_runs[f"{mode}/fp8t-lane-32-unpadded"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    lane_gap = gap_until_divergence(got, want)
    print(f"{mode}: graphs captured at batch 1 only, the lane against all resident: {lane_gap}")
    assert got["cudagraph_mode"] == want["cudagraph_mode"] != "NONE", got["cudagraph_mode"]
    assert all(layer["misses"] > 32 for layer in got["experts"]), got["experts"]
    wrong = []  # both claims checked, both printed above
    if got["tokens"] != want["tokens"] or max_logprob_diff(got, want) != 0.0:
        wrong.append(f"the lane with no padded rows is not bit for bit: {lane_gap}")
    if order_gap[0] == 0.0:
        wrong.append("vLLM alone gave its own bits in either order under graphs")
    assert not wrong, wrong


def test_auto_slots_take_a_share_of_vllms_budget_and_give_the_resident_bits(runs):
    """``slots: auto``: the slots per layer come from 25% of what vLLM's budget leaves after the
    weights and the ring (at least top_k, at most the layer's experts), the start-up line says
    so, the KV cache's size follows it, and the tokens are all-resident vLLM's."""
    got, want = runs["auto/eager"], runs["eager/resident"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    said = [line for line in got["log"] if line.startswith("experts: layers")]
    assert len(said) == 1 and "(experts.slots: auto, 25% of the " in said[0] and \
        "that vLLM's budget (--gpu-memory-utilization " in said[0], got["log"]
    assert all(8 <= layer["slots"] <= 128 for layer in got["experts"]), got["experts"]
    assert any(line.startswith("vLLM sized the KV cache at ") for line in got["log"])
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) == 0.0


def test_layers_quantized_at_load_stop_the_start_with_the_fix(fp8_runs):
    got = fp8_runs["refused/fp8-at-load"]
    said = [got.get("error", "")] + got.get("log", [])
    assert any("quantized at load" in line for line in said), got


def test_vllms_prefetch_offloader_on_chosen_layers_stops_the_start_with_the_fix(
        prefetch_refusal):
    """vLLM's prefetch offloader took layers 1 and 3's experts (every other layer): ringflow
    would serve them itself (Note [Ringflow places the chosen experts]), so the start stops
    with one line naming the first and the fix."""
    got = prefetch_refusal["refused/prefetch-offloader"]
    said = [got.get("error", "")] + got.get("log", [])
    assert any("layer 1's routed experts (w13_weight) are on cpu, where vLLM's offloader put "
               "them" in line and "--offload-params" in line for line in said), got


@pytest.mark.parametrize("mode", MODES)
def test_the_host_share_of_block_fp8_experts_stays_within_the_gap(host_runs, mode):
    """fp8 experts in 128x128 blocks, half of each decode step's misses on the CPU, which
    quantizes each GEMM's input as vLLM's kernel does (Note [Host rows round as the
    kernel]): within HOST_FP8_GAP of all-resident vLLM's fp8 run (not HOST_GAP: the GPU's own
    fp8 sums are not exact, Note [fp8 sums on Hopper], the host's are), the host computing at
    every decode step. The gap is printed. On the H100 at a44d416
    (the activation rounded to bf16 before its quantization): 0.83 eager, 0.58
    FULL_AND_PIECEWISE; at b9654fc, with the fused activation of Note [Host rows round as the
    kernel], 0.59 eager (2 sequences diverged), 0.31 FULL_AND_PIECEWISE (1)."""
    want, got = host_runs[f"{mode}/host-fp8-resident"], host_runs[f"{mode}/host-fp8-half"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    gap, diverged = gap_until_divergence(got, want)
    print(f"{mode}/host-fp8-half: top-5 logprob gap until divergence {gap}, diverged {diverged}")
    assert gap <= HOST_FP8_GAP and diverged <= HOST_FP8_DIVERGED, (gap, diverged)
    decode_steps = sum(len(t) - 1 for t in got["tokens"])  # a diverged sequence may end
    for layer in got["experts"]:                            # early (its end-of-text token)
        assert layer["host_share"]["runs"] >= decode_steps and layer["host_computed"] > 0, \
            (decode_steps, layer)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(HOST_LANES))
def test_the_host_share_computes_misses_on_the_cpu_within_bf16_noise(host_runs, mode, name):
    """A decode step hands its share of each layer's misses to the host's CPU (Note [Host
    experts]), inside vLLM's FULL decode graphs in the default mode: the tokens and top-5
    logprobs stay within HOST_GAP of all-resident vLLM (one request at a time, seeded weights
    of real scale), every layer's host computed experts at every decode step (counted by its
    worker, so replays count too), and the start-up line says the share and why."""
    section = HOST_LANES[name]
    want, got = host_runs[f"{mode}/host-resident"], host_runs[f"{mode}/{name}"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    said = [line for line in got["log"] if line.startswith("experts.host_share")]
    assert len(said) == 1, got["log"]
    layers = got["experts"]
    if name == "host-auto" and "predict no gain" in said[0]:
        # off, and said why: the test model's experts (intermediate 96) copy in microseconds
        assert all("host_share" not in layer and layer["host_computed"] == 0
                   for layer in layers)
        assert got["tokens"] == want["tokens"]
        return
    gap, diverged = gap_until_divergence(got, want)
    assert gap <= HOST_GAP and diverged <= 1, (gap, diverged)
    decode_steps = sum(len(t) - 1 for t in got["tokens"])  # 4 prompts, up to 12 tokens each,
    assert decode_steps >= 4 * 10, got["tokens"]  # the first from the prefill
    cached = [layer for layer in layers  # those that miss: not held, not whole
              if "held_in_ring_buffer" not in layer and layer["slots"] < 128]
    assert len(cached) == (4 if section.get("layer_buffers") == 0 else 2), layers
    for layer in cached:
        planned = layer["planned_steps"]  # Note [One kernel plans the step]
        assert (planned >= decode_steps) if section.get("env") == PLAN else planned == 0, layer
        host = layer["host_share"]
        # a run at every decode step; experts at most steps (a step whose experts all hit
        # hands none)
        assert host["runs"] >= decode_steps and host["computed"] >= decode_steps // 2, host
        assert layer["host_computed"] == host["computed"]
    if section["host_share"] == 1.0:  # every decode miss on the CPU: more than at half
        half = host_runs[f"{mode}/host-half"]["experts"]
        assert sum(l["host_computed"] for l in layers) > sum(l["host_computed"] for l in half)
