#!/usr/bin/env python3
"""MLA context prefetch in vLLM's engine: vLLM's attention reading ringflow's ring vs vLLM's
own per-layer context gather, in one engine, interleaved.

    python3 tools/mla_context_bench.py [--layers 27] [--prefixes 32768,65536,131072]
                                       [--suffix 2048] [--long 131072] [--rounds 3] [--json F]
                                       [--dcp 2]

The model has DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
nope 128, v 128) and its 27 layers, with a dense MLP of 10,944 (V2-Lite's first layer; its MoE
layers run 6 routed + 2 shared experts of 1,408, about the same FLOPs per token), seeded random
bf16 weights. One engine (vLLM's default graph mode, prefix caching on, 8,192 batched tokens)
holds ringflow's context ring; ``ContextModel.enabled`` switches between the attention reading
the ring (``on``) and vLLM gathering for itself (``off``, the ring still reserved) between
requests, so the ratios come from one run:

* (a) a cached prefix of each ``--prefixes`` length, then a ``--suffix``-token request whose
  prefill attends over it (TTFT of one request, fresh suffix each time);
* (b) one ``--long``-token prompt under chunked prefill (8,192 tokens per step): every step
  after the first attends over the earlier chunks.

Output equality: the same prompt on and off from the same cache state (the prefix cache is
reset and re-warmed between), greedy tokens and top-5 logprobs. The per-layer gather time is
vLLM's own recorded gather calls replayed with CUDA events (the critical-path time a layer
pays without ringflow).

Each request of (a) also records ringflow's host time in it (``host_ms_per_request``) and the
caching allocator's trips to the driver (``allocator_per_request``: retries, which free cached
blocks after a device sync, whole-device syncs, cudaMalloc and cudaFree) and Python's garbage
collections in this process (``gc_per_request``: collections by generation and their ms; vLLM
freezes the heap after start-up, so what ringflow allocates per step is what they scan):
whether a slower request is host time, a hidden sync, the allocator or the collector.

``--dcp N`` runs tensor parallel N with decode context parallel N (one GPU per rank): each
rank's ring lives in its worker process, switched and read through ``collective_rpc``; the
per-layer time is then the local gather and the all-gather across the group, replayed (vLLM's
reorder after it is not in it), and ringflow's host timers are not taken.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the switch lives in-process

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def write_model(root: Path, layers: int) -> str:
    """config.json and seeded random weights (generated on the GPU: fast)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**V2_LITE, "num_hidden_layers": layers, "first_k_dense_replace": layers}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    if (root / "model.safetensors").exists():
        return str(root)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                         "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kwargs))
        shapes = {k: v.shape for k, v in model.named_parameters()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for key, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t
        elif "lm_head" in key:
            t = 3.0 * t / shape[1] ** 0.5
        elif "embed" not in key:
            t = t / shape[1] ** 0.5
        weights[key] = t.to(torch.bfloat16).cpu()
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    return str(root)


def tokens(seed: int, n: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, V2_LITE["vocab_size"]) for _ in range(n)]


class LocalRing:
    """The engine's one context ring, in this process."""

    def __init__(self, model) -> None:
        self.model = model

    def enable(self, on: bool) -> None:
        self.model.enabled = on

    def gather_ms(self) -> float | None:
        return _gather_ms(self.model)

    def stats(self) -> dict:
        return _stats(self.model)


class WorkerRings:
    """Every rank's context ring, in vLLM's worker processes (``--dcp``)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def enable(self, on: bool) -> None:
        self.llm.collective_rpc(_worker_enable, args=(on,))

    def gather_ms(self) -> float | None:
        times = [t for t in self.llm.collective_rpc(_worker_gather_ms) if t is not None]
        return max(times) if times else None  # the group waits for its slowest rank

    def stats(self) -> dict:
        per_rank = self.llm.collective_rpc(_worker_stats)
        return {**per_rank[0], "per_rank": per_rank}


def _worker_model():
    from ringflow.integrations.vllm.state import STATE
    [model] = STATE.context_models.values()
    return model


def _worker_enable(worker, on: bool) -> None:
    _worker_model().enabled = on


def _worker_gather_ms(worker) -> float | None:
    return _gather_ms(_worker_model())


def _worker_stats(worker) -> dict:
    return _stats(_worker_model())


def _stats(model) -> dict:
    return {"chunks": len(model.calls), "reserved_bytes": model.reserved_bytes,
            "consumed": model.ring.consumed, "abandoned": dict(model.ring.abandoned),
            "dcp_size": model.dcp_size, "depth": model.ring.pool.depth,
            "slots": model.ring.pool.slots}


def _gather_ms(model, repeats: int = 20) -> float | None:
    """One layer's context gathers of the last recorded step (and, under DCP, their
    exchanges), replayed and timed with CUDA events."""
    import torch
    if not model.calls:
        return None
    slot = model.ring.pool.storage[0]
    chunks = len(model.calls)
    for k in range(chunks):
        model.fill(0, k, slot)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        for k in range(chunks):
            model.fill(0, k, slot)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


class Bench:
    def __init__(self, llm, rings) -> None:
        self.llm, self.rings = llm, rings

    def generate(self, prompt, on: bool, max_tokens: int = 1, logprobs: int | None = None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        self.rings.enable(on)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
        began = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        seconds = time.perf_counter() - began
        return seconds, out[0]

    def same_output(self, prompt, warm) -> dict:
        """``prompt`` off then on from the same cache state (reset, ``warm`` re-run)."""
        runs = []
        for on in (False, True):
            self.llm.reset_prefix_cache()
            if warm is not None:
                self.generate(warm, on=False)
            runs.append(self.generate(prompt, on, max_tokens=4, logprobs=5)[1].outputs[0])
        off, on = runs
        gap = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(off.logprobs, on.logprobs)
                  for t in a if t in b)
        return {"tokens_equal": list(off.token_ids) == list(on.token_ids),
                "max_logprob_gap": gap}

    def gather_ms(self) -> float | None:
        return self.rings.gather_ms()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--prefixes", default="32768,65536,131072")
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("--long", type=int, default=131072)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dcp", type=int, default=1,
                        help="tensor parallel and decode context parallel size (GPUs)")
    parser.add_argument("--dcp-transport", default="auto", choices=("auto", "peer", "nccl"),
                        help="kv_prefetch.dcp_transport under --dcp (default auto: the copy "
                             "engines where symmetric memory works)")
    parser.add_argument("--min-context", type=int, default=0,
                        help="the profile's kv_prefetch.min_context_tokens (default 0: every "
                             "step prefetched, the consumer itself measured; -1: omitted, the "
                             "plugin's default of Note [Short context]; on one GPU that leaves "
                             "every step to vLLM, so it is measured against vLLM without "
                             "ringflow: two engines, requests interleaved)")
    parser.add_argument("--on-first", action="store_true",
                        help="with --min-context -1 on one GPU: start ringflow's engine first "
                             "(a check that the order of the two engines does not decide)")
    parser.add_argument("--control", action="store_true",
                        help="with --min-context -1 on one GPU: a third engine, plain like "
                             "'off', measured alongside (the spread between two engines)")
    parser.add_argument("--models", default="/tmp/mla-context-bench")
    parser.add_argument("--probe", action="store_true",
                        help="also time small Python and torch calls inside vLLM's forward and "
                             "outside it, and say what is active there (threads, modes)")
    parser.add_argument("--cprofile", action="store_true",
                        help="also print where ringflow's host time goes in one on request")
    parser.add_argument("--trace", action="store_true",
                        help="also profile one off and one on request over the first prefix "
                             "(torch.profiler: top host and device ops of each)")
    args = parser.parse_args()
    if args.dcp > 1:  # the switch and the stats travel to the workers as functions
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if args.probe or args.cprofile or args.trace:
            parser.error("--probe, --cprofile and --trace look at this process; not with --dcp")

    if args.min_context < 0 and args.dcp == 1:
        return against_plain(args)

    import torch
    import vllm
    from vllm import LLM

    from ringflow.bench import records
    from ringflow.integrations.vllm.state import STATE

    prefixes = [int(p) for p in args.prefixes.split(",") if p]
    path = write_model(Path(args.models) / f"v2lite-{args.layers}", args.layers)
    longest = max(prefixes + [args.long]) + args.suffix + 64
    # two slots of vLLM's context workspace (64k rows of 576 bf16; under DCP 1/N more rows)
    workspace_mib = 160 * (args.dcp + 1) / args.dcp if args.dcp > 1 else 160
    profile = {"ringflow": {"name": "mla-context", "kv_prefetch": {
        "depth": 1, "workspace_mib": workspace_mib}}}
    if args.dcp > 1:
        profile["ringflow"]["kv_prefetch"]["dcp_transport"] = args.dcp_transport
    if args.min_context >= 0:
        profile["ringflow"]["kv_prefetch"]["min_context_tokens"] = args.min_context
    engine = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=longest,
                  enable_prefix_caching=True, max_num_seqs=4, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.85, seed=0, additional_config=profile,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    if args.dcp > 1:
        engine.update(tensor_parallel_size=args.dcp, decode_context_parallel_size=args.dcp)
    began = time.perf_counter()
    try:
        llm = LLM(model=path, **engine)
        backend = "default"
    except Exception as exc:  # a decode backend that refuses this head count: Triton's runs all
        print(f"[mla-context] default attention backend failed ({exc}); TRITON_MLA",
              file=sys.stderr)
        llm = LLM(model=path, attention_backend="TRITON_MLA", **engine)
        backend = "TRITON_MLA"
    startup = time.perf_counter() - began
    rings = WorkerRings(llm) if args.dcp > 1 else LocalRing(_one(STATE.context_models))
    bench = Bench(llm, rings)
    host = host_timers() if args.dcp == 1 else {}
    probed = probe_inside() if args.probe else None
    config = llm.llm_engine.vllm_config
    kv_tokens = config.cache_config.num_gpu_blocks * config.cache_config.block_size
    per_token = args.layers * (512 + 64) * 2
    rows = []
    clock = GcClock()
    for n, prefix_len in enumerate(prefixes):
        prefix = tokens(1000 + n, prefix_len)
        bench.generate(prefix + tokens(1, args.suffix), on=False)  # caches the prefix
        times = {"off": [], "on": []}
        host_ms = {"off": [], "on": []}  # ringflow's context-path host time in each request
        allocator = {"off": [], "on": []}  # this process's allocator events in each request
        collected = {"off": [], "on": []}  # this process's garbage collections in each request
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                before, counted, gcs = top_level_s(host), allocator_events(), clock.snapshot()
                seconds, _ = bench.generate(prefix + tokens(10_000 * (n + 1) + 2 * r + on,
                                                            args.suffix), on)
                times["on" if on else "off"].append(seconds)
                host_ms["on" if on else "off"].append(  # None: not timed (--dcp)
                    round((top_level_s(host) - before) * 1e3, 3) if host else None)
                allocator["on" if on else "off"].append(
                    {k: v - counted[k] for k, v in allocator_events().items()})
                collected["on" if on else "off"].append(clock.since(gcs))
        gather = bench.gather_ms()
        if args.trace and n == 0:
            trace(bench, prefix, args.suffix)
        if args.cprofile and n == 0:
            host_profile(bench, prefix, args.suffix)
        equal = bench.same_output(prefix + tokens(77, args.suffix), prefix + tokens(1, 16))
        rows.append(summarise(f"prefix {prefix_len // 1024}k + {args.suffix}", times, gather,
                              args.layers, args.suffix, equal, chunks=rings.stats()["chunks"]))
        rows[-1]["host_ms_per_request"] = host_ms  # beside times: host-side or device-side?
        rows[-1]["allocator_per_request"] = allocator  # cudaMalloc retries, syncs, new blocks
        rows[-1]["gc_per_request"] = collected  # collections by generation and their ms
    if args.long:
        times = {"off": [], "on": []}
        for r in range(max(2, args.rounds - 1)):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                bench.llm.reset_prefix_cache()
                seconds, _ = bench.generate(tokens(50_000 + 2 * r + on, args.long), on)
                times["on" if on else "off"].append(seconds)
        gather = bench.gather_ms()  # the last step's: the longest context
        equal = bench.same_output(tokens(99, args.long), None)
        rows.append(summarise(f"{args.long // 1024}k chunked (8k/step)", times, gather,
                              args.layers, args.long, equal, chunks=rings.stats()["chunks"],
                              # steps with context, their context growing to the last's
                              steps=(-(-args.long // 8192) - 1) / 2))
    stats = rings.stats()
    doc = records.record("python3 tools/mla_context_bench.py",
                         vllm=vllm.__version__, gpu=torch.cuda.get_device_name(),
                         layers=args.layers, backend=backend, startup_s=round(startup, 1),
                         dcp=args.dcp,
                         ring_mib=round(stats["reserved_bytes"] / 2**20, 1),
                         ring_kv_tokens=stats["reserved_bytes"] // per_token, kv_tokens=kv_tokens,
                         consumed=stats["consumed"], abandoned=stats["abandoned"],
                         ring_depth=stats["depth"], ring_slots=stats["slots"],
                         per_rank=stats.get("per_rank"),
                         host_ms_per_call={k: round(v[0] * 1e3 / max(v[1], 1), 4)
                                           for k, v in host.items()},
                         host_calls={k: v[1] for k, v in host.items()}, rows=rows)
    print("[mla-context] host ms per call:", doc["host_ms_per_call"], doc["host_calls"])
    if probed is not None:
        probed["outside"] = micro_us()
        print("[mla-context] probe:", json.dumps(probed, default=str))
    print(table(rows))
    if args.json:
        records.write(args.json, doc)
    return 0


def _worker_context_state(worker) -> dict:
    from ringflow.integrations.vllm.state import STATE
    return {"context_models": len(STATE.context_models), "ring_bytes": STATE.ring_bytes()}


def against_plain(args) -> int:
    """The plugin's defaults on one GPU (``--min-context -1``): vLLM with ringflow and this
    kv_prefetch profile against vLLM without ringflow's profile, two engines on one GPU (each in
    its own engine process), the same prompts, requests alternating between them; TTFT ratios
    per prefix, greedy tokens and top-5 logprobs of one request at a time compared."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # one engine process each
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the state probe
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.bench import records

    prefixes = [int(p) for p in args.prefixes.split(",") if p]
    path = write_model(Path(args.models) / f"v2lite-{args.layers}", args.layers)
    longest = max(prefixes) + args.suffix + 64
    engine = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=longest,
                  enable_prefix_caching=True, max_num_seqs=4, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.28 if args.control else 0.4, seed=0,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    profile = {"ringflow": {"name": "mla-context-defaults", "kv_prefetch": {
        "depth": 1, "workspace_mib": 160}}}  # min_context_tokens omitted: the defaults
    engines = {}
    order = (("off", {}), ("on", {"additional_config": profile}))
    order = order[::-1] if args.on_first else order
    if args.control:  # a second plain engine: how far two engines running the same code differ
        order += (("control", {}),)
    for name, extra in order:
        began = time.perf_counter()
        engines[name] = LLM(model=path, **engine, **extra)
        print(f"[mla-context] engine {name} up in {time.perf_counter() - began:.0f} s",
              file=sys.stderr, flush=True)
    [state] = engines["on"].collective_rpc(_worker_context_state)

    def generate(name, prompt, max_tokens=1, logprobs=None):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
        began = time.perf_counter()
        out = engines[name].generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                     use_tqdm=False)
        return time.perf_counter() - began, out[0].outputs[0]

    rows = []
    for n, prefix_len in enumerate(prefixes):
        prefix = tokens(1000 + n, prefix_len)
        for name in engines:  # both cache the prefix
            generate(name, prefix + tokens(1, args.suffix))
        times = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                seconds, _ = generate(name, prefix + tokens(10_000 * (n + 1) + r, args.suffix))
                times[name].append(seconds)
        probe = prefix + tokens(77, args.suffix)
        outs = {name: generate(name, probe, max_tokens=4, logprobs=5)[1] for name in engines}
        off, on = outs["off"], outs["on"]
        gap = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(off.logprobs, on.logprobs)
                  for t in a if t in b)
        med = {k: statistics.median(v) for k, v in times.items()}
        # the same round's requests ran back to back: their ratio cancels drift over the rounds
        paired = {k: round(statistics.median(a / b for a, b in zip(times[k], times["off"])), 4)
                  for k in times if k != "off"}
        rows.append({"case": f"prefix {prefix_len // 1024}k + {args.suffix}",
                     "ttft_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()},
                     "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
                     "ratio_on_off": round(med["on"] / med["off"], 4),
                     "ratio_control_off": (round(med["control"] / med["off"], 4)
                                           if "control" in med else None),
                     "paired_ratio_median": paired,
                     "tokens_equal": list(off.token_ids) == list(on.token_ids),
                     "max_logprob_gap": gap})
        print(f"[mla-context] {rows[-1]['case']}: on/off {rows[-1]['ratio_on_off']}, "
              f"control/off {rows[-1]['ratio_control_off']}, paired {paired}",
              file=sys.stderr, flush=True)
    doc = records.record("python3 tools/mla_context_bench.py", vllm=vllm.__version__, gpu=torch.cuda.get_device_name(),
                         layers=args.layers, mode="ringflow's defaults vs vLLM without ringflow",
                         started_first="on" if args.on_first else "off",
                         ringflow_state=state, rows=rows)
    print("| case | off ms | on ms | on/off | control/off | paired on/off | tokens equal |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} | {row['median_ms']['off']} | {row['median_ms']['on']} | "
              f"{row['ratio_on_off']} | {row['ratio_control_off']} | "
              f"{row['paired_ratio_median']['on']} | {row['tokens_equal']} |")
    if args.json:
        records.write(args.json, doc)
    return 0


def _one(context_models: dict):
    if len(context_models) != 1:
        raise SystemExit(f"[mla-context] expected one context ring in this process, found "
                         f"{len(context_models)} (is the plugin installed?)")
    [model] = context_models.values()
    return model


def micro_us() -> dict:
    """Microseconds per call of small torch and Python operations, here."""
    import torch
    t = torch.empty(64, 8, device="cuda")
    event = torch.cuda.Event()
    began = time.perf_counter()
    for _ in range(2000):
        t.data_ptr()
        t[:4]
    torch_us = (time.perf_counter() - began) / 2000 * 1e6
    began = time.perf_counter()
    for _ in range(2000):
        event.record()
    event_us = (time.perf_counter() - began) / 2000 * 1e6
    began = time.perf_counter()
    for _ in range(2000):
        {"a": 1}.get("a")
        [x for x in range(5)]
    python_us = (time.perf_counter() - began) / 2000 * 1e6
    return {"torch_us": round(torch_us, 2), "event_record_us": round(event_us, 2),
            "python_us": round(python_us, 2)}


def probe_inside() -> dict:
    """At the first context session inside vLLM's forward: micro_us and what is active."""
    import threading

    import torch
    from ringflow.integrations.vllm.context_session import Session
    found: dict = {}
    original = Session.__init__

    def init(self, *args, **kwargs):
        if "inside" not in found:
            found["inside"] = micro_us()
            found["state"] = {
                "torch_function_modes": torch._C._len_torch_function_stack(),
                "dispatch_modes": torch._C._len_torch_dispatch_stack(),
                "trace": str(sys.gettrace()), "profile": str(sys.getprofile()),
                "threads": [t.name for t in threading.enumerate()],
                "switch_interval_s": sys.getswitchinterval()}
        original(self, *args, **kwargs)

    Session.__init__ = init
    return found


#: torch.cuda.memory_stats() counters that move when the caching allocator has to go to the
#: driver: a retry frees cached blocks (a device sync), a new block is a cudaMalloc
ALLOCATOR_EVENTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                    "num_device_free")


class GcClock:
    """Python's garbage collections in this process, by generation, and the time they took
    (``gc.callbacks``): a collector pause inside a request shows up in its TTFT."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._began = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def snapshot(self) -> tuple:
        return tuple(self.count), self.seconds

    def since(self, snapshot: tuple) -> dict:
        count, seconds = snapshot
        return {"collections": [a - b for a, b in zip(self.count, count)],
                "ms": round((self.seconds - seconds) * 1e3, 3)}


def allocator_events() -> dict:
    """This process's caching-allocator counters now (with --dcp the model runs elsewhere:
    these then count the driver process only)."""
    import torch
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_EVENTS}


def top_level_s(spent: dict) -> float:
    """Host seconds of the timed functions vLLM's hooks call directly (the others run inside
    them: begin in _consume, end, fill and start in close)."""
    return sum(spent.get(k, (0.0, 0))[0]
               for k in ("Session.__init__", "Session._consume", "Session.close"))


def host_timers() -> dict:
    """Host seconds and calls of ringflow's context path, by function (both modes)."""
    from ringflow.integrations.torch.chunk_prefetch import ChunkPrefetcher
    from ringflow.integrations.vllm.context_ring import ContextModel
    from ringflow.integrations.vllm.context_session import Session
    spent: dict = {}
    targets = [(Session, "_consume"), (Session, "close"),
               (Session, "__init__"), (ContextModel, "fill"), (ChunkPrefetcher, "begin"),
               (ChunkPrefetcher, "end"), (ChunkPrefetcher, "start")]
    for owner, name in targets:
        original = getattr(owner, name)

        def timed(*args, _original=original, _key=f"{getattr(owner, '__name__', owner)}.{name}",
                  **kwargs):
            began = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                entry = spent.setdefault(_key, [0.0, 0])
                entry[0] += time.perf_counter() - began
                entry[1] += 1
        setattr(owner, name, timed)
    return spent


def host_profile(bench, prefix, suffix) -> None:
    """cProfile of one on request: ringflow's functions by their own time (printed)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    bench.generate(prefix + tokens(31337, suffix), on=True)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    stats.print_stats(30)
    print(out.getvalue()[:8000])


def trace(bench, prefix, suffix) -> None:
    """Where the time of one off and one on request goes (printed, not recorded)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for on in (False, True, False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds, _ = bench.generate(prefix + tokens(4242 + on + 2 * int(seconds_seen(on)),
                                                        suffix), on)
        torch.cuda.synchronize()
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        print(f"[trace] {'on' if on else 'off'}: {seconds * 1e3:.1f} ms wall, device "
              f"{device_us / 1e3:.1f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(events.table(sort_by="self_device_time_total", row_limit=8,
                           max_name_column_width=60))


_SEEN: dict = {}


def seconds_seen(on: bool) -> int:
    _SEEN[on] = _SEEN.get(on, 0) + 1
    return _SEEN[on]


def summarise(name, times, gather_ms, layers, new_tokens, equal, chunks, steps=1) -> dict:
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    share = None if gather_ms is None else gather_ms * layers * steps / 1000 / off
    return {"case": name, "ttft_off_s": round(off, 4), "ttft_on_s": round(on, 4),
            "on_over_off": round(on / off, 4), "times": times,
            "prefill_tok_s_off": round(new_tokens / off), "prefill_tok_s_on": round(new_tokens / on),
            "gather_ms_per_layer": None if gather_ms is None else round(gather_ms, 4),
            "context_chunks_last_step": chunks,
            "gather_share_off": None if share is None else round(share, 5), **equal}


def table(rows) -> str:
    lines = ["| case | TTFT off (s) | TTFT on (s) | on/off | gather per layer (ms) | gather "
             "share of off | tokens equal | max logprob gap |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['ttft_off_s']:.4f} | {r['ttft_on_s']:.4f} | "
                     f"{r['on_over_off']:.4f} | {r['gather_ms_per_layer']} | "
                     f"{r['gather_share_off']} | {r['tokens_equal']} | "
                     f"{r['max_logprob_gap']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
