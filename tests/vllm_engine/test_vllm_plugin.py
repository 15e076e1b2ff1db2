"""The vLLM plugin end to end on real vLLM (the CPU build), tiny models written by the test.

Each case starts vLLM on a tiny Llama or DeepSeek-V2 (MLA) model with random weights and
generates greedily with top-5 logprobs. "plain" is ringflow off with the same CPU GEMM kernels
ringflow uses (RINGFLOW_CPU_PLAIN_GEMM=1); streamed runs must match it exactly. "off" is vLLM's
default (packed oneDNN GEMMs), which differs from plain F.linear by rounding only.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from helpers.vllm_required import require_vllm  # noqa: E402

require_vllm(module_level=True)

POISON = {"RINGFLOW_POISON": "1"}  # a slot read after its layer ran would be NaN


def ring(layers, depth, mib=64):
    return {"ringflow": {"name": "t", "offload": {"layers": layers, "depth": depth,
                                                 "workspace_mib": mib}}}


STREAMED = {
    "all_d1": ring("all", 1),            # 4 layers over a ring of 2: divides
    "odd_d1": ring([1, 2, 3], 1),        # 3 over 2, layer 0 resident
    "all_d2": ring("all", 2),            # 4 over 3
    "some_d2": ring([0, 2], 2),          # 2 over 3, resident layers between
    "group_d0": ring({"every": 2, "last": 1}, 0),  # synchronous path
    "count_d1": ring({"count": 2}, 1),   # the planner places 2 layers
}
SLOT = {"shape": [4], "dtype": "float32"}


def kv(depth, mib=64, **extra):
    """The full-KV check mode: every layer's full context KV gathered and verified."""
    return {"ringflow": {"name": "t", "kv_prefetch": {
        "consumer": "full_kv_check", "depth": depth, "workspace_mib": mib, "verify": True},
        **extra}}


def ctx(depth=1, verify=False, mib=16):
    """MLA's context chunks read from the ring (the default consumer)."""
    return {"ringflow": {"name": "c", "kv_prefetch": {"depth": depth, "workspace_mib": mib,
                                                     "verify": verify,
                                                     "min_context_tokens": 0}}}


# several concurrent requests of different lengths, one longer than a prefill chunk, 12 steps
KV_RUN = {"long_prompt": True, "max_tokens": 12}
KV_ENGINE = {"llama": {"enable_chunked_prefill": True, "max_num_batched_tokens": 32},
             "dsv2": {}}  # vLLM-CPU turns chunked prefill off for MLA
BAD = {
    "missing_layer": (ring([1, 9], 1), "layers [9] do not exist: the model has 4"),
    "tiny_ring": (ring("all", 1, mib=1), "smaller than one offloaded layer's weights"),
    "no_offload": ({"ringflow": {"layers": 4, "depth": 1, "workspace_mib": 1, "slot": SLOT}},
                   "is not a vLLM profile: it has depth, layers, slot, workspace_mib"),
    "tiny_kv_ring": (kv(1, mib=0.5), "smaller than one full-KV slot"),
    "unread_full_kv": ({"ringflow": {"name": "t", "kv_prefetch": {"consumer": "full_kv_check",
                                                              "workspace_mib": 8}}},
                       "set verify: true with it"),
}


def cases_for(model, dump):
    cases = [{"name": f"{model}/off", "model": model},
             {"name": f"{model}/plain", "model": model, "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}}]
    for name, config in STREAMED.items():
        if model == "dsv2" and name in ("some_d2", "group_d0", "count_d1"):
            continue
        env = dict(POISON)
        if name == "odd_d1":
            env["RINGFLOW_DUMP"] = str(dump)
        cases.append({"name": f"{model}/{name}", "model": model, "env": env,
                      "additional_config": config})
    base = {"model": model, "engine": KV_ENGINE[model], **KV_RUN}
    cases.append({"name": f"{model}/kv/off", **base})
    for depth in (0, 1, 2):
        cases.append({"name": f"{model}/kv/d{depth}", **base, "env": dict(POISON),
                      "additional_config": kv(depth)})
    if model == "llama":  # both lanes at once: weights streamed, full KV prefetched
        cases.append({"name": "llama/kv/plain", **base, "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}})
        cases.append({"name": "llama/kv/with_weights", **base, "env": dict(POISON),
                      "additional_config": kv(1, offload={"layers": [1, 2, 3], "depth": 1,
                                                          "workspace_mib": 64})})
        draft = {"speculative_config": {"method": "draft_model", "model": "DRAFT",
                                        "num_speculative_tokens": 2}}
        cases.append({"name": "llama/spec/off", "model": model, "engine": draft})
        cases.append({"name": "llama/spec/kv", "model": model, "engine": draft,
                      "env": dict(POISON), "additional_config": kv(1)})
        # weights changed in place: checkpoint B by path, then A and B as iterators
        cases += [{"name": "llama/reload/plain_b", "model": model, "seed": 1,
                   "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}},
                  {"name": "llama/reload/plain", "model": model, "reload": True,
                   "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}},
                  {"name": "llama/reload/streamed", "model": model, "reload": True,
                   "verbs": 2, "env": dict(POISON), "additional_config": ring([1, 2, 3], 1)}]
        compiled = {"model": model, "eager": False}  # torch.compile on the CPU
        cases += [{"name": "llama/reload/compiled/plain", **compiled,
                   "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}},
                  {"name": "llama/reload/compiled/plain_b", **compiled, "seed": 1,
                   "env": {"RINGFLOW_CPU_PLAIN_GEMM": "1"}},
                  {"name": "llama/reload/compiled/streamed", **compiled, "reload": True,
                   "env": dict(POISON), "additional_config": ring([1, 2, 3], 1)}]
        cases.append({"name": "llama/layer_ops_only_with_offload", "model": model,
                      "env": {"RINGFLOW_LAYER_OPS_ONLY": "1"},
                      "additional_config": ring([1, 2, 3], 1)})
        for name, (config, _) in BAD.items():
            cases.append({"name": f"llama/bad/{name}", "model": model,
                          "additional_config": config})
    return cases


def run_cases(tmp, cases, env=None, timeout=1500):
    path_in, path_out = tmp / "cases.json", tmp / "results.json"
    path_in.write_text(json.dumps(cases))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_DISABLE_COMPILE_CACHE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, str(HERE.parent / "helpers" / "vllm_e2e.py"), str(path_in), str(path_out)],
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # vLLM logs to stdout (VLLM_LOGGING_STREAM), ringflow's lines with it, through its handlers
    return {r["name"]: r for r in json.loads(path_out.read_text())}, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    results, _ = run_cases(tmp, cases_for("llama", tmp / "dag") + cases_for("dsv2", tmp / "x"))
    return results, tmp


def same(a, b):
    assert "error" not in a, a["error"]
    assert "error" not in b, b["error"]
    assert a["tokens"] == b["tokens"]
    assert a["top5"] == b["top5"]


def max_logprob_diff(a, b):
    return max(abs(x[1] - y[1]) for pa, pb in zip(a["top5"], b["top5"])
               for sa, sb in zip(pa, pb) for x, y in zip(sa, sb))


@pytest.mark.parametrize("model", ["llama", "dsv2"])
def test_streamed_weights_give_identical_tokens_and_top5_logprobs(eager, model):
    results, _ = eager
    plain = results[f"{model}/plain"]
    streamed = [r for n, r in results.items() if n.startswith(f"{model}/")
                and n.split("/")[1] in STREAMED]
    assert len(streamed) >= 3
    for run in streamed:
        same(run, plain)
        assert run["forwards"] and run["forwards"][0] >= 8  # prefill + decode steps, stepped


@pytest.mark.parametrize("model", ["llama", "dsv2"])
def test_plain_gemm_differs_from_vllms_packed_default_only_by_rounding(eager, model):
    results, _ = eager
    off, plain = results[f"{model}/off"], results[f"{model}/plain"]
    assert off["tokens"] == plain["tokens"]
    assert max_logprob_diff(off, plain) < 1e-4
    assert not off["lifecycle"] and not any("streaming" in l for l in off["log"])


def test_the_ring_exists_before_vllm_allocates_the_kv_cache_and_the_log_states_its_cost(eager):
    """On a CPU vLLM sizes its KV cache from its own setting: the log says the ring does not
    shrink it (#38: it used to name a cost in KV tokens that the KV cache never paid), and the
    KV cache is the same size with and without streaming."""
    results, _ = eager
    for name in STREAMED:
        run = results[f"llama/{name}"]
        assert run["lifecycle"] == ["ring-allocated", "kv-cache-initialized"], run["lifecycle"]
        line = next(l for l in run["log"] if "streaming the weights" in l)
        assert "allocated before the KV cache is sized; on a CPU vLLM sizes its KV cache from " \
               "its own setting" in line and "KV tokens" not in line, line
        assert run["kv_blocks"] == results["llama/off"]["kv_blocks"]


def test_a_count_of_layers_is_placed_by_the_planner_and_logged(eager):
    results, _ = eager
    line = next(l for l in results["llama/count_d1"]["log"] if "the planner placed layers" in l)
    placed = json.loads(line.split("placed layers ")[1].split(" (")[0])
    assert len(placed) == 2 and placed == sorted(set(placed))
    assert "estimated from the weights" in line and "not measured" in line
    assert "streaming the weights of 2 of 4 decoder layers" in " ".join(
        results["llama/count_d1"]["log"])


def test_ringflow_dump_writes_the_plan_that_ran(eager):
    results, tmp = eager
    assert "error" not in results["llama/odd_d1"]
    doc = json.loads((tmp / "dag.json").read_text())
    assert doc["schema"] == "ringflow.dag" and doc["layers"] == 4
    assert doc["meta"]["gathered"] == [1, 2, 3]
    assert (tmp / "dag.dot").read_text().startswith("digraph")


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_profiles_stop_vllm_at_start_up_with_one_clear_message(eager, bad):
    results, _ = eager
    run = results[f"llama/bad/{bad}"]
    needle = BAD[bad][1]
    assert "error" in run and "tokens" not in run
    assert needle in run["error"]
    assert sum(needle in line for line in run["log"]) == 1  # logged once, before vLLM unwinds


def test_the_plugin_loads_in_vllms_worker_process_with_multiprocessing_on(tmp_path, eager):
    results, _ = eager
    profile = tmp_path / "p.yaml"
    profile.write_text("name: mp\noffload: {layers: [1, 2, 3], depth: 1, workspace_mib: 64}\n")
    cases = [{"name": "mp", "model": "llama", "env": POISON}]
    mp, stderr = run_cases(tmp_path, cases, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                 "RINGFLOW_PROFILE": str(profile)})
    assert mp["mp"]["tokens"] == results["llama/plain"]["tokens"]
    assert "ringflow: profile 'mp': streaming the weights of 3 of 4 decoder layers" in stderr


@pytest.mark.parametrize("run", ["plain", "streamed"])
def test_reloaded_weights_reach_every_layer_streamed_or_resident(eager, run):
    """vLLM's reload_weights (from a path, and as an iterator through model.load_weights) on
    a model whose layers 1-3 stream with cross-forward prefetch: each generate after a reload
    equals a fresh engine on that checkpoint, token for token and logprob for logprob."""
    results, _ = eager
    a, b = results["llama/plain"], results["llama/reload/plain_b"]
    got = results[f"llama/reload/{run}"]
    same(got, a)
    assert a["tokens"] != b["tokens"]  # the two checkpoints are told apart
    for name, want in (("path_b", b), ("iter_a", a), ("iter_b", b)):
        tokens, top5 = got["reloads"][name]
        assert tokens == want["tokens"] and top5 == want["top5"], name
    if run == "streamed":
        reloads = 3 + 2 * 2  # these three, then two cycles of B and A (the verbs test)
        assert sum("host copies hold the new weights" in l for l in got["log"]) == reloads


def test_reloaded_weights_reach_streamed_layers_under_torch_compile(eager):
    """The same under vLLM's compiled mode (the CPU's torch.compile): tokens equal to fresh
    compiled engines on each checkpoint, logprobs within the rounding a different compiled
    partition gives."""
    results, _ = eager
    a, b = results["llama/reload/compiled/plain"], results["llama/reload/compiled/plain_b"]
    got = results["llama/reload/compiled/streamed"]
    assert "error" not in got, got["error"]
    assert got["tokens"] == a["tokens"] != b["tokens"]
    for name, want in (("path_b", b), ("iter_a", a), ("iter_b", b)):
        tokens, top5 = got["reloads"][name]
        assert tokens == want["tokens"], name
        assert max_logprob_diff({"top5": top5}, want) < 1e-4, name


def test_sleep_and_weight_transfer_are_refused_and_the_engine_goes_on(eager):
    """After the reloads: sleep(level=1|2) and the weight-transfer calls each raise one
    EngineError line at the call, sleep(level=0) and its wake-up run; generates after them (and
    after two more reload cycles) equal fresh engines on the checkpoint last loaded, so no
    refused sleep left the scheduler paused."""
    results, _ = eager
    a, b = results["llama/plain"], results["llama/reload/plain_b"]
    got = results["llama/reload/streamed"]
    verbs = got["verbs"]
    assert set(verbs["calls"]) == {"sleep_level_1", "sleep_level_2",
                                   "init_weight_transfer_engine", "start_weight_update"}
    for name, error in verbs["calls"].items():
        assert error is not None and error.startswith("EngineError"), (name, error)
        assert "not supported while ringflow streams weights" in error, (name, error)
    said = [l for l in got["log"] if "not supported while ringflow streams weights" in l]
    assert len(said) == 4, said
    assert verbs["level_0"] is None, verbs["level_0"]  # pausing the scheduler moves nothing
    for name, want in (("after_calls", b), ("last_b", b), ("last_a", a)):
        tokens, top5 = verbs[name]
        assert tokens == want["tokens"] and top5 == want["top5"], name


def test_engine_sleep_is_refused_before_vllm_pauses_its_scheduler(monkeypatch):
    from types import SimpleNamespace

    from ringflow import EngineError
    from ringflow.integrations.vllm import weights
    from ringflow.integrations.vllm.state import PluginState

    calls = []
    streamed = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"ringflow": {
        "name": "s", "offload": {"layers": [1], "workspace_mib": 64}}}))
    plain = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    monkeypatch.delenv("RINGFLOW_LAYER_OPS_ONLY", raising=False)

    def sleep(core, level=1, mode="abort"):
        calls.append(level)

    weights.on_engine_sleep(PluginState(), sleep, plain, 1)
    weights.on_engine_sleep(PluginState(), sleep, streamed, 0)  # level 0 moves no memory
    with pytest.raises(EngineError, match=r"sleep\(level=2\) is not supported .*\(profile 's'\)"):
        weights.on_engine_sleep(PluginState(), sleep, streamed, level=2)
    monkeypatch.setenv("RINGFLOW_LAYER_OPS_ONLY", "1")  # nothing streamed: vLLM's own sleep
    weights.on_engine_sleep(PluginState(), sleep, streamed, 1)
    assert calls == [1, 0, 1]


def test_lora_with_weight_streaming_is_refused_in_the_front_end(monkeypatch):
    from types import SimpleNamespace

    from ringflow import ConfigError
    from ringflow.integrations.vllm import frontend
    from ringflow.integrations.vllm.state import PluginState

    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    monkeypatch.delenv("RINGFLOW_LAYER_OPS_ONLY", raising=False)
    streamed = {"ringflow": {"name": "s", "offload": {"layers": [1], "workspace_mib": 64}}}
    kv = {"ringflow": {"name": "k", "kv_prefetch": {"depth": 1, "workspace_mib": 16,
                                                    "min_context_tokens": 0}}}
    started = []

    def create(args):
        started.append(args)

    args = SimpleNamespace(additional_config=streamed, enable_lora=True)
    with pytest.raises(ConfigError, match=r"LoRA \(enable_lora\) is not supported while "
                                          r"ringflow streams weights \(profile 's'"):
        frontend.on_create_engine_config(PluginState(), create, args)
    for ok_args in (SimpleNamespace(additional_config=streamed, enable_lora=False),
                    SimpleNamespace(additional_config=kv, enable_lora=True)):
        frontend.on_create_engine_config(PluginState(), create, ok_args)
    assert len(started) == 2


def test_weight_calls_streaming_cannot_follow_are_refused_with_one_line(caplog):
    from types import SimpleNamespace

    from ringflow import EngineError
    from ringflow.integrations.vllm import surfaces, weights
    from ringflow.integrations.vllm.state import PluginState

    class Runner:  # the state keys each streamer by its model runner
        pass

    class Streamer:
        reserved_bytes = 0

    calls = []
    sleep = surfaces.by_key()["vllm.v1.worker.gpu_worker.Worker.sleep"]
    hook = weights.refusal(sleep)
    state = PluginState()
    worker = SimpleNamespace(model_runner=Runner())
    assert hook(state, lambda w, level: calls.append(level), worker, 1) is None
    assert calls == [1]  # not streaming: vLLM's own call
    streamer = Streamer()  # kept alive: the state holds it only while the runner lives
    state.add_streamer(worker.model_runner, streamer)
    with pytest.raises(EngineError, match="sleep is not supported while ringflow streams"):
        hook(state, lambda w, level: calls.append(level), worker, 1)
    assert calls == [1]
    refused = {s.path.rpartition(".")[2] for s in surfaces.SURFACES
               if s.hook and s.hook.endswith(":refusal")}
    assert refused >= {"sleep", "wake_up", "update_weights", "discard", "extend_kv_cache",
                       "set_kv_cache_reclaimable"}


def test_layer_ops_only_streams_nothing_even_with_an_offload_section(eager):
    results, _ = eager
    run, off = results["llama/layer_ops_only_with_offload"], results["llama/off"]
    assert "error" not in run, run["error"]
    assert run["tokens"] == off["tokens"] and max_logprob_diff(run, off) < 1e-5
    assert "ring-allocated" not in run["lifecycle"] and run["forwards"] == []
    assert sum("offload section is not streamed" in l for l in run["log"]) == 1, run["log"]
    assert any("decoder layers run between ringflow's layer ops (the first, the last and the "
               "offloaded ones" in l for l in run["log"]), run["log"]


def test_the_plugin_is_inert_without_a_profile(eager):
    """Nothing but, once per process, the line saying the plugin is installed and idle."""
    results, _ = eager
    logs = results["llama/off"]["log"] + results["llama/plain"]["log"]
    assert all(" installed and idle (no profile" in line for line in logs), logs


@pytest.mark.parametrize("model", ["llama", "dsv2"])
def test_prefetched_full_kv_equals_the_paged_kv_of_every_layer_and_step(eager, model):
    """Verification mode: every slot equal to its layer's cache (pages for Llama's packed
    CPU_ATTN cache, token rows for MLA), across prefill chunks and decode steps of four
    requests of different lengths; greedy output identical with the wrapper off."""
    results, _ = eager
    off = results[f"{model}/kv/off"]
    assert "error" not in off, off["error"]
    for depth in (0, 1, 2):
        run = results[f"{model}/kv/d{depth}"]
        same(run, off)
        [stats] = run["kv"]
        assert stats["layers"] == 4 and stats["depth"] == depth
        assert stats["steps"] >= 12 and stats["skipped_steps"] == 0
        assert stats["checked"] == 4 * stats["steps"], stats
        assert stats["mismatches"] == []
        assert stats["layout"] == ("rows" if model == "dsv2" else "pages")
        assert stats["retired"] >= 1          # the KV cache bind retired all per-step state
        assert run["lifecycle"] == ["kv-ring-allocated", "kv-cache-initialized"]
    if model == "llama":
        assert results["llama/kv/d1"]["kv"][0]["steps"] > 12   # the long prompt took 3 chunks


def test_mla_attention_over_the_prefetched_slot_matches_the_backend(eager):
    for depth in (0, 1, 2):
        [stats] = eager[0][f"dsv2/kv/d{depth}"]["kv"]
        assert stats["attention_checked"] == stats["checked"]
        assert stats["attention_max_error"] < 1e-4


def test_weight_streaming_and_kv_prefetch_run_together(eager):
    results, _ = eager
    run = results["llama/kv/with_weights"]
    same(run, results["llama/kv/plain"])
    assert run["kv"][0]["mismatches"] == [] and run["kv"][0]["checked"] > 0
    assert run["lifecycle"] == ["kv-ring-allocated", "ring-allocated", "kv-cache-initialized"]


def test_a_speculative_draft_model_gets_lanes_of_its_own(eager):
    """Target and draft are separate model loads: separate rings and plans, both verified."""
    results, _ = eager
    run = results["llama/spec/kv"]
    same(run, results["llama/spec/off"])
    target, draft = run["kv"]
    assert target["steps"] > 0 and draft["steps"] > target["steps"]  # 2 drafts per target step
    for stats in (target, draft):
        assert stats["mismatches"] == [] and stats["checked"] == 4 * stats["steps"]
    rings = [l for l in run["log"] if l.startswith("full-KV ring")]
    assert len(rings) == 2 and rings[0].split("'")[1] != rings[1].split("'")[1]
    assert not any("abandoned" in l for l in run["log"])


# -- MLA context chunks read from the ring -------------------------------------------------------

#: a 64-row context workspace: the 128- and 64-token cached prefixes of one step take 3 chunks
CHUNKED = {"prefix_caching": True, "workspace_rows": 64}
CONTEXT_CASES = [
    {"name": "ctx/off", "context": CHUNKED},
    {"name": "ctx/d1", "context": CHUNKED, "env": POISON, "additional_config": ctx(1)},
    {"name": "ctx/d2", "context": CHUNKED, "env": POISON, "additional_config": ctx(2)},
    {"name": "ctx/d0", "context": CHUNKED, "env": POISON, "additional_config": ctx(0)},
    {"name": "ctx/verify", "context": CHUNKED, "additional_config": ctx(1, verify=True)},
    {"name": "ctx/corrupt", "context": {**CHUNKED, "corrupt": True},
     "additional_config": ctx(1)},
    {"name": "ctx/chunked/off", "context": {**CHUNKED, "chunk": 48}},
    {"name": "ctx/chunked/d1", "context": {**CHUNKED, "chunk": 48}, "env": POISON,
     "additional_config": ctx(1)},
    # a threshold above these contexts leaves their steps to vLLM
    {"name": "ctx/short", "context": CHUNKED, "env": POISON, "additional_config": {
        "ringflow": {"name": "c", "kv_prefetch": {"depth": 1, "workspace_mib": 16,
                                                  "min_context_tokens": 65536}}}},
    # min_context_tokens omitted: on one rank every step is vLLM's, nothing reserved
    {"name": "ctx/default", "context": CHUNKED, "env": POISON, "additional_config": {
        "ringflow": {"name": "c", "kv_prefetch": {"depth": 1, "workspace_mib": 16}}}},
    {"name": "ctx/whole/off", "context": {"prefix_caching": True}},
    {"name": "ctx/whole/d1", "context": {"prefix_caching": True}, "env": POISON,
     "additional_config": ctx(1)},
]


@pytest.fixture(scope="module")
def context_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ctx")
    cases = [{**c, "model": "dsv2", "max_tokens": 6} for c in CONTEXT_CASES]
    for case in cases:
        if case["name"] == "ctx/d1":
            case["env"] = {**case["env"], "RINGFLOW_DUMP": str(tmp / "ctx")}
    cases += [{"name": "ctx/llama/off", "model": "llama"},
              {"name": "ctx/llama/d1", "model": "llama", "additional_config": ctx(1)}]
    results, _ = run_cases(tmp, cases)
    return results, tmp


@pytest.mark.parametrize("name", ["ctx/d1", "ctx/d2", "ctx/d0", "ctx/chunked/d1",
                                  "ctx/whole/d1"])
def test_mla_reads_its_context_chunks_from_the_ring_with_identical_output(context_runs, name):
    """Prefix-cache hits over several context chunks: every layer after the first reads each
    chunk from a ring slot (poisoned after its read), and the output is identical."""
    runs, _ = context_runs
    run = runs[name]
    same(run, runs[name.rsplit("/", 1)[0] + "/off"])
    [stats] = run["context"]
    assert stats["layers"] == 4 and stats["abandoned"] == {}, stats
    assert stats["steps"] >= 1
    layers, chunks = max(stats["plans"], key=lambda p: p[1])
    assert layers == 3  # the first layer records the step's gathers, the other 3 read slots
    if "whole" not in name:
        assert chunks > 1  # a context spanning several chunks of the 64-row workspace
    assert stats["consumed"] == sum(3 * c for _, c in stats["plans"]) or stats["steps"] > 1
    assert run["lifecycle"] == ["context-ring-allocated", "kv-cache-initialized"]


def test_a_corrupted_context_slot_changes_the_output(context_runs):
    """The attention reads the slot, not vLLM's own gather: +1 on every slot moves logprobs."""
    runs, _ = context_runs
    off, bad = runs["ctx/off"], runs["ctx/corrupt"]
    assert "error" not in bad, bad["error"]
    assert bad["context"][0]["consumed"] > 0
    assert max_logprob_diff(bad, off) > 1e-2 or bad["tokens"] != off["tokens"]


def test_verify_checks_every_consumed_context_slot_against_vllms_gather(context_runs):
    runs, _ = context_runs
    run = runs["ctx/verify"]
    same(run, runs["ctx/off"])
    [stats] = run["context"]
    assert stats["checked"] == stats["consumed"] > 0 and stats["mismatches"] == []
    assert any("verify: 1 consumed context slot(s) checked against vLLM's own gather, 0 "
               "differed" in line for line in run["log"]), run["log"]


def test_one_gpu_is_left_to_vllm_by_default_with_nothing_reserved_said_once(context_runs):
    """Note [Short context]: with min_context_tokens omitted on one rank no MLA layer attaches,
    no ring is reserved, the output is vLLM's, and one line says what the profile does."""
    runs, _ = context_runs
    run = runs["ctx/default"]
    same(run, runs["ctx/off"])
    assert run["context"] == [] and "context-ring-allocated" not in run["lifecycle"]
    said = [l for l in run["log"] if "without decode context parallelism (one rank)" in l]
    assert len(said) == 1 and "reserves nothing" in said[0], run["log"]
    # its steps run no more of ringflow's code than an engine without the profile: the same
    # calls, function by function, over the prefix-hit round (nothing to be slower by)
    assert run["ringflow_calls"] == runs["ctx/off"]["ringflow_calls"], (
        run["ringflow_calls"], runs["ctx/off"]["ringflow_calls"])
    d1 = runs["ctx/d1"]["ringflow_calls"]  # the counter sees the consumer when it runs
    assert sum(d1.values()) > sum(run["ringflow_calls"].values()) + 10, d1


def test_steps_below_min_context_tokens_are_left_to_vllm_and_said_once(context_runs):
    """Note [Short context] on vLLM's CPU build: contexts of a few hundred tokens are under a
    threshold of 65,536, counted from vLLM's own chunk metadata; nothing is planned or read
    from the ring, the output is vLLM's, and the log says so once."""
    runs, _ = context_runs
    run = runs["ctx/short"]
    same(run, runs["ctx/off"])
    [stats] = run["context"]
    assert stats["consumed"] == 0 and stats["steps"] == 0 and stats["short_steps"] >= 1, stats
    said = [l for l in run["log"] if "min_context_tokens is 65536" in l]
    assert len(said) == 1 and "counted from vLLM's chunk metadata" in said[0], run["log"]


def test_layers_without_a_consumer_gather_nothing_and_say_so_once(context_runs):
    runs, _ = context_runs
    run = runs["ctx/llama/d1"]
    same(run, runs["ctx/llama/off"])
    assert run["context"] == [] and run["kv"] == [] and run["lifecycle"] == []
    said = [l for l in run["log"] if "have no consumer of prefetched KV" in l]
    assert len(said) == 1, run["log"]


def test_ringflow_dump_writes_each_context_plan_once(context_runs):
    runs, tmp = context_runs
    assert "error" not in runs["ctx/d1"]
    doc = json.loads((tmp / "ctx.context-3x3.json").read_text())
    assert doc["schema"] == "ringflow.dag" and doc["layers"] == 9
    assert doc["meta"]["layers"] == 3 and doc["meta"]["chunks"] == 3
    assert (tmp / "ctx.context-3x3.dot").read_text().startswith("digraph")
    assert sum("wrote the context plan" in l for l in runs["ctx/d1"]["log"]) == 1


FRONT_END = {  # case -> (env, additional_config, what the one line says)
    "unknown_field": ({}, {"ringflow": {"name": "t", "bogus": 1,
                                        "offload": {"layers": [1], "workspace_mib": 64}}},
                      "additional_config.ringflow: field 'bogus': unknown field 'bogus'"),
    "no_such_profile": ({"RINGFLOW_PROFILE": "no_such_profile"}, None,
                        "RINGFLOW_PROFILE=no_such_profile: no such file, and no built-in"),
    "bad_flag": ({"RINGFLOW_POISON": "maybe"}, None, "RINGFLOW_POISON='maybe' is not a flag"),
    "layer_past_the_model": ({}, {"ringflow": {"name": "t", "offload": {
        "layers": [1, 99], "workspace_mib": 64}}},
        "field 'offload.layers': layers [99] do not exist: the model has 4 decoder layers"),
    "count_past_the_model": ({}, {"ringflow": {"name": "t", "offload": {
        "layers": {"count": 9}, "workspace_mib": 64}}},
        "{count: 9} asks for more layers than the model's 4 decoder layers"),
}
FRONT_END_ENGINE = {"lora": ({"ringflow": {"name": "t", "offload": {
    "layers": [1], "workspace_mib": 64}}}, {"enable_lora": True},
    "LoRA (enable_lora) is not supported while ringflow streams weights")}


def test_what_needs_no_model_is_checked_in_the_front_end_before_any_worker(tmp_path):
    """Multiprocessing on: the error comes from vLLM's front end (EngineArgs.
    create_engine_config), in seconds, with one ringflow line, and no engine core started."""
    cases = [{"name": name, "model": "llama", "env": env, "additional_config": extra}
             for name, (env, extra, _) in FRONT_END.items()]
    cases += [{"name": name, "model": "llama", "additional_config": extra, "engine": engine}
              for name, (extra, engine, _) in FRONT_END_ENGINE.items()]
    results, stderr = run_cases(tmp_path, cases, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    needles = {name: entry[-1] for name, entry in {**FRONT_END, **FRONT_END_ENGINE}.items()}
    for name, needle in needles.items():
        run = results[name]
        assert needle in run.get("error", ""), run
        assert run["error"].split(":")[0] in ("ProfileError", "ConfigError"), run["error"]
        assert sum(needle in line for line in run["log"]) == 1, run["log"]
        assert run["seconds"] < 20, run["seconds"]
    assert "EngineCore" not in stderr and "Initializing a V1 LLM engine" not in stderr
