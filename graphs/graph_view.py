"""Read a captured CUDA graph back through cuda-python: node types, memcpy endpoints, edges.

Tests use it to prove that the graph CUDA actually holds has the planned shape (the gather
branch parallel to compute, joined only by the planned edges); ``ringflow plan --cuda-graph-dot``
uses it to write the real graph's DOT next to ringflow's own dump. The torch graph must have
been captured with ``keep_graph=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ringflow.errors import CaptureError
from ringflow.cudart import checked, runtime as _runtime


def _check(name: str, result):
    return checked(name, result, CaptureError,
                   "is the graph captured with keep_graph=True and still alive?")


@dataclass(frozen=True)
class GraphNode:
    index: int
    type: str  # cudaGraphNodeType name without the prefix: Kernel, Memcpy, Memset, Empty, ...
    src: int | None = None  # memcpy source address
    dst: int | None = None  # memcpy destination address
    nbytes: int | None = None  # memcpy width in bytes


@dataclass(frozen=True)
class GraphView:
    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[int, int], ...]

    def of_type(self, type_name: str) -> list[GraphNode]:
        return [n for n in self.nodes if n.type == type_name]

    @cached_property
    def _successors(self) -> dict[int, list[int]]:
        succ: dict[int, list[int]] = {n.index: [] for n in self.nodes}
        for a, b in self.edges:
            succ[a].append(b)
        return succ

    def descendants(self, index: int) -> set[int]:
        seen, stack = set(), [index]
        while stack:
            for nxt in self._successors[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    def reaches(self, a: int, b: int) -> bool:
        """True when a path of edges forces node ``b`` to run after node ``a``."""
        return b in self.descendants(a)


def read_graph(graph: torch.cuda.CUDAGraph) -> GraphView:
    """Nodes and edges of ``graph`` (captured with ``keep_graph=True``)."""
    rt = _runtime()
    raw = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
    _, count = _check("cudaGraphGetNodes", rt.cudaGraphGetNodes(raw, 0))
    handles, _ = _check("cudaGraphGetNodes", rt.cudaGraphGetNodes(raw, count))
    index = {int(h): i for i, h in enumerate(handles)}
    nodes = []
    for i, h in enumerate(handles):
        kind = _check("cudaGraphNodeGetType", rt.cudaGraphNodeGetType(h))
        name = kind.name.removeprefix("cudaGraphNodeType")
        src = dst = nbytes = None
        if name == "Memcpy":
            params = _check("cudaGraphMemcpyNodeGetParams", rt.cudaGraphMemcpyNodeGetParams(h))
            src, dst = int(params.srcPtr.ptr), int(params.dstPtr.ptr)
            nbytes = int(params.extent.width) * int(params.extent.height) * int(params.extent.depth)
        nodes.append(GraphNode(i, name, src, dst, nbytes))
    result = _check("cudaGraphGetEdges", rt.cudaGraphGetEdges(raw, 0))
    total = result[-1]
    result = _check("cudaGraphGetEdges", rt.cudaGraphGetEdges(raw, total))
    frm, to = result[0], result[1]
    edges = tuple((index[int(a)], index[int(b)]) for a, b in zip(frm[:total], to[:total]))
    return GraphView(tuple(nodes), edges)


def write_dot(graph: torch.cuda.CUDAGraph, path: str) -> None:
    """Write the real CUDA graph's DOT (``cudaGraphDebugDotPrint``, verbose node details)."""
    rt = _runtime()
    raw = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
    flags = int(rt.cudaGraphDebugDotFlags.cudaGraphDebugDotFlagsVerbose)
    _check("cudaGraphDebugDotPrint", rt.cudaGraphDebugDotPrint(raw, str(path).encode(), flags))
