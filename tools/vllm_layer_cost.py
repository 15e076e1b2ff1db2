#!/usr/bin/env python3
"""What ringflow's layer boundaries cost inside vLLM's engine, with nothing streamed.

    python3 tools/vllm_layer_cost.py [--repeats 3] [--modes default,full] [--configs ...]
                                     [--engines default/plain,...] [--json FILE]

An 8B-shaped Llama (tools/vllm_bench.py's, dummy weights: time does not depend on values) in
vLLM's default model runner, per CUDA graph mode (``default``: vLLM's FULL_AND_PIECEWISE,
``full``: FULL), one engine per configuration:

* ``plain``: vLLM alone;
* ``ops``: ``RINGFLOW_LAYER_OPS_ONLY=1``, every decoder layer between ringflow's layer ops and
  vLLM's pieces split there, nothing streamed (the cost of the boundary itself);
* ``stream-ops``: the same switch with ``stream``'s profile: only the layers streaming wraps
  (the first, the last and the 4 offloaded ones, Note [Boundary layers]), nothing streamed;
* ``stream``: ``offload: {count: 4}`` placed by the planner, depth 1 (what streaming adds).

All engines start first and stay alive (one engine-core process each), then are measured
interleaved, round by round, so every ratio comes from one run. Phases: ``prefill`` (16 prompts
of 2,000 tokens, one new token each), ``decode`` (32 short prompts, 64 new tokens: uniform
decode steps, FULL graphs), ``mixed`` (32 prompts of 2,000 tokens and 32 short prompts with 16
new tokens in one call: prefill chunks and decodes share steps, piecewise graphs). Ratios are
medians of the engine's times over plain vLLM's in the same mode. Target (issue #25): ``ops``
at most 1.01x in every phase.

Engines of one configuration can run more than once (``full/plain#2``): their ratios to each
other are the spread between engines of one configuration, the noise floor every other ratio
is read against; plain vLLM's time is then the median over all its engines' rounds. Each round
starts one engine further along, so no engine is always measured first.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import LAYER_MIB, LLAMA_8B  # noqa: E402

GRAPH_MODES = {"default": {}, "full": {"cudagraph_mode": "FULL"}}
STREAM = {"ringflow": {"name": "cost-stream", "offload": {
    "layers": {"count": 4}, "depth": 1, "workspace_mib": 2 * LAYER_MIB}}}
CONFIGS = {"plain": ({}, None), "ops": ({"RINGFLOW_LAYER_OPS_ONLY": "1"}, None),
           "stream-ops": ({"RINGFLOW_LAYER_OPS_ONLY": "1"}, STREAM), "stream": ({}, STREAM)}


def start(model: Path, mode: str, name: str, utilization: float):
    """One engine; its engine-core process inherits the switches set while it starts."""
    from vllm import LLM

    env, extra = CONFIGS[name.split("#")[0]]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                   dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                   max_num_batched_tokens=8192, seed=0, enable_prefix_caching=False,
                   gpu_memory_utilization=utilization,
                   compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
                                       **GRAPH_MODES[mode]},
                   **({"additional_config": extra} if extra else {}))
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--modes", default="default,full", help="graph modes (default,full)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=",".join(CONFIGS))
    parser.add_argument("--engines", default=None,
                        help="mode/config pairs, e.g. default/plain,default/stream (default: "
                             "every mode with every config)")
    parser.add_argument("--utilization", type=float, default=0.15,
                        help="gpu_memory_utilization of each engine (default 0.15)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    pairs = [tuple(e.split("/", 1)) for e in args.engines.split(",")] if args.engines else \
        [(m, c) for m in args.modes.split(",") for c in args.configs.split(",")]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in GRAPH_MODES or pair[1].split("#")[0] not in CONFIGS:
            parser.error(f"unknown engine '{'/'.join(pair)}' (modes: {', '.join(GRAPH_MODES)}; "
                         f"configs: {', '.join(CONFIGS)})")

    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.bench import records
    from ringflow.bench.exit import exit_now

    model = Path(tempfile.mkdtemp()) / "llama8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    engines, results = {}, {}
    for mode, name in pairs:
        key = f"{mode}/{name}"
        t0 = time.perf_counter()
        engines[key] = start(model, mode, name, args.utilization)
        config = engines[key].llm_engine.vllm_config
        results[key] = {"startup_s": round(time.perf_counter() - t0, 1),
                        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                        "kv_tokens": config.cache_config.num_gpu_blocks *
                        config.cache_config.block_size,
                        "prefill_s": [], "decode_s": [], "mixed_s": []}
        print(f"[layer-cost] {key}: started in {results[key]['startup_s']} s "
              f"({results[key]['cudagraph_mode']})", flush=True)

    vocab = LLAMA_8B["vocab_size"]

    def prompt(i, n):
        return TokensPrompt(prompt_token_ids=[(i * 7919 + j * 104729) % (vocab - 3) + 3
                                              for j in range(n)])

    long = [prompt(i, 2000) for i in range(32)]
    short = [prompt(1000 + i, 32) for i in range(32)]

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    phases = {"prefill": (long[:16], [params(1)] * 16), "decode": (short, [params(64)] * 32),
              "mixed": (long + short, [params(1)] * 32 + [params(16)] * 32)}
    for llm in engines.values():  # warm-up: first replays, lazy allocations
        for prompts, sampling in phases.values():
            llm.generate(prompts[:4] + prompts[-4:], sampling[:4] + sampling[-4:],
                         use_tqdm=False)
    keys = list(engines)
    for round_ in range(args.repeats):
        for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:  # every engine once
            llm = engines[key]
            for phase, (prompts, sampling) in phases.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, sampling, use_tqdm=False)
                results[key][f"{phase}_s"].append(time.perf_counter() - t0)
        print(f"[layer-cost] round {round_} done", flush=True)

    for key, r in results.items():
        mode = key.split("/")[0]
        plains = [v for k, v in results.items()
                  if k.split("/")[0] == mode and k.split("/")[1].split("#")[0] == "plain"]
        for phase in phases:
            r[f"{phase}_s_median"] = round(statistics.median(r[f"{phase}_s"]), 4)
            if plains:  # plain vLLM: the median over every plain engine's rounds
                base = statistics.median(t for p in plains for t in p[f"{phase}_s"])
                r[f"{phase}_vs_plain"] = round(r[f"{phase}_s_median"] / base, 4)
    doc = records.record("python3 tools/vllm_layer_cost.py", vllm=vllm.__version__, repeats=args.repeats,
                         runner=os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "vLLM's default"),
                         order="round r starts at engine r mod engines",
                         model="Llama 8B shapes, dummy", results=results)
    if args.json:
        records.write(args.json, doc)
    print("| engine | graphs | KV tokens | prefill s | decode s | mixed s | prefill/plain | "
          "decode/plain | mixed/plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        print(f"| {key} | {r['cudagraph_mode']} | {r['kv_tokens']:,} | {r['prefill_s_median']} | "
              f"{r['decode_s_median']} | {r['mixed_s_median']} | {r.get('prefill_vs_plain', '-')} "
              f"| {r.get('decode_vs_plain', '-')} | {r.get('mixed_vs_plain', '-')} |")
    sys.stdout.flush()
    exit_now()  # engine shutdown can hang; the results are written


if __name__ == "__main__":
    main()
