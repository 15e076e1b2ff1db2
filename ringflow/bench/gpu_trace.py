"""Where one step's GPU time goes, from a torch.profiler trace: kernels, host-to-device copies,
what overlapped and where the GPU sat idle.

The experts bench gives a step's wall time; when two lanes move the same bytes and one is slower
(the arena's lone 8k prompt against vLLM's prefetch offloader, Note [Large steps stream through
the slots]) the question is which of three it is: the copies took longer (``h2d_gbps``), they
overlapped less (``copy_only_ms``: copies with no kernel beside them), or the GPU waited for the
host (``gaps``, each with the host's CUDA calls that were running across it: a
``cudaEventSynchronize`` there is a sync in the step, a long ``cudaLaunchKernel`` tail is
Python). Read from the Chrome trace ``torch.profiler`` exports (Kineto's: ``cat`` ``kernel``,
``gpu_memcpy``, ``gpu_memset``, ``cuda_runtime``, ``cuda_driver``), so that any torch writes
it the same.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ringflow.errors import OutputError

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")


def load(path: str | Path) -> list[dict]:
    """The trace's events (a Chrome trace file as ``export_chrome_trace`` writes it, or
    gzipped, ``.gz``, as vLLM's profiler writes it by default)."""
    try:
        raw = Path(path).read_bytes()
        doc = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    except (OSError, ValueError) as exc:
        raise OutputError(f"cannot read the trace {path}: {exc}") from exc
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise OutputError(f"{path} holds no traceEvents list: is it a torch.profiler trace?")
    return events


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]
               ) -> list[tuple[float, float]]:
    """Both unions (sorted, disjoint) at once."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _spans(events: list[dict], cats, pick=lambda e: True) -> list[tuple[float, float]]:
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in cats and pick(e)]


def _is_h2d(e: dict) -> bool:
    return e.get("cat") == "gpu_memcpy" and "HtoD" in str(e.get("name", ""))


BULK_BYTES = 1 << 20  # a host-to-device copy of experts or weights, not a map or an index


def copy_gaps(events: list[dict], min_gap_ms: float = 0.2, gaps: int = 8) -> dict:
    """Where the copy engine waited inside the step: the stretches with no bulk host-to-device
    copy (at least ``BULK_BYTES``) from the window's start to the last kernel's end (copies
    after it, a step's tail, wait for nothing), each with the kernels that ran across it.

    A lane that copies what the device cannot hold is copy-bound when these add up to little;
    a stretch under a layer's ``fused_moe_kernel`` is a fill waiting for that layer to retire,
    one under attention or before any copy is the step's start. The replay of Note [Arena
    timeline] assumes what this measures (the copy engine idles only where a fill waits for a
    reader). At 8 layers on an H100 (``tools/arena_timeline.py --gpu``) they added up to
    8 ms while the step took 21 more than the replay: the copy engine was busy to the end,
    and the step waited instead for small writes queued behind its copies (Note [Small
    writes beside bulk copies]); the compute stream's own copies are what to read next.
    ``first_copy_ms``: from the window's start to the first bulk copy; ``idle_ms``: the
    stretches' sum; ``bulk_gb`` and ``bulk_copies``: what the step's bulk copies moved. Each
    stretch that a copy ends names when the host issued that copy (``issued_ms``, by the
    trace's correlation ids) and ``issued_late``: issued after the stretch began, so the copy
    engine had nothing queued (the host was behind), rather than a queued copy waiting for
    an event."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    if not kernels:
        raise OutputError("the trace holds no kernels: was the profiler given "
                          "ProfilerActivity.CUDA, and did the step run on the GPU?")
    start = min(float(e["ts"]) for e in gpu)
    last = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kernels)
    bulk = [e for e in gpu if _is_h2d(e) and float(e["ts"]) < last
            and int((e.get("args") or {}).get("bytes", 0)) >= BULK_BYTES]
    busy = [(a, min(b, last)) for a, b in _union(_spans(bulk, ("gpu_memcpy",)))]
    idle = [(a, b) for a, b in zip([start] + [b for _, b in busy], [a for a, _ in busy] + [last])
            if b - a >= min_gap_ms * 1e3]
    spans = _spans(kernels, ("kernel",))
    names = [str(e.get("name", "?")) for e in kernels]
    issued = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in events
              if e.get("ph") == "X" and e.get("cat") in HOST_CATS}
    found = []
    for a, b in sorted(idle, key=lambda s: s[0] - s[1])[:gaps]:
        under: dict[str, float] = {}
        for (x, y), n in zip(spans, names):
            if min(b, y) > max(a, x):
                under[n[:48]] = under.get(n[:48], 0.0) + min(b, y) - max(a, x)
        top = sorted(under.items(), key=lambda kv: -kv[1])[:3]
        gap = {"at_ms": round((a - start) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
               "kernels": [f"{n} {round(t / 1e3, 3)} ms" for n, t in top]}
        # the copy that ends the wait, and when the host issued it: after the wait began, the
        # host was late (the GPU had nothing queued); before, the copy waited for an event
        after = [e for e in bulk if float(e["ts"]) >= b]
        if after:
            host = issued.get((min(after, key=lambda e: float(e["ts"])).get("args") or {})
                              .get("correlation"))
            if host is not None:
                gap["issued_ms"] = round((host - start) / 1e3, 3)
                gap["issued_late"] = host > a
        found.append(gap)
    return {"first_copy_ms": round((busy[0][0] - start) / 1e3, 3) if busy else None,
            "idle_ms": round(_length(idle) / 1e3, 3),
            "bulk_copies": len(bulk),
            "bulk_gb": round(sum(int((e.get("args") or {}).get("bytes", 0))
                                 for e in bulk) / 1e9, 4),
            "gaps": found}


def ringflow_ranges(events: list[dict], start_us: float) -> dict | None:
    """ringflow's own host ranges in the trace (``RINGFLOW_TORCH_RANGES``, Note in
    graphs/nvtx_ranges.py), per name: how many, their host time, and where the first began,
    in ms from ``start_us`` (the step's first GPU event; before it: negative). None: the
    trace holds none (the switch was off)."""
    out: dict[str, dict] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or e.get("cat") != "user_annotation" or not name.startswith(
                "ringflow/"):
            continue
        r = out.setdefault(name, {"count": 0, "ms": 0.0, "first_at_ms": None})
        r["count"] += 1
        r["ms"] += float(e.get("dur", 0)) / 1e3
        at = (float(e["ts"]) - start_us) / 1e3
        r["first_at_ms"] = at if r["first_at_ms"] is None else min(r["first_at_ms"], at)
    return {name: {"count": r["count"], "ms": round(r["ms"], 3),
                   "first_at_ms": round(r["first_at_ms"], 3)}
            for name, r in sorted(out.items(), key=lambda kv: kv[1]["first_at_ms"])} or None


def summarize(events: list[dict], min_gap_ms: float = 0.2, gaps: int = 8) -> dict:
    """One step's GPU time, in ms from its first GPU event to its last (see the module);
    ``kernels`` counts the kernels launched (a CUDA graph's, one per node).

    ``copy_only_ms``: host-to-device copies with no kernel running (a layer waiting for its
    experts); ``kernel_only_ms``: kernels with no such copy; ``overlap_ms``: both; ``idle_ms``:
    neither; ``gaps``: the longest idle stretches of at least ``min_gap_ms``, each with where
    it starts and the host's CUDA calls that span most of it; ``ringflow_ranges``: ringflow's
    host ranges where the trace has them (``ringflow_ranges``)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        raise OutputError("the trace holds no GPU activity: was the profiler given "
                          "ProfilerActivity.CUDA, and did the step run on the GPU?")
    start = min(float(e["ts"]) for e in gpu)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in gpu)
    kernels = _union(_spans(events, ("kernel", "gpu_memset")))
    copies = _union(_spans(events, ("gpu_memcpy",), _is_h2d))
    busy = _union(kernels + _spans(events, ("gpu_memcpy",)))  # copies either way
    overlap = _length(_intersect(kernels, copies))
    idle = [(a, b) for a, b in zip([start] + [b for _, b in busy], [a for a, _ in busy] + [end])
            if b - a >= min_gap_ms * 1e3]
    host = _spans(events, HOST_CATS)
    names = [e.get("name", "?") for e in events
             if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    found = []
    for a, b in sorted(idle, key=lambda s: s[0] - s[1])[:gaps]:
        across = sorted(((min(b, y) - max(a, x), n) for (x, y), n in zip(host, names)
                         if min(b, y) > max(a, x)), reverse=True)
        found.append({"at_ms": round((a - start) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                      "host": [f"{n} {round(t / 1e3, 3)} ms" for t, n in across[:3]]})
    h2d_bytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in events
                    if e.get("ph") == "X" and _is_h2d(e))
    h2d_us = _length(copies)
    streams: dict[str, dict] = {}
    for e in gpu:
        s = streams.setdefault(str((e.get("args") or {}).get("stream", "?")),
                               {"kernels_ms": 0.0, "copies_ms": 0.0, "events": 0})
        s["copies_ms" if e["cat"] == "gpu_memcpy" else "kernels_ms"] += float(
            e.get("dur", 0)) / 1e3
        s["events"] += 1
    return {
        "window_ms": round((end - start) / 1e3, 3),
        "kernel_ms": round(_length(kernels) / 1e3, 3),
        "kernels": sum(1 for e in gpu if e["cat"] == "kernel"),
        "h2d_ms": round(h2d_us / 1e3, 3),
        "h2d_gb": round(h2d_bytes / 1e9, 4),
        "h2d_gbps": round(h2d_bytes / h2d_us / 1e3, 1) if h2d_us else None,
        "overlap_ms": round(overlap / 1e3, 3),
        "copy_only_ms": round((h2d_us - overlap) / 1e3, 3),
        "kernel_only_ms": round((_length(kernels) - overlap) / 1e3, 3),
        "idle_ms": round(((end - start) - _length(busy)) / 1e3, 3),
        "gaps": found,
        "copy_gaps": (copy_gaps(events, min_gap_ms, gaps)
                      if h2d_us and any(e["cat"] == "kernel" for e in gpu) else None),
        "streams": {k: {**v, "kernels_ms": round(v["kernels_ms"], 3),
                        "copies_ms": round(v["copies_ms"], 3)} for k, v in streams.items()},
        "ringflow_ranges": ringflow_ranges(events, start),
    }
