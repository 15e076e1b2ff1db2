#!/usr/bin/env python3
"""What a user sees for each profile mistake in vLLM's OpenAI server (#38): exit status, lines on
stderr, seconds to the error, and the last line, on this machine's vLLM (the CPU build in CI).

    python3 tools/vllm_error_lines.py [--json FILE]

Each input is one start of ``python -m vllm.entrypoints.openai.api_server`` with a tiny
seeded Llama (4 layers): the profile mistakes vLLM's front end catches, and one found while the
model loads (a ring too small for one layer). ringflow's line should be the last one, with exit
status 2 and no traceback.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
SERVER = "vllm.entrypoints.openai.api_server"
CPU = ["--skip-tokenizer-init", "--max-model-len", "256", "--enforce-eager",
       "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(32 << 20)]


def offload(**fields) -> list[str]:
    section = {"layers": "all", "depth": 1, "workspace_mib": 64, **fields}
    return ["--additional-config", json.dumps({"ringflow": {"offload": section}})]


def inputs(scratch: Path) -> dict[str, tuple[dict, list[str]]]:
    latin = scratch / "latin1.yaml"
    latin.write_bytes("name: caf\xe9\noffload: {layers: all, depth: 1, workspace_mib: 64}\n"
                      .encode("latin-1"))
    small = scratch / "small-ring.yaml"
    small.write_text("offload: {layers: all, depth: 1, workspace_mib: 1}\n")
    return {
        "a directory as profile path": ({"RINGFLOW_PROFILE": str(scratch)}, []),
        "layers: []": ({}, offload(layers=[])),
        "layers: {every: 0}": ({}, offload(layers={"every": 0})),
        "depth: -1": ({}, offload(depth=-1)),
        'workspace_mib: "1GiB"': ({}, offload(workspace_mib="1GiB")),
        "a Latin-1 file": ({"RINGFLOW_PROFILE": str(latin)}, []),
        "RINGFLOW_PROFILE=vllm_weightz": ({"RINGFLOW_PROFILE": "vllm_weightz"}, []),
        "layers: [7] on 4 layers": ({}, offload(layers=[7])),
        '"ringflow": [ ]': ({}, ["--additional-config", '{"ringflow": []}']),
        '"ringflow": {}': ({}, ["--additional-config", '{"ringflow": {}}']),
        "RINGFLOW_PROFILE=demo": ({"RINGFLOW_PROFILE": "demo"}, []),
        "after load: a ring of 1 MiB": ({"RINGFLOW_PROFILE": str(small)}, []),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from helpers.vllm_e2e import write_model
    from ringflow.bench import records
    import vllm

    scratch = Path(tempfile.mkdtemp())
    model = write_model(scratch / "models", "llama")
    rows = []
    for name, (env, extra) in inputs(scratch).items():
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", SERVER, "--model", model, *CPU, *extra,
                               "--port", "0"], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=600)
        err = proc.stderr.splitlines()
        rows.append({"input": name, "exit": proc.returncode, "stderr_lines": len(err),
                     "tracebacks": sum("Traceback" in l for l in err),
                     "seconds": round(time.perf_counter() - began, 1),
                     "last_line": err[-1] if err else ""})
        print(f"| {name} | {proc.returncode} | {len(err)} | {rows[-1]['tracebacks']} | "
              f"{rows[-1]['seconds']} | {rows[-1]['last_line'][:110]} |", flush=True)
    if args.json:
        records.write(args.json, records.record("python3 tools/vllm_error_lines.py",
                                                vllm=vllm.__version__, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
