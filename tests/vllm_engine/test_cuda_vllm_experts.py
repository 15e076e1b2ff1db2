"""Routed experts from host memory inside vLLM's CUDA engine (vLLM 0.26 on the H200; Note
[Experts in vLLM]).

A Qwen3-MoE-shaped model (4 layers, 16 experts, top-2, seeded random weights, bf16), one request
at a time (FIELD_NOTES: batched greedy outputs of two GPU engines differ), in eager mode and
vLLM's default FULL_AND_PIECEWISE graphs:

* ``resident``: vLLM alone, every expert in device memory, Triton MoE;
* ``lane-3`` / ``lane-1``: every layer's experts in pinned host memory (vLLM's UVA offloader,
  ``--cpu-offload-params experts``), 3 or 1 slots per layer, slots poisoned: most steps miss,
  prefills need more experts than the slots hold (pass 0, then the rest in place), decode
  steps reuse; ``passes-1``: the same through the slots only (``in_place_tokens: 0``);
  ``lookahead-8``: each layer guesses the next one's experts on a side stream (8 slots: the
  graphs pad decode steps to 4 tokens, and a step of more choices than slots is not guessed);
* a refusal: experts left in device memory (the line names the flags). fp8 experts are refused
  by name (tests/unit/test_experts_profile.py); the carried vLLM 0.26 lacks compressed_tensors,
  which its fp8 path imports, so no fp8 engine starts there.

vLLM 0.26's V2 model runner makes no offloader, so these engines run its V1 runner.

``RINGFLOW_MUTANT=expert-fetch-without-wait`` (tests/helpers/mutants.py) must fail this module.
"""

import importlib.util

import pytest

from tests.vllm_engine.test_cuda_vllm import BF16_NOISE, POISON, collect, run
from tests.vllm_engine.test_vllm_plugin import max_logprob_diff

pytestmark = pytest.mark.cuda
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (tools/gpu-vllm installs the carried vLLM 0.26)",
                allow_module_level=True)

MODES = ("eager", "default")
MOE = "qwen3_moe16"
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # vLLM 0.26's V2 runner makes no offloader (0.33 does)
UVA = {"cpu_offload_gb": 1, "cpu_offload_params": ["experts"], "moe_backend": "triton"}


def lane(slots, **more):
    return {"ringflow": {"name": "experts", "experts": {"layers": "all", "slots": slots,
                                                        **more}}}


def mode_cases(mode):
    base = {"model": MOE, "mode": mode, "max_tokens": 12, "serial": True}
    return [
        {"name": f"{mode}/resident", **base, "engine": {"moe_backend": "triton"}},
        {"name": f"{mode}/lane-3", **base, "engine": UVA, "env": POISON,
         "additional_config": lane(3), "repeat": True},
        {"name": f"{mode}/lane-1", **base, "engine": UVA, "env": POISON,
         "additional_config": lane(1)},
        {"name": f"{mode}/passes-1", **base, "engine": UVA, "env": POISON,
         "additional_config": lane(1, in_place_tokens=0)},
        {"name": f"{mode}/lookahead-8", **base, "engine": UVA, "env": POISON,
         "additional_config": lane(8, lookahead=True)},
    ]


REFUSALS = [
    {"name": "refused/device-memory", "model": MOE, "mode": "eager",
     "engine": {"moe_backend": "triton"}, "additional_config": lane(3)},
]


@pytest.fixture(scope="module")
def runs():
    started = [run(mode_cases(mode), f"experts-{mode}", env=V1) for mode in MODES]
    started.append(run(REFUSALS, "experts-refusals", env=V1))
    return collect(started)


SLOTS = {"lane-3": 3, "lane-1": 1, "passes-1": 1, "lookahead-8": 8}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SLOTS))
def test_experts_from_host_memory_give_the_resident_output(runs, mode, name):
    """vLLM's greedy tokens and top-5 logprobs, with every expert fetched into poisoned slots
    by the device-indexed kernel and computed by vLLM's Triton MoE over the slots; with one
    slot, every step of two or more tokens needs several passes: the last in place from the
    host view (Note [Expert cache], step 5), or with ``in_place_tokens: 0`` all through the
    slots; with lookahead, one-token decode steps (eager, or vLLM's FULL decode graphs) guess
    each next layer's experts on a side stream (Note [Expert lookahead])."""
    slots = SLOTS[name]
    resident, got = runs[f"{mode}/resident"], runs[f"{mode}/{name}"]
    for r in (resident, got):
        assert "error" not in r, r["error"]
    assert got["tokens"] == resident["tokens"]
    assert max_logprob_diff(got, resident) < BF16_NOISE
    layers = got["experts"]
    assert len(layers) == 4
    for layer in layers:
        assert layer["slots"] == slots and layer["misses"] > min(2 * slots, 12)
        assert (layer["in_place_steps"] > 0) == (name != "passes-1")
    if slots > 1:  # one-token decode steps reuse what the steps before brought in
        assert all(layer["hits"] > 0 for layer in layers)
    if name == "lane-3":
        assert got["repeat_same"]  # the same engine again: warm cache, same output
    if name == "lookahead-8":  # 3 prompts x 11 decode steps, top-2 guessed per layer; 8
        # slots: vLLM pads decode steps to the one captured size, 4 tokens (8 choices)
        assert "lookahead" not in layers[0]
        for layer in layers[1:]:
            guessed = layer["lookahead"]
            assert guessed["predicted"] >= 2 * 30 and guessed["chosen"] <= guessed["predicted"], \
                (got.get("cudagraph_mode"), [l for l in got["log"] if "lookahead" in l])
    said = [line for line in got["log"] if line.startswith("experts: layers")]
    assert len(said) == 1, got["log"]


@pytest.mark.parametrize("name, words", [
    ("refused/device-memory", "--cpu-offload-gb 1 --cpu-offload-params experts"),
])
def test_layers_the_gpu_lane_cannot_serve_stop_the_start_with_the_fix(runs, name, words):
    assert words in runs[name].get("error", ""), runs[name]
