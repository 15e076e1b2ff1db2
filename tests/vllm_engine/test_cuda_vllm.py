"""The plugin inside vLLM's own CUDA engine (vLLM 0.26 on the H200), every graph mode.

Skipped where vLLM is not installed (the GPU image has none; ``../shared/tools/vllm-gpu-pack``
carries it, ``tools/gpu-vllm`` runs this module). For each graph mode (eager, PIECEWISE, FULL,
vLLM's default FULL_AND_PIECEWISE), a tiny Llama (FLASH_ATTN) and a tiny DeepSeek-V2 (MLA on
TRITON_MLA) with seeded random weights:

* ``layer-ops``: ``RINGFLOW_LAYER_OPS_ONLY=1`` with the streamed case's profile: the layers
  streaming would wrap (0, 2, 3: Note [Boundary layers]) wrapped in ringflow's ops and vLLM's
  graph split there, nothing streamed: the same compiled partition as streaming;
* ``streamed``: layers 0, 2, 3 streamed through a ring of two, slots poisoned, generated twice;
* ``plain`` (Llama): vLLM alone, how far the partition change alone moves the output;
* ``kv/off`` and ``kv/verified``: full-KV prefetch with ``verify: true`` (on the host eagerly,
  on the device inside captured graphs).

The four modes run as four processes at once (KV caches of fixed size, so no engine profiles
memory while another changes it). The memory-credit check profiles memory, so nothing else may
run on its GPU meanwhile: it comes first in this file (``-k memory`` runs it alone).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (tools/gpu-vllm installs the carried vLLM 0.26)",
                allow_module_level=True)

HERE = Path(__file__).resolve().parent
MODES = ("eager", "piecewise", "full", "default")
MODELS = ("llama", "dsv2")
POISON = {"RINGFLOW_POISON": "1"}
STREAM = {"ringflow": {"name": "gpu", "offload": {"layers": [0, 2, 3], "depth": 1,
                                                  "workspace_mib": 256}}}
KV = {"ringflow": {"name": "gpu", "kv_prefetch": {"consumer": "full_kv_check", "depth": 1,
                                                   "workspace_mib": 256, "verify": True}}}
#: tiny contexts: min_context_tokens 0 plans every step (Note [Short context])
CTX = {"ringflow": {"name": "ctx", "kv_prefetch": {"depth": 1, "workspace_mib": 16,
                                                   "min_context_tokens": 0}}}
CTX_VERIFY = {"ringflow": {"name": "ctx", "kv_prefetch": {"depth": 1, "workspace_mib": 16,
                                                          "min_context_tokens": 0,
                                                          "verify": True}}}
#: a 64-row context workspace: the cached prefixes of one step take several chunks
CHUNKED = {"prefix_caching": True, "workspace_rows": 64}
SLOW = {**CHUNKED, "slow": 20_000_000}  # each fill ~10 ms late on the gather stream
BF16_NOISE = 2e-2  # logprobs of the same kernels on the same values differ by rounding only
OUT = Path(os.environ.get("OUT", "/tmp/ringflow-gpu"))
RELOAD_MODES = ("eager", "default")  # no graphs, and vLLM's FULL_AND_PIECEWISE
RELOAD_CYCLES = 5


def mode_cases(mode):
    cases = []
    for model in MODELS:
        base = {"model": model, "mode": mode, "max_tokens": 12}
        if model == "llama":  # what the partition change alone does to vLLM's output
            cases.append({"name": f"{model}/{mode}/plain", **base})
        cases += [
            {"name": f"{model}/{mode}/layer-ops", **base,
             "env": {"RINGFLOW_LAYER_OPS_ONLY": "1"}, "additional_config": STREAM},
            {"name": f"{model}/{mode}/streamed", **base, "env": POISON,
             "additional_config": STREAM, "repeat": True},
            {"name": f"{model}/{mode}/kv/off", **base, "long_prompt": True},
            {"name": f"{model}/{mode}/kv/verified", **base, "long_prompt": True,
             "env": POISON, "additional_config": KV},
        ]
    ctx = {"model": "dsv2", "mode": mode, "max_tokens": 6, "context": CHUNKED}
    cases += [{"name": f"dsv2/{mode}/ctx/off", **ctx},
              {"name": f"dsv2/{mode}/ctx/read", **ctx, "context": SLOW, "env": POISON,
               "additional_config": CTX},
              {"name": f"dsv2/{mode}/ctx/verify", **ctx, "additional_config": CTX_VERIFY}]
    return cases


def _die_with_parent() -> None:
    """In the engine's child process: killed when the pytest that started it dies. A device
    call's ``timeout`` kills pytest; its engines (their host workers polling) would otherwise
    run on and load the machine that later calls measure on (seen on the H200)."""
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run(cases, tag, timeout=1500, env=None):
    """Start one process running ``cases`` in order (tests/helpers/vllm_e2e.py); logs under $OUT."""
    work = OUT / "vllm" / tag
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DISABLE_COMPILE_CACHE": "1",
           **(env or {})}
    with open(work / "log.txt", "w") as log:  # the child keeps its own handle
        proc = subprocess.Popen([sys.executable, str(HERE.parent / "helpers" / "vllm_e2e.py"),
                                 str(work / "cases.json"), str(work / "results.json")],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
    return proc, work, timeout


def collect(started):
    results = {}
    for proc, work, timeout in started:
        code = proc.wait(timeout=timeout)
        assert code == 0, (work / "log.txt").read_text()[-4000:]
        results.update({r["name"]: r for r in json.loads((work / "results.json").read_text())})
    return results


RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER: 0.26 defaults to V2


@pytest.fixture(scope="module")
def memory():
    """Sequential engines, each alone on the GPU, vLLM sizing its own KV cache, per runner."""
    mid = {"model": "llama_mid", "profile_memory": True, "gpu_memory_utilization": 0.3,
           "mode": "eager", "dummy": True, "max_tokens": 4}
    streamed = {"additional_config": {"ringflow": {
        "name": "mem", "offload": {"layers": {"every": 2, "last": 1}, "depth": 1,
                                   "workspace_mib": 4096}}}}
    results = {}
    for runner, flag in RUNNERS.items():
        env = {"VLLM_USE_V2_MODEL_RUNNER": flag}
        for name, extra in (("resident", {}), ("streamed", streamed)):
            case = {"name": f"{runner}/{name}", **mid, **extra, "env": env}
            # one after the other: an engine profiling memory must be alone on its GPU
            results.update(collect([run([case], f"memory-{runner}-{name}")]))
    return results


@pytest.fixture(scope="module")
def matrix():
    started = [run(mode_cases(mode), mode) for mode in MODES]
    # a mutant patches this process's executors: a process of its own, eager mode
    ctx = {"model": "dsv2", "mode": "eager", "max_tokens": 6, "context": SLOW}
    started.append(run([{"name": "dsv2/eager/ctx/skip-ready-wait", **ctx, "env": POISON,
                         "additional_config": CTX}], "mutant",
                       env={"RINGFLOW_MUTANT": "skip-ready-wait"}))
    return collect(started)


def ok(run):
    assert "error" not in run, run["error"]
    return run


def assert_same_output(run, baseline):
    """Greedy tokens identical, top-5 logprobs within bf16 noise."""
    assert run["tokens"] == baseline["tokens"]
    assert logprob_gap(run, baseline) <= BF16_NOISE


def logprob_gap(a, b):
    return max(abs(x[1] - y[1]) for pa, pb in zip(a["top5"], b["top5"])
               for sa, sb in zip(pa, pb) for x, y in zip(sa, sb) if x[0] == y[0])


@pytest.mark.parametrize("runner", RUNNERS)
def test_memory_streaming_frees_its_weights_into_vllms_kv_budget(memory, runner):
    """vLLM's KV cache grows by what streaming saved (offloaded weights minus the ring), under
    both model runners, and the log states the gain from vLLM's own sizing."""
    resident, streamed = ok(memory[f"{runner}/resident"]), ok(memory[f"{runner}/streamed"])
    line = next(l for l in streamed["log"] if "device memory fell by" in l)
    saved_mib = float(line.split("device memory fell by ")[1].split(" MiB")[0])
    per_token = 8 * 2 * 8 * 128 * 2  # llama_mid: 8 layers x K,V x 8 heads x 128 x bf16
    gained = (streamed["kv_blocks"] - resident["kv_blocks"]) * resident["kv_block_size"]
    expected = saved_mib * (1 << 20) / per_token
    assert expected > 5000
    assert abs(gained - expected) <= 0.05 * expected, (gained, expected)
    assert any("without ringflow's measured saving" in l for l in streamed["log"])


def test_the_memory_check_ran_under_two_different_model_runners(memory):
    def runner(run):
        line = next(l for l in ok(run)["log"] if "credited to " in l)
        return line.split("credited to ")[1].split("'s weights memory")[0]
    v1, v2 = runner(memory["v1/streamed"]), runner(memory["v2/streamed"])
    assert v1 != v2, (v1, v2)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_streaming_matches_the_same_partition_with_nothing_streamed(matrix, mode, model):
    ops, streamed = ok(matrix[f"{model}/{mode}/layer-ops"]), ok(matrix[f"{model}/{mode}/streamed"])
    assert_same_output(streamed, ops)
    assert streamed["repeat_same"], "a second run of the same engine differs (poison is on)"
    assert not any("runs the synchronous path" in l for l in streamed["log"]), \
        "the plan did not join vLLM's capture"
    assert any(f"vLLM runs cudagraph_mode={streamed['cudagraph_mode']}" in l
               for l in streamed["log"])


@pytest.mark.parametrize("mode", ["full", "default"])
def test_full_graphs_are_not_silently_downgraded_for_the_llama(matrix, mode):
    streamed = ok(matrix[f"llama/{mode}/streamed"])
    assert "FULL" in streamed["cudagraph_mode"], streamed["cudagraph_mode"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_full_kv_prefetch_verifies_every_slot_in_every_graph_mode(matrix, mode, model):
    off, run_ = ok(matrix[f"{model}/{mode}/kv/off"]), ok(matrix[f"{model}/{mode}/kv/verified"])
    assert_same_output(run_, off)
    [stats] = run_["kv"]
    assert stats["mismatches"] == [] and stats["captured_mismatches"] == 0, stats
    assert stats["checked"] + stats["captured_checked"] >= stats["layers"] * 4, stats
    if mode in ("full", "default"):  # attention inside the graph: checked on the device
        assert stats["captured_checked"] > 0, "no captured step was verified"


@pytest.mark.parametrize("mode", MODES)
def test_mla_reads_prefetched_context_chunks_in_every_graph_mode(matrix, mode):
    """Prefix-cache hits over several context chunks: the layers after the first read every
    chunk from a ring slot filled on the gather stream (poisoned after its read); output as
    vLLM's own gather gives; verify finds every consumed slot equal to vLLM's gather."""
    off = ok(matrix[f"dsv2/{mode}/ctx/off"])
    for name in ("read", "verify"):
        run_ = ok(matrix[f"dsv2/{mode}/ctx/{name}"])
        assert_same_output(run_, off)
        [stats] = run_["context"]
        assert stats["abandoned"] == {} and stats["consumed"] > 0, stats
        assert max(c for _, c in stats["plans"]) > 1, stats  # several chunks per layer
        if name == "verify":
            assert stats["checked"] == stats["consumed"] and stats["mismatches"] == [], stats


def test_a_context_read_that_skips_its_wait_reads_poison(matrix):
    """With the compute stream's wait for the gather removed (mutant skip-ready-wait), the
    attention reads a slot not yet filled (NaN from the last poison): the output changes."""
    off, bad = ok(matrix["dsv2/eager/ctx/off"]), ok(matrix["dsv2/eager/ctx/skip-ready-wait"])
    assert bad["context"][0]["consumed"] > 0
    assert bad["tokens"] != off["tokens"] or logprob_gap(bad, off) > BF16_NOISE


def reload_cases(mode):
    """Checkpoints A (the same partition, nothing streamed) and B, then an engine streaming
    layers 0, 2, 3 that reloads B, A, B, meets the other weight verbs and cycles B / A."""
    base = {"model": "llama", "mode": mode, "max_tokens": 12}
    ops = {"RINGFLOW_LAYER_OPS_ONLY": "1"}
    return [{"name": f"llama/{mode}/reload/ops_a", **base, "env": ops, "additional_config": STREAM},
            {"name": f"llama/{mode}/reload/ops_b", **base, "seed": 1, "env": ops,
             "additional_config": STREAM},
            {"name": f"llama/{mode}/reload/streamed", **base, "reload": True,
             "verbs": RELOAD_CYCLES, "env": POISON, "additional_config": STREAM}]


@pytest.fixture(scope="module")
def reloads():
    """One process per mode, apart from the matrix (``-k reload`` runs these alone)."""
    return collect([run(reload_cases(mode), f"reload-{mode}") for mode in RELOAD_MODES])


@pytest.mark.parametrize("mode", RELOAD_MODES)
def test_reloaded_weights_reach_streamed_layers_on_the_gpu(reloads, mode):
    """vLLM's reload_weights (checkpoint B by path, A and B as iterators) with layers 0, 2, 3
    streamed and poisoned: each generate after a reload equals a fresh engine on that
    checkpoint (the same partition, nothing streamed), captured graphs included."""
    a, b = ok(reloads[f"llama/{mode}/reload/ops_a"]), ok(reloads[f"llama/{mode}/reload/ops_b"])
    got = ok(reloads[f"llama/{mode}/reload/streamed"])
    assert_same_output(got, a)
    assert a["tokens"] != b["tokens"]  # the two checkpoints are told apart
    for name, want in (("path_b", b), ("iter_a", a), ("iter_b", b)):
        tokens, top5 = got["reloads"][name]
        assert_same_output({"tokens": tokens, "top5": top5}, want)


@pytest.mark.parametrize("mode", RELOAD_MODES)
def test_sleep_and_weight_transfer_are_refused_and_reload_cycles_leak_nothing(reloads, mode):
    """sleep(level=1|2) and the weight-transfer calls are refused at the call with one line
    each, sleep(level=0) and its wake-up run, the engine goes on (same output, scheduler not
    left paused); five cycles of reload
    B / reload A leave torch's device and pinned host memory where the first cycle left them."""
    a, b = ok(reloads[f"llama/{mode}/reload/ops_a"]), ok(reloads[f"llama/{mode}/reload/ops_b"])
    got = ok(reloads[f"llama/{mode}/reload/streamed"])
    verbs = got["verbs"]
    for name, error in verbs["calls"].items():
        assert error is not None and "EngineError" in error, (name, error)
        assert "not supported while ringflow streams weights" in error, (name, error)
    assert sum("not supported while ringflow streams weights" in l for l in got["log"]) == \
        len(verbs["calls"])
    assert verbs["level_0"] is None, verbs["level_0"]  # pausing the scheduler moves nothing
    tokens, top5 = verbs["after_calls"]  # B was loaded last
    assert_same_output({"tokens": tokens, "top5": top5}, b)
    for name, want in (("last_b", b), ("last_a", a)):
        tokens, top5 = verbs[name]
        assert_same_output({"tokens": tokens, "top5": top5}, want)
    # this process's own memory: torch's device allocations and its pinned host pool (the
    # device's free memory moves with the other engines running on this GPU meanwhile)
    memory = verbs["memory"]
    assert len(memory) == RELOAD_CYCLES + 1 and memory[1]["pinned"] > 0, memory
    for later in memory[2:]:  # the first cycle may warm vLLM's loader; none after it grows
        assert later["allocated"] == memory[1]["allocated"], memory
        assert later["pinned"] == memory[1]["pinned"], memory


@pytest.fixture(scope="module")
def cache_runs(matrix):
    """One VLLM_CACHE_ROOT, compile cache on, three engines in turn: plain vLLM, a profile by
    RINGFLOW_PROFILE, another profile. Each must trace and cache a graph of its own."""
    root = OUT / "vllm" / "cache-root"
    profiles = {}
    for name, layers in (("a", [0, 2, 3]), ("b", [1, 3])):
        path = OUT / "vllm" / f"cache-{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"name: cache-{name}\noffload: {{layers: {layers}, depth: 1, "
                        f"workspace_mib: 256}}\n")
        profiles[name] = str(path)
    base = {"model": "llama", "mode": "default", "max_tokens": 12}
    results = {}
    for name, env in (("plain", {}), ("a", {"RINGFLOW_PROFILE": profiles["a"], **POISON}),
                      ("b", {"RINGFLOW_PROFILE": profiles["b"], **POISON})):
        started = run([{"name": f"cache/{name}", **base}], f"cache-{name}",
                      env={"VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
                           **env})
        results.update(collect([started]))
    results["dirs"] = sorted(p.name for p in (root / "torch_compile_cache" /
                                              "torch_aot_compile").iterdir())
    return results


def test_the_compile_cache_keeps_a_graph_per_profile(cache_runs, matrix):
    """Without ringflow's factors in vLLM's hash the second and third engines would load the
    plain graph (no layer ops: streamed layers read slots with no wait, poisoned): here each
    traces its own, and each output is its baseline's."""
    assert len(cache_runs["dirs"]) == 3, cache_runs["dirs"]
    assert_same_output(ok(cache_runs["cache/plain"]), ok(matrix["llama/default/plain"]))
    for name in ("a", "b"):
        run_ = ok(cache_runs[f"cache/{name}"])
        assert_same_output(run_, ok(matrix["llama/default/layer-ops"]))
        assert any("compile-cache key includes ringflow's" in l for l in run_["log"])


# -- breakable CUDA graphs, and weights that change under a request in flight (#37) -----------

BREAKABLE = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
BREAKABLE_MODES = ("piecewise", "default")  # every step in segments; FULL decode + segments
SYNC_STEPS = {"async_scheduling": False}  # a step's outputs before the next is issued


def breakable_cases(mode):
    """vLLM's breakable CUDA graphs: the Llama plain and streamed (poisoned), the DeepSeek-V2
    with and without the context consumer (prefix hits over several chunks, each fill late),
    one request at a time."""
    llama = {"model": "llama", "mode": mode, "max_tokens": 12, "serial": True}
    ctx = {"model": "dsv2", "mode": mode, "max_tokens": 6, "serial": True}
    return [{"name": f"breakable/{mode}/llama/plain", **llama},
            {"name": f"breakable/{mode}/llama/streamed", **llama, "env": POISON,
             "additional_config": STREAM, "repeat": True},
            {"name": f"breakable/{mode}/ctx/off", **ctx, "context": CHUNKED},
            {"name": f"breakable/{mode}/ctx/read", **ctx, "context": SLOW, "env": POISON,
             "additional_config": CTX}]


INFLIGHT_MODES = ("full", "default")


def inflight_cases(mode):
    """A request in flight when the weights change (helpers/vllm_e2e.py inflight_reloads):
    ringflow off (its layer ops, nothing streamed: the same partition) and streamed."""
    base = {"model": "llama", "mode": mode, "max_tokens": 16, "inflight": True,
            "engine": SYNC_STEPS}
    return [{"name": f"inflight/{mode}/off", **base, "env": {"RINGFLOW_LAYER_OPS_ONLY": "1"},
             "additional_config": STREAM},
            {"name": f"inflight/{mode}/streamed", **base, "env": POISON,
             "additional_config": STREAM}]


@pytest.fixture(scope="module")
def graph_modes():
    """One process per breakable mode and per in-flight mode, and the mutant that skips the
    prime at the write in a process of its own (``-k "breakable or inflight"`` runs these)."""
    started = [run(breakable_cases(mode), f"breakable-{mode}", env=BREAKABLE)
               for mode in BREAKABLE_MODES]
    started += [run(inflight_cases(mode), f"inflight-{mode}") for mode in INFLIGHT_MODES]
    mutant = {**inflight_cases("full")[1], "name": "inflight/full/skip-prime-at-write"}
    started.append(run([mutant], "inflight-mutant", env={"RINGFLOW_MUTANT": "skip-prime-at-write"}))
    return collect(started)


@pytest.mark.parametrize("mode", BREAKABLE_MODES)
def test_breakable_graphs_stream_weights_exactly_with_ringflows_ops_as_breaks(graph_modes, mode):
    """Under VLLM_USE_BREAKABLE_CUDAGRAPH=1: the streamed Llama (slots poisoned after every
    read) gives vLLM's own output, twice; the start-up line names the mode; in PIECEWISE
    every decode step is a replay of segments, and each ran the stepper (its calls are breaks
    that vLLM calls again at replay: the slots were filled for that replay)."""
    plain = ok(graph_modes[f"breakable/{mode}/llama/plain"])
    streamed = ok(graph_modes[f"breakable/{mode}/llama/streamed"])
    assert_same_output(streamed, plain)
    assert streamed["repeat_same"], "a second run of the same engine differs (poison is on)"
    [line] = [l for l in streamed["log"] if l.startswith("vLLM runs breakable CUDA graphs")]
    assert "break the capture too" in line, line
    assert not any("capture policy sync" in l for l in streamed["log"])
    if mode == "piecewise":  # 3 prompts x 12 tokens, twice, one request at a time
        assert streamed["forwards"][0] >= 2 * 3 * 11, streamed["forwards"]


@pytest.mark.parametrize("mode", BREAKABLE_MODES)
def test_breakable_graphs_read_prefetched_context_chunks(graph_modes, mode):
    """The MLA context consumer under breakable graphs (it runs inside vLLM's attention op,
    which vLLM runs eagerly between the segments): prefix hits over several chunks read from
    ring slots filled late and poisoned after each read; output as vLLM's own gather gives."""
    off = ok(graph_modes[f"breakable/{mode}/ctx/off"])
    read = ok(graph_modes[f"breakable/{mode}/ctx/read"])
    assert_same_output(read, off)
    [stats] = read["context"]
    assert stats["abandoned"] == {} and stats["consumed"] > 0, stats
    assert max(c for _, c in stats["plans"]) > 1, stats


@pytest.mark.parametrize("mode", INFLIGHT_MODES)
def test_a_reload_under_a_request_in_flight_reaches_the_next_replayed_step(graph_modes, mode):
    """sleep(level=0, keep), reload_weights (checkpoint B), wake_up, decode on: the next decode
    steps are replays of vLLM's FULL graph, which run none of ringflow's Python; the tokens
    after the reload equal ringflow-off vLLM doing the same (Note [Prime at the write])."""
    off = ok(graph_modes[f"inflight/{mode}/off"])["inflight"]
    got = ok(graph_modes[f"inflight/{mode}/streamed"])["inflight"]
    assert got["before"] == off["before"] and min(off["before"]) >= 2, (got, off)
    for tokens, top5, want_tokens, want_top5 in zip(got["tokens"], got["top5"], off["tokens"],
                                                    off["top5"]):
        assert_same_output({"tokens": tokens, "top5": [top5]},
                           {"tokens": want_tokens, "top5": [want_top5]})


def test_a_reload_that_does_not_prime_at_the_write_reads_old_weights(graph_modes):
    """Mutant skip-prime-at-write: the carried slots keep the old weights until a forward of
    ringflow's runs; the first replayed step after the reload reads them and the output
    changes."""
    off = ok(graph_modes["inflight/full/off"])["inflight"]
    bad = ok(graph_modes["inflight/full/skip-prime-at-write"])["inflight"]
    assert bad["before"] == off["before"]
    assert bad["tokens"] != off["tokens"] or any(
        logprob_gap({"top5": [a]}, {"top5": [b]}) > BF16_NOISE
        for a, b in zip(bad["top5"], off["top5"]))


# -- two GPUs: tensor parallel 2, decode context parallel 2 ---------------------------------------

TWO = {"tensor_parallel_size": 2}
DCP2 = {**TWO, "decode_context_parallel_size": 2}
# eager: `auto` measures both exchanges and picks; FULL graphs: the copy engines, asked for
DCP_TRANSPORT = {"eager": "auto", "full": "peer"}


def kv_dcp(transport: str) -> dict:
    return {"ringflow": {"name": "dcp", "kv_prefetch": {"depth": 1, "workspace_mib": 256,
                                                        "verify": True,
                                                        "dcp_transport": transport}}}
WORKER_RPC = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # kv stats come back from the workers
# the context consumer's exchange: eager over NCCL; default graphs `auto`, which is the copy
# engines wherever symmetric memory works (it does on two H200s), with no timing
CTX_DCP_TRANSPORT = {"eager": "nccl", "default": "auto"}


def ctx_dcp(transport: str, verify: bool) -> dict:
    return {"ringflow": {"name": "ctx", "kv_prefetch": {"depth": 1, "workspace_mib": 16,
                                                       "dcp_transport": transport,
                                                       "verify": verify}}}


@pytest.fixture(scope="module")
def two_gpus():
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs of one host (device kind nvidia-h200-x2)")
    cases = []
    for mode in ("eager", "full"):
        base = {"model": "dsv2", "mode": mode, "max_tokens": 12, "long_prompt": True,
                "engine": DCP2, "env": WORKER_RPC}
        cases += [{"name": f"dcp/{mode}/off", **base},
                  {"name": f"dcp/{mode}/verified", **base, "env": {**WORKER_RPC, **POISON},
                   "additional_config": kv_dcp(DCP_TRANSPORT[mode])}]
    for mode in ("eager", "default"):  # prefix hits over one chunk (the workers' own workspace)
        ctx = {"model": "dsv2", "mode": mode, "max_tokens": 6, "engine": DCP2,
               "context": {"prefix_caching": True}, "env": WORKER_RPC}
        cases += [{"name": f"dcp/{mode}/ctx/off", **ctx},
                  {"name": f"dcp/{mode}/ctx/read", **ctx, "env": {**WORKER_RPC, **POISON},
                   "additional_config": ctx_dcp(CTX_DCP_TRANSPORT[mode], False)},
                  {"name": f"dcp/{mode}/ctx/verify", **ctx,
                   "additional_config": ctx_dcp(CTX_DCP_TRANSPORT[mode], True)}]
    base = {"model": "llama", "mode": "eager", "max_tokens": 12, "engine": TWO}
    cases += [{"name": "tp2/layer-ops", **base, "additional_config": STREAM,
               "env": {**WORKER_RPC, "RINGFLOW_LAYER_OPS_ONLY": "1"}},
              {"name": "tp2/streamed", **base, "env": {**WORKER_RPC, **POISON},
               "additional_config": STREAM, "repeat": True}]
    return _Engines(cases)


class _Engines(dict):
    """Each case's engine, run the first time a test reads it (each takes both GPUs: one after
    the other), so `-k` selects the engines that run too."""

    def __init__(self, cases) -> None:
        super().__init__()
        self.cases = {case["name"]: case for case in cases}

    def __missing__(self, name):
        case = self.cases[name]
        self.update(collect([run([case], name.replace("/", "-"), timeout=900)]))
        return self[name]


@pytest.mark.parametrize("mode", ["eager", "full"])
def test_full_kv_prefetch_under_dcp2_holds_every_layers_full_kv(two_gpus, mode):
    """vLLM TP2 + DCP2, MLA: every slot all-gathered across the two GPUs equals the layer's
    full KV (checked on the host each eager step), tokens equal ringflow off, and the plan
    records which exchange ran (and, under `auto`, what both cost). FULL graphs ask for the
    copy engines: they must run, not fall back."""
    off, run_ = ok(two_gpus[f"dcp/{mode}/off"]), ok(two_gpus[f"dcp/{mode}/verified"])
    assert_same_output(run_, off)
    assert len(run_["kv"]) == 2, run_["kv"]  # one model per worker
    assert len({s["dcp"]["transport"] for s in run_["kv"]}) == 1, "the workers disagree"
    for stats in run_["kv"]:
        assert stats["mismatches"] == [] and stats["captured_mismatches"] == 0, stats
        assert stats["checked"] >= stats["layers"], stats
        assert stats["dcp"]["size"] == 2 and stats["dcp"]["transport"] in ("nccl", "peer")
        assert stats["dcp"]["requested"] == DCP_TRANSPORT[mode], stats["dcp"]
        if DCP_TRANSPORT[mode] == "auto":
            assert set(stats["dcp"]["measured_ms"]) == {"nccl", "peer"}, stats["dcp"]
        else:
            assert stats["dcp"]["transport"] == DCP_TRANSPORT[mode], stats["dcp"]


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_mla_context_under_dcp2_reads_the_prefetched_exchange(two_gpus, mode):
    """vLLM TP2 + DCP2, MLA prefix hits: on both workers the layers after the first read each
    context chunk's local gather and its all-gather across the DCP group from a ring slot
    (poisoned after its read), vLLM's own exchange skipped; tokens as ringflow off; verify
    finds every consumed gather and exchange equal to vLLM's own. Eager exchanges over NCCL,
    the default graph mode by copy engines (auto: peer)."""
    off = ok(two_gpus[f"dcp/{mode}/ctx/off"])
    for name in ("read", "verify"):
        run_ = ok(two_gpus[f"dcp/{mode}/ctx/{name}"])
        assert_same_output(run_, off)
        assert len(run_["context"]) == 2, run_["context"]  # one ring per worker
        for stats in run_["context"]:  # each worker's ring exchanged across the group
            assert stats["dcp_size"] == 2, stats
            assert stats["transport"] == {"nccl": "nccl", "auto": "peer"}[
                CTX_DCP_TRANSPORT[mode]], stats
            assert stats["abandoned"] == {} and stats["consumed"] > 0, stats
            if name == "verify":  # a gather and an exchange checked per consumed chunk
                assert stats["checked"] == 2 * stats["consumed"], stats
                assert stats["mismatches"] == [], stats
        assert run_["context"][0]["consumed"] == run_["context"][1]["consumed"]


def test_weight_streaming_under_tensor_parallel_2(two_gpus):
    ops, streamed = ok(two_gpus["tp2/layer-ops"]), ok(two_gpus["tp2/streamed"])
    assert_same_output(streamed, ops)
    assert streamed["repeat_same"]
    assert len(streamed["forwards"]) == 2 and all(f and f > 0 for f in streamed["forwards"]), \
        streamed["forwards"]  # both workers streamed their shards
