"""What an expert cache costs a MoE step: misses from a hit rate or a simulated routing, times
from the fetch's measured rate.

Note [Expert lane model]
    A decode step of ``tokens`` tokens asks each MoE layer for ``distinct`` experts (at most
    ``min(experts, tokens * top_k)``); a cache with hit rate ``h`` fetches ``(1 - h) *
    distinct`` of them, on the layer's critical path (the router decides them inside the
    layer). The device-indexed fetch (kernels/expert_fetch.py) costs a fixed launch-and-ramp
    time plus the bytes at its streaming rate: on the H200, ``0.04 ms + n * bytes / 47 GB/s``
    fits 8 and 32 Qwen3-30B-A3B experts within 3% (``profiles/results/expert-fetch-h200.json``;
    one expert measured 0.26 to 0.36 ms where the fit says 0.24). A layer's time is its compute
    plus its fetch; the bound the issue names is the missed bytes over the pinned copy rate
    (55 GB/s), and whole-layer streaming copies every expert of every streamed layer (at
    best hidden behind the compute: the step takes the longer of the two).

    The hit rate is either given (measured in an engine) or simulated: ``simulate_hit_rate``
    (integrations/torch/expert_cache.py) runs the cache's own eviction, on the CPU with one-word experts, over a
    routing drawn per token from a Zipf law over the experts, whose exponent stands in for a
    real router's skew; ``zipf 0`` is uniform routing, the worst case for a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringflow.errors import ConfigError
from ringflow.orchestrator.placement import H2D_BYTES_PER_S

FETCH_GBPS = 47.0  # device-indexed fetch, H200, 8+ experts (expert-fetch-h200.json)
FETCH_FIXED_MS = 0.04
PINNED_GBPS = H2D_BYTES_PER_S / 1e9  # the H200's pinned host->device rate, in GB/s


@dataclass(frozen=True)
class ExpertStep:
    """One decode step of a MoE model whose chosen layers fetch their missed experts."""

    distinct: float  # experts a layer is asked for per step (mean)
    misses: float  # of those, fetched (mean)
    fetch_ms: float  # per layer
    step_ms: float  # all layers: compute plus the expert layers' fetches
    bound_ms: float  # all layers: compute plus missed bytes at the pinned copy rate
    whole_layer_ms: float  # every expert of the expert layers copied, overlapping the compute


def fetch_ms(experts: float, expert_bytes: int, gbps: float = FETCH_GBPS,
             fixed_ms: float = FETCH_FIXED_MS) -> float:
    """Milliseconds to fetch ``experts`` experts of ``expert_bytes`` each (0 for none)."""
    return fixed_ms + experts * expert_bytes / gbps / 1e6 if experts > 0 else 0.0


def expected_distinct(experts: int, top_k: int, tokens: int) -> float:
    """Mean distinct experts of ``tokens`` tokens routed uniformly, ``top_k`` distinct each."""
    if tokens <= 1:
        return float(min(top_k, experts))
    return experts * (1 - (1 - min(top_k, experts) / experts) ** tokens)


def predict(*, layers: int, expert_layers: int, experts: int, top_k: int, tokens: int,
            expert_bytes: int, compute_ms: float, hit_rate: float,
            distinct: float | None = None) -> ExpertStep:
    """A decode step's time with ``expert_layers`` of ``layers`` MoE layers fetching their
    missed experts at ``hit_rate`` (Note [Expert lane model])."""
    if not 0 <= hit_rate <= 1:
        raise ConfigError(f"a hit rate is in 0..1, got {hit_rate}")
    if not 0 < expert_layers <= layers:
        raise ConfigError(f"expert layers must be 1..{layers}, got {expert_layers}")
    d = expected_distinct(experts, top_k, tokens) if distinct is None else distinct
    misses = (1 - hit_rate) * d
    per_layer = fetch_ms(misses, expert_bytes)
    compute = layers * compute_ms
    return ExpertStep(
        distinct=d, misses=misses, fetch_ms=per_layer,
        step_ms=compute + expert_layers * per_layer,
        bound_ms=compute + expert_layers * misses * expert_bytes / PINNED_GBPS / 1e6,
        whole_layer_ms=max(compute, expert_layers * experts * expert_bytes / PINNED_GBPS / 1e6))


def chunk_copies(layout: str, *, layers: int, experts: int, slots: int = 0,
                 buffers: int = 2) -> int:
    """Experts a large step copies from host memory when large steps run back to back (a long
    prompt in chunks, nothing in between), once the first has run: what bounds a chunked
    prefill at the copy rate (Note [Large steps stream through the slots]).

    ``layout``: ``ring`` (a ring of ``buffers`` layer buffers whose fills take the ``slots``
    each layer's cache holds from the device), ``held`` (the ring's first ``buffers`` layers
    held for decode, carried again in every tail, the others with ``slots`` each),
    ``prefetch`` (vLLM's prefetch offloader, every one of ``layers`` offloaded layers whole).
    The expert arena's count depends on its layout and is its own (``rows_from_host``;
    Note [Large steps stream through the slots])."""
    if layout == "ring":
        return layers * (experts - slots)
    if layout == "held":
        return buffers * experts + (layers - buffers) * (experts - slots)
    if layout == "prefetch":
        return layers * experts
    raise ConfigError(f"chunk_copies: layout is ring, held or prefetch, not {layout!r}")
