#!/usr/bin/env python3
"""Routed experts from host memory in vLLM's real engine: ringflow's expert cache vs its peers.

    python3 tools/experts_bench.py [--layers 4] [--repeats 2] [--only a,b] [--json FILE]

A Qwen3-30B-A3B-shaped MoE (hidden 2048, 128 experts of intermediate 768, top-8, bf16, dummy
weights: speed does not depend on values; ``--layers`` of its 48 layers) in vLLM 0.26's engine,
vLLM's default graphs (FULL_AND_PIECEWISE, captured sizes 1, 8, 64), the V1 model runner (vLLM's
prefetch offloader needs it). The experts get the same device memory everywhere but
``resident``: that of a quarter of them:

* ``resident``: every expert in device memory (the ceiling);
* ``ringflow``: every layer's experts in pinned host memory (vLLM's UVA offloader loads them
  there), 32 of 128 cached per layer, each step fetching the missed ones (Note [Experts in
  vLLM]);
* ``ringflow-lookahead``: the same, each layer guessing the next layer's experts a layer early
  (Note [Expert lookahead]);
* ``ringflow-passes``: the same without reading in place (``in_place_tokens: 0``): steps that
  need more experts than the slots hold copy them all in passes (Note [Expert cache]);
* ``vllm-uva``: vLLM's UVA offloader on three quarters of the experts (its MoE kernel reads
  them across the host link every step, no cache), the rest resident;
* ``ringflow-layers``: ringflow's whole-layer streaming, every layer through a ring of two;
* ``vllm-prefetch``: vLLM's prefetch offloader on every layer's experts, two layers ahead. It
  starts last: it makes its dummy weights on the CPU, which took 290 s for 8 layers on the
  H200's host.

Every engine's warm-up runs each batch size once (in the first run, whose warm-ups did not,
the first engine decoded slower at batch 8 than at batch 1, most likely compiling kernels while
measured).
Engines are started one after the other and kept alive (each its own engine-core process);
each is measured once as soon as it is up (a run cut short keeps those rows), then the other
rounds go interleaved, so ratios come from one run: prefill of one 8,192-token prompt
(TTFT and tok/s), and decode at batch 1, 8 and 64 (tok/s). For ``ringflow`` the cache's miss
counters give the experts missed per decode step; ``bound`` is the time those bytes take at the
measured pinned copy rate (55 GB/s on the H200), added to ``resident``'s step: the fastest a
design that copies exactly the missed experts, one layer after the other, can go.
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN3_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}
EXPERT_BYTES = 3 * 2048 * 768 * 2  # gate, up and down of one expert, bf16: 9.4 MB
PINNED_GBPS = 55.0  # measured pinned host-to-device copy rate on the H200
SLOTS = 32  # a quarter of 128
BATCHES = {1: 32, 8: 32, 64: 16}  # decode batch -> new tokens per request
PREFILL = 8192
LANES = ("ringflow", "ringflow-lookahead", "ringflow-passes")  # the expert lane's variants


def configs(layers: int) -> dict[str, dict]:
    """Engine keyword arguments per configuration (module docstring)."""
    experts_gib = layers * 128 * EXPERT_BYTES / 2**30
    layer_mib = math.ceil((128 * EXPERT_BYTES + 60 * 2**20) / 2**20)  # experts + attention
    lane = {"moe_backend": "triton", "cpu_offload_gb": math.ceil(experts_gib),
            "cpu_offload_params": {"experts"}}
    return {
        "resident": {"moe_backend": "triton"},
        "ringflow": {**lane, "additional_config": {"ringflow": {"name": "experts-bench",
                                                               "experts": {"layers": "all",
                                                                           "slots": SLOTS}}}},
        "ringflow-lookahead": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-lookahead", "experts": {
                "layers": "all", "slots": SLOTS, "lookahead": True}}}},
        "vllm-uva": {"moe_backend": "triton", "cpu_offload_gb": round(experts_gib * 0.75, 2),
                     "cpu_offload_params": {"experts"}},
        "ringflow-passes": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-passes", "experts": {
                "layers": "all", "slots": SLOTS, "in_place_tokens": 0}}}},
        "ringflow-layers": {"moe_backend": "triton", "additional_config": {"ringflow": {
            "name": "experts-bench-layers", "offload": {
                "layers": "all", "depth": 1, "workspace_mib": 2 * layer_mib}}}},
        "vllm-prefetch": {"moe_backend": "triton", "offload_backend": "prefetch",
                          "offload_group_size": 1, "offload_num_in_group": 1,
                          "offload_prefetch_step": 2, "offload_params": {"experts"}},
    }


def expert_counters(worker=None) -> list[int]:
    """[hits, misses] over every expert cache in this worker (collective_rpc runs it there)."""
    from ringflow.integrations.vllm.state import STATE
    caches = [c for per_model in list(STATE.expert_caches.values()) for c in per_model.values()]
    return [sum(int(c.hits) for c in caches), sum(int(c.misses) for c in caches)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default 4 of 48)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--only", default=None, help="comma-separated configurations")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.repeats < 1 or args.layers < 4:
        parser.error("--repeats must be at least 1 and --layers at least 4")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # vLLM's prefetch offloader needs V1
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(function)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.bench import records

    model = Path(tempfile.mkdtemp()) / "qwen3-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN3_A3B,
                                                   "num_hidden_layers": args.layers}))
    chosen = configs(args.layers)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    vocab = QWEN3_A3B["vocab_size"]
    long = [TokensPrompt(prompt_token_ids=[(j * 7919) % (vocab - 3) + 3 for j in range(PREFILL)])]
    short = [TokensPrompt(prompt_token_ids=[(i * 31 + j * 17) % (vocab - 3) + 3
                                            for j in range(16)]) for i in range(64)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)

    def summary(rounds: int) -> dict:
        """Medians, ratios and the bound, as the JSON record (written after every round, so a
        run cut short by a time limit keeps what it measured)."""
        live = {n: r for n, r in results.items() if "error" not in r and r["ttft_s"]}
        for r in live.values():
            for key in [k for k, v in r.items() if isinstance(v, list)]:
                r[key + "_median"] = round(statistics.median(r[key]), 3 if key == "ttft_s" else 1)
        base, ours = live.get("resident"), live.get("ringflow")
        for name, r in live.items():
            for b in BATCHES:
                key = f"decode_b{b}_tok_s_median"
                if base:
                    r[f"decode_b{b}_vs_resident"] = round(r[key] / base[key], 3)
                if ours and name != "ringflow":
                    r[f"ringflow_decode_b{b}_vs_this"] = round(ours[key] / r[key], 2)
            if ours and name != "ringflow":
                r["ringflow_prefill_vs_this"] = round(ours["prefill_tok_s_median"] /
                                                      r["prefill_tok_s_median"], 2)
        if base and ours and ours.get("missed_per_step"):
            for b in BATCHES:
                missed = statistics.median(ours["missed_per_step"][str(b)])
                copy_s = missed * EXPERT_BYTES / (PINNED_GBPS * 1e9)
                step_s = b / base[f"decode_b{b}_tok_s_median"]
                bound = b / (step_s + copy_s)
                ours[f"decode_b{b}_missed_experts_per_step"] = round(missed, 1)
                ours[f"decode_b{b}_bound_tok_s"] = round(bound, 1)
                ours[f"decode_b{b}_bound_over_ringflow"] = round(
                    bound / ours[f"decode_b{b}_tok_s_median"], 2)
        doc = records.record("python3 tools/experts_bench.py", vllm=vllm.__version__,
                             runner="V1 (VLLM_USE_V2_MODEL_RUNNER=0)", layers=args.layers,
                             repeats=args.repeats, rounds_done=rounds, slots_per_layer=SLOTS,
                             model=f"Qwen3-30B-A3B shapes, {args.layers} layers, dummy weights",
                             pinned_gbps=PINNED_GBPS, decode_new_tokens=BATCHES,
                             prefill_tokens=PREFILL, results=results)
        if args.json:
            records.write(args.json, doc)
        return doc

    def measure(name: str, llm) -> None:
        r = results[name]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(long, first, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        r["ttft_s"].append(elapsed)
        r["prefill_tok_s"].append(PREFILL / elapsed)
        for b, new in BATCHES.items():
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                    detokenize=False)
            before = llm.collective_rpc(expert_counters)[0] if name in LANES else None
            t0 = time.perf_counter()
            llm.generate(short[:b], params, use_tqdm=False)
            r[f"decode_b{b}_tok_s"].append(b * new / (time.perf_counter() - t0))
            if before is not None:
                after = llm.collective_rpc(expert_counters)[0]
                per = r.setdefault("missed_per_step", {}).setdefault(str(b), [])
                per.append((after[1] - before[1]) / new)  # the one prefill step included
                hits = r.setdefault("hit_rate", {}).setdefault(str(b), [])
                seen = (after[0] - before[0]) + (after[1] - before[1])
                hits.append(round((after[0] - before[0]) / seen, 3) if seen else None)
        if name in LANES:  # per layer: hits, misses, steps in place, lookahead's guesses
            from ringflow.integrations.vllm.experts import worker_report
            r["report"] = {"layers": llm.collective_rpc(worker_report)[0]}

    engines, results = {}, {}
    for name, extra in chosen.items():
        t0 = time.perf_counter()
        try:
            engines[name] = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                                dtype="bfloat16", max_model_len=PREFILL + 256, max_num_seqs=64,
                                max_num_batched_tokens=PREFILL, seed=0,
                                enable_prefix_caching=False, kv_cache_memory_bytes=4 << 30,
                                gpu_memory_utilization=0.5,
                                compilation_config={"cudagraph_capture_sizes": [1, 8, 64]},
                                **extra)
        except Exception as exc:  # a peer that cannot start is a row that says why
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            print(f"[experts-bench] {name}: did not start: {results[name]['error']}", flush=True)
            continue
        results[name] = {"startup_s": round(time.perf_counter() - t0, 1),
                         "prefill_tok_s": [], "ttft_s": [],
                         **{f"decode_b{b}_tok_s": [] for b in BATCHES}}
        print(f"[experts-bench] {name}: started in {results[name]['startup_s']} s", flush=True)
        llm = engines[name]  # warm-up: first replays, kernels compiled for every batch size
        llm.generate(long, first, use_tqdm=False)
        for b in BATCHES:
            llm.generate(short[:b], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   detokenize=False), use_tqdm=False)
        measure(name, llm)  # round 0 now: a run cut short keeps every engine measured so far
        summary(1)

    for round_ in range(1, args.repeats):
        for name, llm in engines.items():  # interleaved: every configuration once per round
            measure(name, llm)
        summary(round_ + 1)
        print(f"[experts-bench] round {round_} done", flush=True)
    doc = summary(args.repeats)
    live = {n: r for n, r in doc["results"].items() if "error" not in r}
    print("| config | prefill 8k tok/s | TTFT s | " +
          " | ".join(f"decode b{b} tok/s" for b in BATCHES) + " | ringflow b1/this |")
    print("| --- " * (4 + len(BATCHES)) + "|")
    for name, r in live.items():
        print(f"| {name} | {r['prefill_tok_s_median']:,} | {r['ttft_s_median']} | " +
              " | ".join(str(r[f"decode_b{b}_tok_s_median"]) for b in BATCHES) +
              f" | {r.get('ringflow_decode_b1_vs_this', '-')} |")
    ours = live.get("ringflow", {})
    if "decode_b1_bound_tok_s" in ours:
        print("| bound (resident step + missed experts at 55 GB/s) | | | " +
              " | ".join(f"{ours[f'decode_b{b}_bound_tok_s']} (x{ours[f'decode_b{b}_bound_over_ringflow']})"
                         for b in BATCHES) + " | |")
    for name, r in doc["results"].items():
        if "error" in r:
            print(f"| {name} | did not start: {r['error'][:120]} |")
    sys.stdout.flush()
    os._exit(0)  # engine shutdown can hang; the results are written


if __name__ == "__main__":
    main()
