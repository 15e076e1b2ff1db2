"""The plugin across vLLM's model families, on real vLLM (the CPU build), eager and compiled.

One small model per family (tests/helpers/vllm_e2e.py writes its config and seeded random weights):

=================  ===========  ==========================================================
family             model        what it exercises
=================  ===========  ==========================================================
dense              llama        the plain decoder layer
mla                dsv2         DeepSeek-V2: MLA's W_UV/W_UK_T views of kv_b_proj
moe                qwen3_moe    FusedMoE's stacked expert weights (w13_weight, w2_weight)
sandwich-norm      gemma2       a residual output recomputable from a streamed norm weight
sliding-window     gemma3       sliding-window layers between global ones (2 KV groups)
model.decoder      opt          layers outside ``model.layers``, learned positions, biases
=================  ===========  ==========================================================

Each family streams layers 0, 2 and 3 (three over a ring of two: the count does not divide the
ring; layer 1 stays resident between them) with slots poisoned after use, eager and under
``torch.compile``, against the same engine without streaming and with the same GEMM kernels
(``RINGFLOW_CPU_PLAIN_GEMM=1``); a probe then changes the host copy of every parameter of an
offloaded layer, one at a time, and checks that the output moves (the layer really reads its
slot). Full-KV prefetch runs with ``verify: true``.
"""

import math

import pytest

# without vLLM this import skips the module (or fails it under RINGFLOW_REQUIRE_VLLM=1)
from test_vllm_plugin import POISON, max_logprob_diff, run_cases

FAMILIES = {"dense": "llama", "mla": "dsv2", "moe": "qwen3_moe", "sandwich-norm": "gemma2",
            "sliding-window": "gemma3", "model.decoder": "opt"}
MODES = ("eager", "compiled")
OFFLOAD = [0, 2, 3]
STREAM = {"ringflow": {"name": "zoo", "offload": {"layers": OFFLOAD, "depth": 1,
                                                  "workspace_mib": 64}}}
KV = {"ringflow": {"name": "zoo", "kv_prefetch": {"consumer": "full_kv_check", "depth": 1,
                                                   "workspace_mib": 64, "verify": True}}}
NO_PREFIX_CACHE = {"enable_prefix_caching": False}  # the probe re-runs the same prompts
PLAIN = {"RINGFLOW_CPU_PLAIN_GEMM": "1"}


def zoo_cases():
    cases = []
    for model in FAMILIES.values():
        for mode in MODES:
            eager = mode == "eager"
            cases.append({"name": f"{model}/{mode}/plain", "model": model, "eager": eager,
                          "env": PLAIN, "engine": NO_PREFIX_CACHE})
            cases.append({"name": f"{model}/{mode}/streamed", "model": model, "eager": eager,
                          "env": POISON, "additional_config": STREAM, "probe": True,
                          "engine": NO_PREFIX_CACHE})
        kv_run = {"model": model, "long_prompt": True, "max_tokens": 12}
        cases.append({"name": f"{model}/kv/off", **kv_run})
        cases.append({"name": f"{model}/kv/verified", **kv_run, "env": POISON,
                      "additional_config": KV})
    # a draft model is built through make_layers too, in the same worker load: not streamed
    draft = {"speculative_config": {"method": "draft_model", "model": "DRAFT",
                                    "num_speculative_tokens": 2}}
    cases.append({"name": "llama/spec/plain", "model": "llama", "engine": draft, "env": PLAIN})
    cases.append({"name": "llama/spec/streamed", "model": "llama", "engine": draft,
                  "env": POISON, "additional_config": STREAM})
    return cases


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    results, _ = run_cases(tmp_path_factory.mktemp("zoo"), zoo_cases(), timeout=3000)
    return results


def _first_gap(a, b) -> tuple[int, int] | None:
    """(sequence, step): the first generated step whose top-5 logprobs differ."""
    for seq, (pa, pb) in enumerate(zip(a["top5"], b["top5"])):
        for step, (sa, sb) in enumerate(zip(pa, pb)):
            if sa != sb:
                return seq, step
    return None


def _ok(run):
    assert "error" not in run, run["error"]
    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_weights_give_the_tokens_and_logprobs_of_the_same_engine_without_streaming(
        zoo, family, mode):
    model = FAMILIES[family]
    plain, streamed = _ok(zoo[f"{model}/{mode}/plain"]), _ok(zoo[f"{model}/{mode}/streamed"])
    assert len(set(map(tuple, plain["tokens"]))) > 1  # the model says something
    assert streamed["tokens"] == plain["tokens"]
    gap = max_logprob_diff(streamed, plain)
    # seen once in CI (7.1e-4, dense-eager) and never in reruns: say what each engine ran on
    assert gap < 1e-4, (f"top-5 logprobs {gap:.2e} apart, first at (sequence, step) "
                        f"{_first_gap(streamed, plain)}; torch threads / CPUs of the process: "
                        f"plain {plain.get('threads')}, streamed {streamed.get('threads')}")
    assert streamed["forwards"] and streamed["forwards"][0] >= 8  # the stepper ran every step
    line = next(l for l in streamed["log"] if "streaming the weights" in l)
    assert f"streaming the weights of {len(OFFLOAD)} of 4 decoder layers" in line


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_streamed_parameter_is_read_from_its_slot(zoo, family, mode):
    """Changing the host copy of any one parameter of an offloaded layer changes the output;
    putting it back restores it exactly."""
    probe = _ok(zoo[f"{FAMILIES[family]}/{mode}/streamed"])["probe"]
    restored = probe.pop("(restored)")
    assert restored == 0.0
    assert len(probe) >= 6
    unread = {name: shift for name, shift in probe.items()
              if math.isnan(shift) or shift < 1e-3}
    assert not unread, f"parameters whose host copy does not reach the output: {unread}"


@pytest.mark.parametrize("family", FAMILIES)
def test_full_kv_prefetch_verifies_every_slot(zoo, family):
    model = FAMILIES[family]
    off, run = _ok(zoo[f"{model}/kv/off"]), _ok(zoo[f"{model}/kv/verified"])
    assert run["tokens"] == off["tokens"]
    assert max_logprob_diff(run, off) == 0.0
    [stats] = run["kv"]
    assert stats["layers"] == 4 and stats["steps"] >= 12 and stats["skipped_steps"] == 0
    assert stats["checked"] == 4 * stats["steps"] and stats["mismatches"] == []
    assert stats["layout"] == ("rows" if model == "dsv2" else "pages")


def test_a_draft_models_stack_is_not_taken_for_the_targets(zoo):
    plain, streamed = _ok(zoo["llama/spec/plain"]), _ok(zoo["llama/spec/streamed"])
    assert streamed["tokens"] == plain["tokens"]
    assert max_logprob_diff(streamed, plain) < 1e-4
    assert streamed["forwards"][0] >= 4
