#!/usr/bin/env python3
"""What ringflow's layer ops put into the CUDA graphs vLLM captures: every node of every graph,
plain vLLM beside the layer ops with nothing streamed. Noise-free where timing is not.

    python3 tools/vllm_graph_census.py [--engines default/plain,default/stream-ops,...]
                                       [--json FILE]

A decode step under FULL graphs (FULL, or FULL_AND_PIECEWISE's uniform decode) is one graph
replay: if the graph vLLM captured with ringflow's ops holds the same kernels, with the same
launch shapes, as plain vLLM's, the ops cost that step nothing on the device, at any resolution
(issue #25's decode target, which timing could not resolve below the 5% spread between two plain
engines). The ops run at capture time only; what they could add is work they issue, or what the
compiler did differently around them (a copy to materialise an anchored tensor, a fusion lost
across the boundary): both show up here as nodes.

Each engine runs in a process of its own (vLLM's engine core in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the 8B-shaped Llama of ``tools/vllm_bench.py`` with dummy
weights, CUDA graphs for 1 to 64 tokens (``tools/vllm_layer_cost.py``'s engines). While vLLM
captures, each graph's nodes are read from the capturing stream before the capture ends
(``cuStreamGetCaptureInfo``, then ``cuGraphGetNodes``; a kernel node's name from
``cuFuncGetName``, its grid and block). A graph is ``FULL`` when vLLM's model runner captured
it (or a ``CUDAGraphWrapper`` in FULL mode) and ``PIECEWISE`` inside a piecewise wrapper.
Compared per graph mode with plain vLLM: the FULL graphs one by one (same capture sizes, same
order), kernels as a multiset of (name, grid, block), Inductor's kernel numbers dropped
(``triton_poi_fused_add_3`` and ``_7`` are the same kernel compiled in another partition).
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ENGINES = "default/plain,default/stream-ops,default/ops,full/plain,full/stream-ops"
_INDUCTOR_NUMBER = re.compile(r"^(triton_\w+?)_\d+$")


def _ok(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest


def graph_nodes(stream: int) -> list[dict]:
    """Every node of the graph ``stream`` is capturing into: type, and for kernels name, grid
    and block."""
    from cuda.bindings import driver as cu

    rest = _ok(cu.cuStreamGetCaptureInfo(cu.CUstream(stream)))
    graph = next(x for x in rest if isinstance(x, cu.CUgraph))
    count = _ok(cu.cuGraphGetNodes(graph, 0))[-1]
    nodes = _ok(cu.cuGraphGetNodes(graph, count))[0] if count else []
    out = []
    for node in nodes:
        kind = _ok(cu.cuGraphNodeGetType(node))[0]
        entry = {"type": kind.name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()}
        if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            p = _ok(cu.cuGraphKernelNodeGetParams(node))[0]
            try:
                name = _ok(cu.cuFuncGetName(p.func) if int(p.func) else
                           cu.cuKernelGetName(p.kern))[0]
                name = name.decode() if isinstance(name, bytes) else str(name)
            except RuntimeError as exc:  # a kernel the driver cannot name: its failure instead
                name = f"<unnamed: {exc}>"
            entry.update(name=name, grid=[p.gridDimX, p.gridDimY, p.gridDimZ],
                         block=[p.blockDimX, p.blockDimY, p.blockDimZ])
        out.append(entry)
    return out


def census(mode: str, config: str) -> dict:
    """Start one engine with every capture read; return what each graph held."""
    import torch
    import vllm.compilation.cuda_graph as vllm_graphs

    from vllm_bench import LLAMA_8B
    from vllm_layer_cost import start

    captures, wrapper_mode = [], []
    end = torch.cuda.graphs.CUDAGraph.capture_end

    def capture_end(self):
        nodes = graph_nodes(torch.cuda.current_stream().cuda_stream)
        captures.append({"by": wrapper_mode[-1] if wrapper_mode else "FULL", "nodes": nodes})
        return end(self)

    call = vllm_graphs.CUDAGraphWrapper.__call__

    def wrapper_call(self, *args, **kwargs):
        wrapper_mode.append(self.runtime_mode.name)
        try:
            return call(self, *args, **kwargs)
        finally:
            wrapper_mode.pop()

    torch.cuda.graphs.CUDAGraph.capture_end = capture_end
    vllm_graphs.CUDAGraphWrapper.__call__ = wrapper_call
    model = Path(tempfile.mkdtemp()) / "llama8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    llm = start(model, mode, config, 0.3)
    graphs = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    return {"cudagraph_mode": str(graphs), "captures": captures}


def signature(node: dict) -> str:
    if node["type"] != "kernel":
        return node["type"]
    name = _INDUCTOR_NUMBER.sub(r"\1", node["name"])
    return f"{name} grid={node['grid']} block={node['block']}"


def summary(doc: dict) -> dict:
    full = [c for c in doc["captures"] if c["by"] == "FULL"]
    pieces = [c for c in doc["captures"] if c["by"] == "PIECEWISE"]
    return {"cudagraph_mode": doc["cudagraph_mode"], "full_graphs": len(full),
            "full_nodes": [len(c["nodes"]) for c in full],
            "full_kernels": [sum(n["type"] == "kernel" for n in c["nodes"]) for c in full],
            "full_node_types": dict(collections.Counter(
                n["type"] for c in full for n in c["nodes"])),
            "piecewise_graphs": len(pieces),
            "piecewise_nodes": sum(len(c["nodes"]) for c in pieces)}


def compare(plain: dict, other: dict) -> dict:
    """The FULL graphs one by one: which signatures one holds more of than the other."""
    a = [c for c in plain["captures"] if c["by"] == "FULL"]
    b = [c for c in other["captures"] if c["by"] == "FULL"]
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        cx = collections.Counter(signature(n) for n in x["nodes"])
        cy = collections.Counter(signature(n) for n in y["nodes"])
        if cx != cy:
            diffs.append({"graph": i, "only_plain": dict(cx - cy), "only_ops": dict(cy - cx)})
    return {"full_graphs_compared": min(len(a), len(b)), "same_count": len(a) == len(b),
            "graphs_differing": len(diffs), "differences": diffs[:4]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=ENGINES,
                        help=f"mode/config pairs of tools/vllm_layer_cost.py (default {ENGINES})")
    parser.add_argument("--json", default=None, help="write the census here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one engine
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, config = args.one.split("/", 1)
        Path(args.out).write_text(json.dumps(census(mode, config)))
        sys.stdout.flush()
        from ringflow.bench.exit import exit_now

        exit_now()  # engine shutdown can hang; the census is written

    from vllm_layer_cost import CONFIGS, GRAPH_MODES

    pairs = [e.split("/", 1) for e in args.engines.split(",")]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in GRAPH_MODES or pair[1] not in CONFIGS:
            parser.error(f"unknown engine '{'/'.join(pair)}' (modes: {', '.join(GRAPH_MODES)}; "
                         f"configs: {', '.join(CONFIGS)})")
    docs, results = {}, {}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for mode, config in pairs:
        key = f"{mode}/{config}"
        out = Path(tempfile.mkdtemp()) / "census.json"
        child = subprocess.run([sys.executable, __file__, "--one", key, "--out", str(out)],
                               env={**env, "VLLM_CACHE_ROOT": tempfile.mkdtemp()}, timeout=420,
                               capture_output=True, text=True)
        if not out.exists():
            print(child.stdout[-3000:], child.stderr[-6000:], sep="\n", file=sys.stderr)
            print(f"[census] {key}: the engine wrote no census (exit {child.returncode})",
                  file=sys.stderr)
            return 1
        docs[key] = json.loads(out.read_text())
        results[key] = summary(docs[key])
        print(f"[census] {key}: {results[key]['full_graphs']} FULL graphs, "
              f"{results[key]['piecewise_graphs']} piecewise", flush=True)
    for key, doc in docs.items():
        mode, config = key.split("/", 1)
        plain = docs.get(f"{mode}/plain")
        if config != "plain" and plain is not None:
            results[key]["vs_plain"] = compare(plain, doc)

    import vllm

    from ringflow.bench import records

    doc = records.record("python3 tools/vllm_graph_census.py", vllm=vllm.__version__,
                         model="Llama 8B shapes, dummy", capture_sizes=[1, 2, 4, 8, 16, 32, 64],
                         results=results)
    if args.json:
        records.write(args.json, doc)
    print("| engine | graphs | FULL graphs | nodes per FULL graph | kernels per FULL graph | "
          "piecewise graphs | FULL graphs differing from plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        vs = r.get("vs_plain")
        differing = "-" if vs is None else (
            f"{vs['graphs_differing']} of {vs['full_graphs_compared']}"
            + ("" if vs["same_count"] else " (counts differ)"))
        print(f"| {key} | {r['cudagraph_mode']} | {r['full_graphs']} | "
              f"{min(r['full_nodes'], default=0)}-{max(r['full_nodes'], default=0)} | "
              f"{min(r['full_kernels'], default=0)}-{max(r['full_kernels'], default=0)} | "
              f"{r['piecewise_graphs']} | {differing} |")
    for key, r in results.items():
        for d in (r.get("vs_plain") or {}).get("differences", [])[:1]:
            print(f"[census] {key}, FULL graph {d['graph']}: only in plain {d['only_plain']}; "
                  f"only with the ops {d['only_ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
