"""Why the host share's worker runs no Python (Note [Host node]): a CPU worker's torch ops beside a
thread busy in Python, as a Python loop and as one TorchScript call.

The worker thread times its own work (``iterations`` rounds of small matmuls, as a decode step's
host experts are small GEMMs) three ways, each alone and beside a thread running Python bytecode
(vLLM's scheduler and model runner prepare the next step while the GPU runs this one):

* ``python``: the ops called from Python, one by one (torch releases the GIL inside each op and
  takes it back between them);
* ``torchscript``: the same loop compiled, called once per round (the GIL taken at the call and
  its return only);

and prints ms per round and the slowdown. No GPU needed: it measures the interpreter.

    python3 tools/host_worker_gil.py [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringflow.bench import records  # noqa: E402
from ringflow.testing.busy_python import BusyPython  # noqa: E402


def rounds(x: torch.Tensor, ws: list[torch.Tensor], iterations: int) -> torch.Tensor:
    for _ in range(iterations):
        for w in ws:
            x = torch.nn.functional.linear(x, w).tanh()
    return x


def on_worker(fn, repeats: int) -> float:
    """Median ms of ``fn()`` timed on a thread of its own (one CPU thread for torch)."""
    times: list[float] = []

    def run() -> None:
        torch.set_num_threads(1)
        fn()
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--iterations", type=int, default=20, help="rounds of 8 matmuls per call")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    ws = [torch.randn(64, 64) for _ in range(8)]
    x = torch.randn(1, 64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        compiled = torch.jit.script(rounds)
    ways = {"python": lambda: rounds(x, ws, args.iterations),
            "torchscript": lambda: compiled(x, ws, args.iterations)}
    table = {}
    for name, fn in ways.items():
        alone = on_worker(fn, args.repeats)
        with BusyPython():
            busy = on_worker(fn, args.repeats)
        table[name] = {"alone_ms": round(alone, 3), "beside_busy_python_ms": round(busy, 3),
                       "slowdown": round(busy / alone, 1)}
    ops = args.iterations * len(ws) * 2
    doc = records.record("tools/host_worker_gil.py", host=_cpu(), ops_per_call=ops,
                         switch_interval_s=sys.getswitchinterval(), ways=table)
    if args.out:
        records.write(args.out, doc)
    print(f"{ops} torch ops per call on a worker thread; Python's switch interval "
          f"{1e3 * sys.getswitchinterval():.0f} ms")
    print(f"{'way':>12} {'alone ms':>9} {'beside busy Python ms':>22} {'slowdown':>9}")
    for name, row in table.items():
        print(f"{name:>12} {row['alone_ms']:>9} {row['beside_busy_python_ms']:>22} "
              f"{row['slowdown']:>8}x")
    return 0


def _cpu() -> dict:
    import os
    name = "unknown"
    try:
        name = next(line.split(":", 1)[1].strip() for line in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": name, "logical_cpus": os.cpu_count()}


if __name__ == "__main__":
    sys.exit(main())
