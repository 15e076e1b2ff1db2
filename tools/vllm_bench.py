#!/usr/bin/env python3
"""Weight streaming in vLLM's real engine: ringflow vs vLLM's prefetch offloader vs all resident.

    python3 tools/vllm_bench.py [--pattern groups|placed|all] [--repeats 3] [--json FILE]

An 8B-shaped Llama (32 layers, hidden 4096, bf16, dummy weights: speed does not depend on
values). Every configuration is a separate engine (its own engine-core process), all started
first and kept alive, then measured interleaved, repeat by repeat, so the ratios come from one
run: prefill throughput (16 prompts of 2,000 tokens) and decode throughput (32 requests, 64
new tokens each, short prompts). Each engine's KV cache size is read back from vLLM.

Patterns: ``groups`` offloads the last 2 of every 8 layers (vLLM: --offload-group-size 8
--offload-num-in-group 2); ``placed`` gives vLLM the same and ringflow ``{count: 8}``, the 8
layers its planner places (Note [Placement model]), through the same ring memory; ``all``
offloads every layer. Rings: 2 layer-slots (vLLM
--offload-prefetch-step 2, ringflow depth 1) and 1 slot (step 1, depth 0). vLLM's prefetch
offloader only works under the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, set here).

``--breakable`` runs every engine under vLLM's breakable CUDA graphs
(VLLM_USE_BREAKABLE_CUDAGRAPH=1, cudagraph_mode PIECEWISE: every step a replay of segments
broken at the attention ops) and adds ``ringflow-2slot-sync`` (``offload.synchronous``: each
copy on vLLM's stream right before its layer, nothing overlapped), so the run says how much of
the copy time ringflow's breaks hide there: (sync - 2slot) / (sync - resident).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
LAYER_MIB = 436  # one layer's weights in bf16 (4 attention + 3 MLP matrices), rounded up


def configs(pattern: str) -> dict[str, dict]:
    """Engine keyword arguments per configuration."""
    if pattern in ("groups", "placed"):
        vllm_layers = dict(offload_group_size=8, offload_num_in_group=2)
        ours = {"every": 8, "last": 2} if pattern == "groups" else {"count": 8}
    else:
        vllm_layers = dict(offload_group_size=1, offload_num_in_group=1)
        ours = "all"

    def ringflow(depth):
        return {"additional_config": {"ringflow": {"name": f"bench-d{depth}", "offload": {
            "layers": ours, "depth": depth, "workspace_mib": (depth + 1) * LAYER_MIB}}}}

    def vllm(step):
        return {"offload_backend": "prefetch", "offload_prefetch_step": step, **vllm_layers}

    sync = ringflow(1)
    sync["additional_config"]["ringflow"]["offload"]["synchronous"] = True
    return {"resident": {}, "vllm-2slot": vllm(2), "ringflow-2slot": ringflow(1),
            "vllm-1slot": vllm(1), "ringflow-1slot": ringflow(0), "ringflow-2slot-sync": sync}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", choices=["groups", "placed", "all"], default="groups",
                        help="which layers are offloaded (default: last 2 of every 8; placed: "
                             "ringflow's planner picks 8)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--only", default=None, help="comma-separated configurations")
    parser.add_argument("--utilization", type=float, default=0.17,
                        help="gpu_memory_utilization of each engine (default 0.17)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--breakable", action="store_true",
                        help="vLLM's breakable CUDA graphs, PIECEWISE (see above)")
    args = parser.parse_args()
    if args.breakable:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # vLLM's offloader is a no-op in V2

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.bench import records
    from ringflow.bench.exit import exit_now

    model = Path(tempfile.mkdtemp()) / "llama8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    chosen = configs(args.pattern)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    elif not args.breakable:
        chosen.pop("ringflow-2slot-sync")
    graphs = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    if args.breakable:
        graphs["cudagraph_mode"] = "PIECEWISE"
    engines, results = {}, {}
    for name, extra in chosen.items():
        t0 = time.perf_counter()
        engines[name] = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                            dtype="bfloat16", max_model_len=4096, max_num_seqs=32,
                            max_num_batched_tokens=8192, seed=0, enable_prefix_caching=False,
                            gpu_memory_utilization=args.utilization,
                            compilation_config=graphs, **extra)
        cache = engines[name].llm_engine.vllm_config.cache_config
        results[name] = {"startup_s": round(time.perf_counter() - t0, 1),
                         "kv_tokens": cache.num_gpu_blocks * cache.block_size,
                         "prefill_tok_s": [], "decode_tok_s": []}
        print(f"[vllm-bench] {name}: started in {results[name]['startup_s']} s, "
              f"{results[name]['kv_tokens']:,} KV tokens", flush=True)

    vocab = LLAMA_8B["vocab_size"]
    long = [TokensPrompt(prompt_token_ids=[(i * 7919 + j * 104729) % (vocab - 3) + 3
                                           for j in range(2000)]) for i in range(16)]
    short = [TokensPrompt(prompt_token_ids=[(i * 31 + j) % (vocab - 3) + 3 for j in range(32)])
             for i in range(32)]
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    decode = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    for llm in engines.values():  # warm-up: first graph replays, lazy allocations
        llm.generate(long[:2], prefill, use_tqdm=False)
        llm.generate(short[:4], decode, use_tqdm=False)

    def summary(rounds: int) -> dict:
        """Medians and ratios of the rounds so far, as the JSON record (written after every
        round, so a run cut short by a time limit keeps what it measured)."""
        base = results.get("resident")
        for name, r in results.items():
            r["prefill_tok_s_median"] = round(statistics.median(r["prefill_tok_s"]))
            r["decode_tok_s_median"] = round(statistics.median(r["decode_tok_s"]), 1)
        for name, r in results.items():
            if base:
                r["prefill_vs_resident"] = round(r["prefill_tok_s_median"] /
                                                 base["prefill_tok_s_median"], 3)
                r["decode_vs_resident"] = round(r["decode_tok_s_median"] /
                                                base["decode_tok_s_median"], 3)
                r["kv_tokens_vs_resident"] = r["kv_tokens"] - base["kv_tokens"]
            twin = name.replace("ringflow", "vllm")
            sync = results.get(name + "-sync")
            if base and sync:  # the share of the exposed copy time the overlap hides
                exposed = 1 / sync["decode_tok_s_median"] - 1 / base["decode_tok_s_median"]
                r["decode_copy_time_hidden"] = round(
                    (1 / sync["decode_tok_s_median"] - 1 / r["decode_tok_s_median"]) / exposed,
                    3) if exposed > 0 else None
            if name.startswith("ringflow") and twin in results:
                v = results[twin]
                r["prefill_vs_vllm"] = round(r["prefill_tok_s_median"] /
                                             v["prefill_tok_s_median"], 3)
                r["decode_vs_vllm"] = round(r["decode_tok_s_median"] /
                                            v["decode_tok_s_median"], 3)
                r["kv_tokens_vs_vllm"] = r["kv_tokens"] - v["kv_tokens"]
        doc = records.record("python3 tools/vllm_bench.py" + " --breakable" * args.breakable,
                             vllm=vllm.__version__, breakable_graphs=args.breakable,
                             runner="V1 (VLLM_USE_V2_MODEL_RUNNER=0)", pattern=args.pattern,
                             repeats=args.repeats, rounds_done=rounds,
                             model="Llama 8B shapes, dummy", results=results)
        if args.json:
            records.write(args.json, doc)
        return doc

    for round_ in range(args.repeats):
        for name, llm in engines.items():  # interleaved: every configuration once per round
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(long, prefill, use_tqdm=False)
            results[name]["prefill_tok_s"].append(16 * 2000 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            llm.generate(short, decode, use_tqdm=False)
            results[name]["decode_tok_s"].append(32 * 64 / (time.perf_counter() - t0))
        summary(round_ + 1)
        print(f"[vllm-bench] round {round_} done", flush=True)
    print("| config | startup s | KV tokens | prefill tok/s | decode tok/s | prefill/res | "
          "decode/res | prefill/vLLM | decode/vLLM | KV vs vLLM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['startup_s']} | {r['kv_tokens']:,} | {r['prefill_tok_s_median']:,} "
              f"| {r['decode_tok_s_median']} | {r.get('prefill_vs_resident', '-')} | "
              f"{r.get('decode_vs_resident', '-')} | {r.get('prefill_vs_vllm', '-')} | "
              f"{r.get('decode_vs_vllm', '-')} | {r.get('kv_tokens_vs_vllm', '-')} |")
    sys.stdout.flush()
    exit_now()  # engine shutdown can hang; the results are written


if __name__ == "__main__":
    main()
