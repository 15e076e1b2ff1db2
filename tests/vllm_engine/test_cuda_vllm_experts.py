"""Routed experts from host memory inside vLLM's CUDA engine (vLLM 0.26 on the H200; Note
[Experts in vLLM]), bit for bit what all-resident vLLM computes (Note [Same bits as resident]).

A Qwen3-MoE-shaped model (4 layers, 128 experts of intermediate 96, top-8: vLLM has tuned H200
tiles for that layer and none for a cache's slots; seeded random weights of real scale, bf16),
one request at a time (FIELD_NOTES: batched outputs of two GPU engines differ), prompts of 3, 8,
14 and 70 tokens, greedy and sampled (temperature 1, a seed per request), in eager mode and
vLLM's default FULL_AND_PIECEWISE graphs:

* ``resident`` / ``resident-sampled``: vLLM alone, every expert in device memory, Triton MoE;
* ``lane-32`` / ``lane-32-sampled``: every layer's experts in pinned host memory (vLLM's UVA
  offloader, ``--cpu-offload-params experts``), 32 slots per layer and a ring of 2 layers,
  ``layer_tokens: 8``: the prompts of 8 tokens or more through the ring, the rest through the
  cache (Note [Expert lane modes]); slots and ring buffers poisoned;
* ``lane-8`` / ``passes-8``: 8 slots, no ring: steps of more experts than the slots hold run
  in passes (the last in place from the host view, or all through the slots), summed once;
* ``lookahead-32``: each layer guesses the next one's experts on a side stream;
* a refusal: experts left in device memory (the line names the flags). fp8 experts are refused
  by name (tests/unit/test_experts_profile.py).

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
UVA = {"cpu_offload_gb": 1, "cpu_offload_params": ["experts"], "moe_backend": "triton"}
SAMPLED = 1.0  # temperature of the sampled cases (seeded per request)


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
}


def mode_cases(mode):
    base = {"model": MOE, "mode": mode, "max_tokens": 12, "serial": True, "long_prompt": True}
    cases = [{"name": f"{mode}/resident", **base, "engine": {"moe_backend": "triton"}},
             {"name": f"{mode}/resident-sampled", **base, "engine": {"moe_backend": "triton"},
              "temperature": SAMPLED}]
    for name, (section, sampled) in LANES.items():
        slots = section.pop("slots")
        cases.append({"name": f"{mode}/{name}", **base, "engine": UVA, "env": POISON,
                      "additional_config": lane(slots, **section),
                      **({"temperature": SAMPLED} if sampled else {}),
                      **({"repeat": True} if name == "lane-32" else {})})
        section["slots"] = slots
    return cases


REFUSALS = [
    {"name": "refused/device-memory", "model": MOE, "mode": "eager",
     "engine": {"moe_backend": "triton"}, "additional_config": lane(3)},
]


@pytest.fixture(scope="module")
def runs():
    started = [run(mode_cases(mode), f"experts-{mode}", env=V1) for mode in MODES]
    started.append(run(REFUSALS, "experts-refusals", env=V1))
    return collect(started)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LANES))
def test_experts_from_host_memory_give_the_resident_bits(runs, mode, name):
    """vLLM's tokens and top-5 logprobs, bit for bit (Note [Same bits as resident]), greedy and
    sampled, one request at a time, with 128 experts of real scale per layer in pinned host
    memory: prompts of 8, 14 and 70 tokens through the layer ring (whole layers copied ahead
    into poisoned buffers, poisoned again after each read), the prompt of 3 and every decode
    step through the slot cache (poisoned slots) with vLLM's kernel on the resident layer's
    tiles; with 8 slots the steps that need more run in passes summed once, the last in place
    from the host view, or, with ``in_place_tokens: 0``, all through the slots; with lookahead,
    decode steps (eager, or vLLM's FULL decode graphs) guess each next layer's experts."""
    section, sampled = LANES[name]
    want = runs[f"{mode}/resident-sampled" if sampled else f"{mode}/resident"]
    got = runs[f"{mode}/{name}"]
    for r in (want, got):
        assert "error" not in r, r["error"]
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) == 0.0, max_logprob_diff(got, want)
    layers = got["experts"]
    assert len(layers) == 4
    for layer in layers:
        assert layer["slots"] == section["slots"] and layer["misses"] > section["slots"]
        ring = layer["ring"]
        if section.get("layer_buffers", 2):  # 3 long prompts, plus vLLM's warm-up steps
            assert ring["steps"] >= 3 and ring["fills"] >= 4 * ring["steps"], ring
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
    said = [line for line in got["log"] if line.startswith("experts: layers")]
    assert len(said) == 1, got["log"]


@pytest.mark.parametrize("name, words", [
    ("refused/device-memory", "--cpu-offload-gb 1 --cpu-offload-params experts"),
])
def test_layers_the_gpu_lane_cannot_serve_stop_the_start_with_the_fix(runs, name, words):
    assert words in runs[name].get("error", ""), runs[name]
