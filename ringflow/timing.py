"""GPU time measured with CUDA timing events: the one place ringflow's measurements make them.

Three uses: how long a piece of work takes on the device (:func:`elapsed_ms`, :func:`timed_run`,
:func:`span_ms` over several streams), several variants timed in turn round after round
(:func:`interleaved_ms`, :func:`interleaved_medians`), and when each call of a gather or compute starts and ends (:func:`stamped`, read back with
:func:`spans`), relative to an origin event so that every stream shares one clock.

.. note::
    Events are recorded on the *current* stream. :func:`timed_run` waits for its end event (a
    host sync): call it between measurements, never inside a capture. :func:`stamped` never
    waits; with ``external=True`` a capture records its events as graph nodes, so each replay
    stamps them again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch


def event_pair(*, external: bool = False) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Two fresh timing events (start, end); ``external``: recorded as nodes of a capture."""
    options = {"external": True} if external else {}  # the flag is newer than torch 2.8
    return (torch.cuda.Event(enable_timing=True, **options),
            torch.cuda.Event(enable_timing=True, **options))


def timed_run(fn: Callable[[], Any], repeat: int = 1) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Issue ``fn()`` ``repeat`` times between two timing events and wait for the second.

    Returns the events, so that events recorded inside ``fn`` can be read relative to the start.
    """
    start, end = event_pair()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start, end


def elapsed_ms(fn: Callable[[], Any], repeat: int = 1) -> float:
    """Device milliseconds of ``repeat`` back-to-back calls of ``fn()`` (waits for them)."""
    start, end = timed_run(fn, repeat)
    return start.elapsed_time(end)


def interleaved_medians(samplers: Mapping[str, Callable[[], float]], rounds: int, *,
                        warmup: int = 2,
                        before_round: Callable[[int], Any] | None = None) -> dict[str, float]:
    """Median of each sampler's measurement, the samplers run in turn round after round.

    A sampler does its work once and returns the milliseconds it measured (its own timer:
    one stream's events, several streams' spans). Interleaving puts every variant under the
    same conditions (clocks, temperature, whatever else the machine runs), so their ratios
    come from one run. Not quite the same: a GPU at its power limit runs a sample faster
    right after a variant that left its SMs idle (5% on the H200, after a copy-only forward:
    ``tools/copy_contention.py``), so a single-call sample depends on the variant before it;
    samples of several calls back to back (``repeat``) are each variant's own steady state.
    ``before_round(r)`` runs before round ``r`` (fresh inputs, say); the first ``warmup``
    rounds are not counted.
    """
    samples: dict[str, list[float]] = {name: [] for name in samplers}
    for r in range(warmup + rounds):
        if before_round is not None:
            before_round(r)
        for name, sample in samplers.items():
            ms = sample()
            if r >= warmup:
                samples[name].append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def interleaved_ms(variants: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 2,
                   repeat: int = 1,
                   before_round: Callable[[int], Any] | None = None) -> dict[str, float]:
    """:func:`interleaved_medians` of device ms per call of each variant on the current stream;
    each sample times ``repeat`` back-to-back calls and divides (steady state: an engine
    stepping forward after forward). Host-syncs after every sample."""
    return interleaved_medians(
        {name: (lambda run=run: elapsed_ms(run, repeat=repeat) / repeat)
         for name, run in variants.items()}, rounds, warmup=warmup, before_round=before_round)


def span_ms(fn: Callable[[], Any], streams) -> float:
    """Device ms of ``fn()``, which issues work on ``streams`` (of one device or several):
    from each stream's start event to its end event, the longest span of any device (events of
    different devices cannot be compared). Waits for the work."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in streams]
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    for stream, start in zip(streams, starts):
        start.record(stream)
    fn()
    for stream, end in zip(streams, ends):
        end.record(stream)
    for end in ends:
        end.synchronize()
    return max(s.elapsed_time(e) for s, a in zip(starts, streams) for e, b in zip(ends, streams)
               if a.device == b.device)


def stamped(kind: str, fn: Callable[[int, str, Any], Any], marks: list, *,
            external: bool = False) -> Callable[[int, str, Any], None]:
    """``fn(layer, lane, tensor)`` between two timing events recorded on the current stream.

    Every call appends ``(kind, layer, lane, start, end)`` to ``marks``; nothing waits.
    """
    def run(layer: int, lane: str, tensor: Any) -> None:
        start, end = event_pair(external=external)
        start.record()
        fn(layer, lane, tensor)
        end.record()
        marks.append((kind, layer, lane, start, end))
    return run


def forward_spans(forward: Callable[[], Any], marks: list) -> list[dict]:
    """The spans of one ``forward()`` whose gathers and computes are :func:`stamped` into
    ``marks``, after one warm-up call: ``[{"lane", "kind", "layer", "start_ms", "end_ms"}]``,
    in milliseconds since an event recorded just before the forward (one clock for all lanes)."""
    forward()  # warm-up: lazy library state, first-touch allocations
    torch.cuda.synchronize()
    marks.clear()
    origin, _ = timed_run(forward)
    torch.cuda.synchronize()  # side streams too: a span's events must be done to be read
    return spans(origin, marks)


def spans(origin: torch.cuda.Event, marks: list) -> list[dict]:
    """:func:`stamped` marks as ``{"lane", "kind", "layer", "start_ms", "end_ms"}``, in
    milliseconds since ``origin`` (read after the device finished them)."""
    return [{"lane": lane, "kind": kind, "layer": layer,
             "start_ms": round(origin.elapsed_time(start), 4),
             "end_ms": round(origin.elapsed_time(end), 4)}
            for kind, layer, lane, start, end in marks]
