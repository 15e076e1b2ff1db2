"""Which of a layer's missed experts the host computes and which are copied: the split that
makes the two finish together, from rates measured on the host.

Note [Host split]
    A missed expert can reach its tokens two ways. It can be copied across the host link
    (``expert_model.fetch_ms``: a fixed launch cost plus its bytes at the fetch rate) and
    computed on the GPU, or be computed where it lies, on the host's CPU, which reads its
    bytes once from DRAM (``cpu_ms``: measured per token count on the host, Note [Host
    rates]), plus a fixed handoff per layer (the step's rows to pinned memory, the host
    node's wake-up, the join, the rows back). The two run at once: the GPU waits for its
    copies, the CPU computes its share meanwhile, and the layer's sum joins both. For ``m``
    misses with ``k`` of them on the CPU the layer waits

        ``max(handoff + k * cpu_ms(tokens per expert), fetch_ms(m - k))``

    and ``k`` is chosen to make that least (both terms are monotone in ``k``: the best
    ``k`` is where they cross). A device that must decide inside a captured step cannot
    search: it takes ``share * m`` (rounded) of each step's misses, the share found for the
    step's expected misses. The share depends only on the step's shape (its token count),
    so a CUDA graph replays it for any routing. Where no ``k > 0`` beats copying them all,
    the share is 0 and the CPU path is off for that shape, with the reason said once. Only
    steps of up to ``experts.host_tokens`` tokens are considered, 1 by default: on H100 and
    H200 hosts the share gained 1.08-1.16x at batch 1 and never at batch 8 (0.99x, 1.00x,
    and 0.85x beside whole layers, where uniform routing's misses, 26 a layer, were far
    more than the steps missed), so larger steps are asked for by name. The
    expected misses come from one slot count for every layer; with slots per layer, layers
    that keep every expert miss only where a large step lent their rows and nothing has
    copied them back yet (on an H100, the engine's layer 2 had 65 such experts computed by
    the host over 46 decode steps), so the count is that of the others, which must share
    one (``expert_host.shared_slots``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ringflow.errors import ConfigError
from ringflow.orchestrator.expert_model import expected_distinct, fetch_ms


@dataclass(frozen=True)
class HostRates:
    """One host's measured rates (Note [Host rates] in tools/host_rates.py): ``expert_ms``
    maps a token count to the milliseconds one expert of ``expert_bytes`` takes on the CPU
    with ``threads`` threads; ``handoff_ms`` is a layer's fixed cost of the host path."""

    expert_ms: dict[int, float]
    expert_bytes: int
    handoff_ms: float
    threads: int = 0
    source: str = "given"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.expert_ms or any(t < 1 or ms <= 0 for t, ms in self.expert_ms.items()):
            raise ConfigError(f"host rates need positive times for token counts >= 1, got "
                              f"{self.expert_ms}")
        if self.expert_bytes <= 0 or self.handoff_ms < 0:
            raise ConfigError(f"host rates need expert_bytes > 0 and handoff_ms >= 0, got "
                              f"{self.expert_bytes} and {self.handoff_ms}")

    def cpu_ms(self, tokens: float, expert_bytes: int | None = None) -> float:
        """One expert's time on the CPU for ``tokens`` tokens: linear between the measured
        counts (and beyond them, along the last two), scaled to ``expert_bytes`` (the MLP of
        a few tokens reads its weights once: its time follows their bytes)."""
        points = sorted(self.expert_ms.items())
        if tokens <= points[0][0]:
            ms = points[0][1]
        elif len(points) == 1:
            ms = points[0][1] * tokens / points[0][0]
        else:
            (t0, m0), (t1, m1) = next(((a, b) for a, b in zip(points, points[1:])
                                       if tokens <= b[0]), points[-2:])
            ms = m0 + (m1 - m0) * (tokens - t0) / (t1 - t0)
        return ms * (expert_bytes or self.expert_bytes) / self.expert_bytes

    @classmethod
    def load(cls, path: str | Path) -> HostRates:
        """Rates from a JSON that tools/host_rates.py wrote (its ``model`` entry)."""
        try:
            doc = json.loads(Path(path).read_text())
            model = doc["model"]
            return cls(expert_ms={int(t): float(ms) for t, ms in model["expert_ms"].items()},
                       expert_bytes=int(model["expert_bytes"]),
                       handoff_ms=float(model["handoff_ms"]), threads=int(model["threads"]),
                       source=str(path), extra={"host": doc.get("host", {})})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read host rates from {path}: {exc}; write them with "
                              f"`python tools/host_rates.py --out {path}` on the host") from exc


@dataclass(frozen=True)
class Split:
    """A layer's misses split between the CPU (``to_host``) and the copy (``copied``), and the
    time the layer waits for its experts: ``ms`` with the split, ``copy_ms`` copying all."""

    misses: int
    to_host: int
    ms: float
    copy_ms: float
    cpu_ms: float

    @property
    def copied(self) -> int:
        return self.misses - self.to_host

    @property
    def gain(self) -> float:
        """How many times faster the layer gets its experts than by copying them all."""
        return self.copy_ms / self.ms if self.ms > 0 else 1.0

    @property
    def share(self) -> float:
        """The share of the misses the device sends to the CPU: 0 where it gains nothing."""
        return self.to_host / self.misses if self.ms < self.copy_ms else 0.0


def split(misses: int, tokens_per_expert: float, expert_bytes: int,
          rates: HostRates, cpu_bytes: int | None = None) -> Split:
    """The ``k`` of ``misses`` the CPU computes that makes the layer wait least (Note [Host
    split]); ties go to copying (the copied experts stay cached for the next steps). The copy
    moves ``expert_bytes`` per expert; the CPU's time scales with ``cpu_bytes`` (default the
    same; fp8 experts against rates measured in bf16: their bf16 size, since the CPU
    dequantizes them)."""
    if misses < 0:
        raise ConfigError(f"misses must be >= 0, got {misses}")
    per_expert = rates.cpu_ms(tokens_per_expert, cpu_bytes or expert_bytes)
    copy_all = fetch_ms(misses, expert_bytes)
    best = Split(misses, 0, copy_all, copy_all, 0.0)
    for k in range(1, misses + 1):
        cpu = rates.handoff_ms + k * per_expert
        ms = max(cpu, fetch_ms(misses - k, expert_bytes))
        if ms < best.ms:
            best = Split(misses, k, ms, copy_all, cpu)
    return best


@dataclass(frozen=True)
class HostPolicy:
    """The host share of a step by its token count (Note [Host split]): ``shares[t]`` for
    steps of ``t`` tokens, none above ``max_tokens`` (the copy alone serves them); ``why``
    says how the shares were found, for the start-up line."""

    shares: dict[int, float]
    why: str = ""
    predicted: dict[int, Split] = field(default_factory=dict, compare=False)

    @property
    def max_tokens(self) -> int:
        return max((t for t, share in self.shares.items() if share > 0), default=0)

    def share(self, tokens: int) -> float:
        return self.shares.get(tokens, 0.0)


def host_policy(rates: HostRates, *, experts: int, top_k: int, slots: int, expert_bytes: int,
                max_tokens: int = 16, forced: float | None = None,
                cpu_bytes: int | None = None) -> HostPolicy:
    """The shares for steps of 1..``max_tokens`` tokens: each step's expected misses (its
    distinct experts under uniform routing, of which a cache of ``slots`` holds ``slots /
    experts``: the hard case) split by :func:`split`; ``forced`` gives every such step that
    share instead (a profile's number). Shapes whose steps need more experts than the slots
    hold get none (one pass only)."""
    shares, predicted = {}, {}
    for t in range(1, max_tokens + 1):
        if min(experts, t * top_k) > slots:
            break
        distinct = expected_distinct(experts, top_k, t)
        misses = distinct * (1 - slots / experts)
        if forced is not None:
            shares[t] = forced
            continue
        best = split(max(1, round(misses)), t * top_k / distinct, expert_bytes, rates,
                     cpu_bytes)
        predicted[t] = best
        shares[t] = best.share
    why = (f"forced to {forced} by the profile" if forced is not None else
           f"from {rates.source}: " + ", ".join(
               f"{t} token{'s' if t > 1 else ''}: {b.to_host} of {b.misses} misses on the CPU, "
               f"{b.ms:.3f} ms against {b.copy_ms:.3f} copying ({b.gain:.2f}x)"
               for t, b in predicted.items() if t in (1, 2, 4, 8, 16)))
    return HostPolicy(shares, why, predicted)
