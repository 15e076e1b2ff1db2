"""Which layers to offload: the placement of N streamed layers that hides the most copy time.

Note [Placement model]
    One copy engine and one compute stream. Layer ``i`` computes for ``compute_ms[i]``; an
    offloaded layer's weights copy for ``copy_ms[i]``. As the plan issues them (Note [When a
    gather is issued] in planner.py), the copy into a slot starts once the copy before it is
    done and the slot's previous reader has finished; a layer computes once the layer before it
    is done and, if offloaded, its copy has landed. With ``cross_forward`` the next forward's
    first copies run in this forward's tail (only the slot rule holds them back); without it a
    forward's copies start when the forward does. The steady state is a forward among
    forwards: three are simulated and the last one's time is the prediction. Adjacent
    offloaded layers behind one slot are the bad case this model shows: the second copy cannot
    start before the first layer has computed.

    A hidden copy is almost free. ``slowdown`` charges what it costs: each ms a layer's
    compute shares with a copy in flight lengthens that compute by ``slowdown`` ms. Measured on
    the H200 with the layers back to back, as an engine runs them, it is 0 to 0.017
    (``tools/copy_contention.py``, ``ringflow bench``'s steady columns). Single forwards
    timed alone once suggested 0.04 to 0.23. Most of that was the GPU's 700 W power limit:
    these layers run at it, so a forward timed right after a copy-only one (SMs idle, power
    spare) runs 5% faster than one timed after a compute-heavy one. ``ringflow bench``
    measures it per scenario, from the compute-only and gather-only graphs replayed side by
    side ((both - max) / min), and predicts with it. The placement search leaves it at 0,
    because it charges every placement that hides the same copies alike.

    A hand-off is not free either. ``handoff_ms`` is the latency of one dependency between a
    copy and a compute: a copy that waits for its slot's reader starts ``handoff_ms`` after the
    reader ends, and a layer that waits for its copy starts ``handoff_ms`` after the copy lands.
    It matters only where layers take microseconds (64 layers of 9 us: two hand-offs of 3 to 4
    us per layer are the forward's critical path). ``ringflow bench`` measures it from the
    synchronous graph, which is every gather and compute in one chain with exactly two
    hand-offs per gathered layer: (sync - gather-only - compute-only) / (2 x gathered layers),
    single forwards for the single prediction, back to back for the steady one. The search
    leaves it at 0 (the vLLM plugin's layers take milliseconds).

The search is deterministic given the times: the best evenly spaced placement (over every
offset; of equal ones, the lexicographically smaller set), then single-layer moves while one
shortens the prediction, so equal layers stay evenly spaced. "Best" and "shortens" read the
steady forward first and then the forward without cross-forward (the first forward, and every
forward after a reclaim, start with nothing carried).

The per-layer times the vLLM plugin places by, when nothing measured them, come from the
rates below (the H200's measured pinned host-to-device copy and bf16 matmul): a change here
changes which layers are wrapped in layer ops, so this file is part of vLLM's compile-cache
key (Note [Compile-cache key] in integrations/vllm/cache_key.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ringflow.errors import ConfigError

#: estimates where nothing measured a layer: pinned host-to-device bytes/s, bf16 matmul FLOP/s
H2D_BYTES_PER_S = 55e9
MATMUL_FLOP_PER_S = 775e12
FORWARDS = 3
#: the search is quadratic in the layers and more: 256 layers take seconds, 500 nearly a minute
MAX_LAYERS = 256


@dataclass(frozen=True)
class Placement:
    """The chosen layers and what the model predicts for them."""

    layers: tuple[int, ...]
    forward_ms: float   # predicted steady-state forward time
    resident_ms: float  # the same forward with every layer resident (the ideal)

    @property
    def ratio(self) -> float:
        return self.forward_ms / self.resident_ms if self.resident_ms else float("inf")


def _check(compute_ms: Sequence[float], copy_ms: Sequence[float], slots: int) -> None:
    if len(compute_ms) != len(copy_ms) or not compute_ms:
        raise ConfigError(f"placement needs one compute and one copy time per layer; got "
                          f"{len(compute_ms)} and {len(copy_ms)}")
    if slots < 1:
        raise ConfigError(f"placement needs a ring of at least one slot, got {slots}")
    if len(compute_ms) > MAX_LAYERS:
        raise ConfigError(f"placement models up to {MAX_LAYERS} layers (the largest models have "
                          f"about 128); got {len(compute_ms)}")
    if not all(math.isfinite(t) and t >= 0 for t in (*compute_ms, *copy_ms)):
        raise ConfigError("placement times must be finite and >= 0 ms")


def forward_ms(compute_ms: Sequence[float], copy_ms: Sequence[float],
               offloaded: Sequence[int], slots: int, cross_forward: bool = True,
               slowdown: float = 0.0, handoff_ms: float = 0.0) -> float:
    """The steady-state forward time of offloading ``offloaded`` through ``slots`` slots
    (Note [Placement model])."""
    _check(compute_ms, copy_ms, slots)
    if not (math.isfinite(slowdown) and 0 <= slowdown <= 1):
        raise ConfigError(f"slowdown is ms of compute lost per ms beside a copy, in 0..1; got "
                          f"{slowdown}")
    if not (math.isfinite(handoff_ms) and handoff_ms >= 0):
        raise ConfigError(f"handoff_ms is the latency of one copy/compute dependency, >= 0 ms; "
                          f"got {handoff_ms}")
    layers, chosen = len(compute_ms), sorted(set(offloaded))
    offloaded_set = set(chosen)
    if not chosen:
        return float(sum(compute_ms))
    # every forward's copies in order, and the next forward's, which the last one's tail may
    # run (cross-forward) and so slow its last layers
    copies = [layer for _ in range(FORWARDS + 1) for layer in chosen]
    starts: list[float] = []    # of the copies issued so far
    ends: list[float] = []
    reader_end: list[float | None] = [None] * len(copies)  # when the layer reading it finished
    forward_starts: list[float] = []

    def issue() -> None:
        """Every copy whose start is known: its slot's previous reader has finished and, without
        cross-forward, its forward has begun."""
        while len(starts) < len(copies):
            j = len(starts)
            held = reader_end[j - slots] if j >= slots else 0.0
            if held is None or not cross_forward and j // len(chosen) >= len(forward_starts):
                return
            if j >= slots:
                held += handoff_ms  # the reader's end reaches the copy
            start = max(ends[-1] if ends else 0.0, held)
            if not cross_forward:
                start = max(start, forward_starts[j // len(chosen)])
            starts.append(start)
            ends.append(start + copy_ms[copies[j]])

    def beside(t0: float, t1: float) -> float:
        return sum(max(0.0, min(t1, e) - max(t0, s)) for s, e in zip(starts, ends))

    done, forward_ends, j = 0.0, [], 0
    for _ in range(FORWARDS):
        forward_starts.append(done)
        for layer in range(layers):
            issue()
            ready = done
            if layer in offloaded_set:
                ready = max(ready, ends[j] + handoff_ms)  # the copy's end reaches the layer
            took = compute_ms[layer]
            for _ in range(60 if slowdown else 0):  # a fixed point: each step moves by <= slowdown
                longer = compute_ms[layer] + slowdown * beside(ready, ready + took)
                if longer - took < 1e-9:
                    break
                took = longer
            done = ready + took
            if layer in offloaded_set:
                reader_end[j] = done
                j += 1
        forward_ends.append(done)
    return forward_ends[-1] - forward_ends[-2]


def _spaced(layers: int, count: int) -> list[tuple[int, ...]]:
    """Every evenly spaced placement of ``count`` of ``layers`` (one per offset)."""
    stride = layers / count
    found = []
    for offset in range(max(1, int(stride))):
        chosen = tuple(sorted({min(layers - 1, int(offset + k * stride)) for k in range(count)}))
        if len(chosen) == count and chosen not in found:
            found.append(chosen)
    return found or [tuple(range(count))]


def choose(compute_ms: Sequence[float], copy_ms: Sequence[float], count: int, slots: int,
           cross_forward: bool = True) -> Placement:
    """The ``count`` layers whose offload the model predicts fastest.

    Raises:
        ConfigError: ``count`` is not in 1..layers, or the times are malformed.
    """
    _check(compute_ms, copy_ms, slots)
    layers = len(compute_ms)
    if not 1 <= count <= layers:
        raise ConfigError(f"cannot offload {count} of {layers} layers; ask for 1..{layers}")

    colds: dict[tuple[int, ...], float] = {}

    def cost(chosen: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        return forward_ms(compute_ms, copy_ms, chosen, slots, cross_forward), chosen

    def cold(chosen: tuple[int, ...]) -> float:  # only near-ties ask, so it is made on demand
        if chosen not in colds:
            colds[chosen] = forward_ms(compute_ms, copy_ms, chosen, slots, False)
        return colds[chosen]

    def gains(a, b) -> bool:
        """A real gain (1e-9 ms) in the steady forward, or in the cold one with the steady one
        no worse at all: a strict order, so the search ends."""
        return a[0] < b[0] - 1e-9 or a[0] <= b[0] and cross_forward and \
            cold(a[1]) < cold(b[1]) - 1e-9

    best = None
    for candidate in (cost(c) for c in _spaced(layers, count)):  # ties: the smaller set
        if best is None or gains(candidate, best) or not gains(best, candidate) \
                and candidate[1] < best[1]:
            best = candidate
    improved = True
    while improved:
        improved = False
        current = set(best[1])
        for out in sorted(current):
            for into in range(layers):
                if into in current:
                    continue
                candidate = cost(tuple(sorted(current - {out} | {into})))
                if gains(candidate, best):  # only a real gain moves a layer
                    best, improved = candidate, True
    return Placement(best[1], best[0], float(sum(compute_ms)))
