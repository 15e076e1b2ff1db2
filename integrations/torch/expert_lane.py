"""ExpertLane: one model's expert lane, the slot caches of its chosen layers and one layer ring,
and the choice, per step, of which serves it.

Note [Expert lane modes]
    A step of few tokens (decode) reads a few experts per layer: the layer's slot cache brings
    in only the ones its router chose that it lacks (Note [Expert cache]). A step of many
    tokens (prefill, a large batch) reads nearly all of them: the layer ring copies each
    chosen layer whole, ahead, on a copy engine (Note [Expert layer ring]). The lane picks one
    per step from the step's token count against ``layer_tokens``: every chosen layer of a
    step sees the same count, so a step is served by one mode throughout, and the ring's fill
    order (position after position) holds. A step under a CUDA graph capture always takes the
    slot cache (the ring's fills cross layers and steps; a graph holds one piece of one step).
    The choice depends on the step's shape and on whether it is captured, so a replay repeats
    it.

    With the ring holding its first layers (Note [Small steps read the held layers]), a
    small step computes those from their buffers, every expert at its own index, and only the
    other layers have slot caches.

    A decode step may hand part of each layer's misses to the host, which computes them on
    the CPU while the GPU copies and computes the rest (Note [Host split], Note [Host
    experts]): the share comes from ``host_policy`` by the step's token count, for steps of
    one pass only, so a replay repeats it.

    Both modes compute with the caller's ``compute`` (Note [Same bits as resident] for vLLM's
    kernel on a GPU): ``compute(x, weights, topk_weights, topk_ids, expert_map, last)`` with
    ``expert_map`` None where ``weights`` hold every expert at its own index (a ring buffer)
    and the step's sum returned when ``last``; a step with a host share adds ``host_rows``,
    called at the sum for the host's rows (Note [Host experts], step 3).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping

import torch

from ringflow.errors import ConfigError
from ringflow.graphs import nvtx_ranges
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_layers import ExpertLayerRing
from ringflow.integrations.torch.expert_lookahead import Lookahead
from ringflow.integrations.torch.host_experts import HostExperts
from ringflow.orchestrator.expert_hazards import ExpertOp
from ringflow.orchestrator.host_split import HostPolicy
from ringflow.kernels.moe import moe_from_slots

log = logging.getLogger("ringflow")

#: (x, weights, topk_weights, topk_ids, expert_map or None, last[, host_rows]) -> the step's
#: sum when last; ``host_rows()``: the rows [tokens, top_k, hidden] of the choices computed
#: elsewhere (the host's share, zeros at the others), joined when called: call it at the sum
Compute = Callable[..., "torch.Tensor | None"]


class TorchCompute:
    """The lane's compute where vLLM's kernels are not in play (vLLM's CPU build, tests):
    ringflow's torch MoE per pass, summed in float32 over the passes and cast once."""

    def __init__(self) -> None:
        self._acc: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weights: Mapping[str, torch.Tensor],
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None, last: bool = True,
                 host_rows: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        if expert_map is None:  # every expert at its own index
            expert_map = torch.arange(weights["w13"].shape[0], device=x.device)
        part = moe_from_slots(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                              expert_map)
        self._acc = part if self._acc is None else self._acc.add_(part)
        if not last:
            return None
        if host_rows is not None:
            self._acc.add_(host_rows().float().sum(1))
        out, self._acc = self._acc.to(x.dtype), None
        return out


class ExpertLane:
    """The chosen layers' ``caches`` (decoder index → cache), one ``ring`` over the same layers
    in index order (None: no ring), ``computes`` per layer, and the lookaheads (layer → its
    guess of the next chosen layer, Note [Expert lookahead]) and the engine's ``modules`` per
    layer; with ``early_start``, ``prepare_step`` starts large steps before their forward
    (Note [Large steps start early]); see Note [Expert lane modes]."""

    def __init__(self, caches: Mapping[int, ExpertCache], computes: Mapping[int, Compute],
                 ring: ExpertLayerRing | None = None, layer_tokens: int = 1024,
                 lookaheads: Mapping[int, Lookahead] | None = None,
                 modules: Mapping[int, object] | None = None,
                 host: HostExperts | None = None,
                 host_policy: HostPolicy | None = None, early_start: bool = False) -> None:
        layers = sorted(computes)
        #: the ring's held layers (Note [Small steps read the held layers]): no cache
        self.held = layers[:ring.held] if ring is not None else []
        if set(caches) != set(layers) - set(self.held):
            raise ConfigError(f"one compute per layer and a cache per layer the ring does not "
                              f"hold: caches {sorted(caches)}, computes {layers}, held "
                              f"{self.held}")
        if ring is not None and ring.layers != len(layers):
            raise ConfigError(f"the layer ring holds {ring.layers} layers, the lane "
                              f"{len(layers)}")
        if layer_tokens < 1:
            raise ConfigError(f"layer_tokens must be >= 1, got {layer_tokens}")
        self.caches = dict(sorted(caches.items()))
        self.computes = dict(computes)
        self.ring, self.layer_tokens = ring, layer_tokens
        self.position = {layer: i for i, layer in enumerate(layers)}
        self.ahead = dict(lookaheads or {})
        self.behind = {self._layer_of(la.target): la for la in self.ahead.values()}
        self._ranges = {layer: {kind: nvtx_ranges.handle(f"ringflow/experts/{kind}/L{layer}")
                                for kind in ("fetch", "moe", "lookahead", "layer", "stage")}
                        for layer in layers}
        self.early_start = early_start  # prepare_step starts large steps (Note [Large ...])
        self._prepare_range = nvtx_ranges.handle("ringflow/experts/prepare")
        self.said_capture = self.said_dropped = False
        if (host is None) != (host_policy is None) or not set(
                host.layers if host else ()) <= set(caches):
            raise ConfigError(f"a host share needs host experts of cached layers and a policy: "
                              f"host layers {list(host.layers) if host else None}, caches "
                              f"{sorted(caches)}")
        self.host, self.host_policy = host, host_policy
        if host is not None:  # its worker holds no reference to the lane: stop it with it
            weakref.finalize(self, host.close)
        #: the engine's object per layer that this lane serves (vLLM's ``RoutedExperts``), for
        #: whoever must find a layer's lane (a reload); empty outside an engine
        self.modules = dict(modules or {})

    def store(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s host store (parameter name -> [experts, ...]): its cache's, or
        the ring's for a held layer."""
        if layer in self.caches:
            return self.caches[layer].host
        return self.ring.hosts[self.position[layer]]

    def _layer_of(self, cache: ExpertCache) -> int:
        return next(i for i, c in self.caches.items() if c is cache)

    def uses_ring(self, tokens: int, device: torch.device) -> bool:
        """Whether a step of ``tokens`` tokens takes the layer ring (Note [Expert lane modes])."""
        if self.ring is None or tokens < self.layer_tokens:
            return False
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            if not self.said_capture:
                self.said_capture = True
                log.info("experts.layer_tokens: a step of %d tokens is being captured into a "
                         "CUDA graph; captured steps take the slot cache, never the layer "
                         "ring", tokens)
            return False
        return True

    def prepare_step(self, tokens: int) -> bool:
        """The engine is about to issue a step of ``tokens`` tokens (its forward not yet
        begun): with ``early_start``, a large one starts its ring now where the ring has
        something to start early (the arena: Note [Large steps start early]). Returns
        whether it did."""
        device = next(iter(self.caches.values())).device
        if not self.early_start or not self.uses_ring(tokens, device):
            return False
        for lookahead in self.ahead.values():  # as at a start in forward: a decode step that
            lookahead.join()  # raised may have left guesses installing into the slots
        return nvtx_ranges.call(self._prepare_range, self.ring.prepare)

    def finish_step(self, tokens: int) -> bool:
        """After the engine ran a step ``prepare_step`` started: a prepare no first layer went
        on from (a CUDA graph replayed the step, or it ran no forward) is dropped (Note
        [Large steps start early]), said once. Returns whether one was."""
        if self.ring is None or not self.ring.drop_prepared():
            return False
        if not self.said_dropped:
            self.said_dropped = True
            log.info("experts.early_start: a step of %d tokens was started early, but vLLM ran "
                     "it without the lane's large-step path (a CUDA graph replay, or no "
                     "forward); what it filled stays for the next large step. A layer_tokens "
                     "above vLLM's largest captured size keeps replayed steps from being "
                     "started early", tokens)
        return True

    def forward(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, may_fork: Callable[[], bool] = lambda: True
                ) -> torch.Tensor:
        """Layer ``layer``'s routed experts for this step's tokens ``x``, in ``x.dtype``."""
        behind = self.behind.get(layer)
        if behind is not None:
            behind.join()
        ranges, compute = self._ranges[layer], self.computes[layer]
        if self.uses_ring(x.shape[0], x.device):
            position = self.position[layer]
            if self.ring.starting(position):  # where the ring reads the slot tables: a
                for lookahead in self.ahead.values():  # decode step that raised may have
                    lookahead.join()  # left guesses installing into the slots it copies from
            try:
                weights, expert_map = nvtx_ranges.call(ranges["layer"], self.ring.begin,
                                                       position)
                try:
                    out = nvtx_ranges.call(ranges["moe"], compute, x, weights, topk_weights,
                                           topk_ids, expert_map, True)
                finally:
                    self.ring.end(position)
            except BaseException:
                if self.ring.held:  # the step stops here: its small steps' layers back in
                    self.ring.carry_held()  # place (Note [Small steps read the held layers])
                raise
            return out
        ahead = self.ahead.get(layer)
        if layer not in self.caches:  # held in the ring (Note [Small steps read the held layers])
            weights = nvtx_ranges.call(ranges["layer"], self.ring.read_held,
                                       self.position[layer])
            if ahead is not None:
                nvtx_ranges.call(ranges["lookahead"], ahead.launch, x, may_fork())
            return nvtx_ranges.call(ranges["moe"], compute, x, weights, topk_weights, topk_ids,
                                    None, True)
        if self.ring is not None:  # an arena's carried fill may still write these slots
            self.ring.before_small(self.position[layer])
        cache = self.caches[layer]
        passes = cache.passes(*topk_ids.shape)
        host = self.host
        share = (self.host_policy.share(x.shape[0]) if host is not None and layer in host.layers
                 and passes == 1 and x.shape[0] <= host.max_tokens else 0.0)
        on_split, extra = None, ()
        if share:  # Note [Host experts], steps 1 and 2: before the other misses are installed
            def on_split():
                nvtx_ranges.call(ranges["stage"], host.launch, layer, x, topk_weights, topk_ids,
                                 cache.host_mine, cache.trace)
            extra = (lambda: host.join(x.shape[0], cache.trace),)  # step 3, at the sum
        maps = cache.serve(topk_ids, share, on_split)
        out = None
        for p in range(passes):
            weights, expert_map = nvtx_ranges.call(ranges["fetch"], next, maps)
            if p == 0 and ahead is not None:
                nvtx_ranges.call(ranges["lookahead"], ahead.launch, x, may_fork())
            out = nvtx_ranges.call(ranges["moe"], compute, x, weights, topk_weights, topk_ids,
                                   expert_map, p == passes - 1, *extra)
        return out

    def trace_all(self, ops: list | None) -> None:
        """Trace the ring's operations and every cache's into ``ops`` in issue order, the
        cache's tagged with its position and the lane's stream (the current one) named
        ``compute``, as the ring names it: the joint trace ``check_lane`` proves (Note [Expert
        lane hazards]). None stops tracing."""
        if self.ring is not None:
            self.ring.trace = ops
        for layer, cache in self.caches.items():
            cache.trace = (None if ops is None
                           else _Tagged(ops, self.position[layer], cache.trace_stream()))

    @property
    def bytes(self) -> int:
        """Device bytes of the slots, the ring and the host shares' outputs, reserved when the
        lane was built."""
        return (sum(c.bytes for c in self.caches.values())
                + (self.ring.bytes if self.ring is not None else 0)
                + (self.host.bytes if self.host is not None else 0))

    def forget(self) -> None:
        """The host copies changed (a reload): no cached expert nor ring fill is current."""
        if self.ring is not None:  # first: an arena orders the caches' poison after its fills
            self.ring.forget()
        for cache in self.caches.values():
            cache.forget()

    def report(self) -> list[dict]:
        """Per chosen layer: its decoder index, the cache's layout and counters, and the ring's
        (one host sync per layer)."""
        ring = self.ring.describe() if self.ring is not None else None
        return [{"layer": i, **({"held_in_ring_buffer": self.position[i]} if i in self.held
                                else self.caches[i].describe()),
                 "layer_tokens": self.layer_tokens,
                 "ring": ring, **({"host_share": self._host_report(i)} if self.host is not None
                                  and i in self.host.layers else {})}
                for i in self.position]

    def _host_report(self, layer: int) -> dict:
        """A layer's host share: what its worker did, and per step size the share and what
        the model predicted for the CPU's time and the copy's (Note [Host split])."""
        policy = self.host_policy
        return {**self.host.describe(layer),
                "shares": {t: round(share, 4) for t, share in policy.shares.items()},
                "predicted": {t: {"misses": b.misses, "to_host": b.to_host,
                                  "cpu_ms": round(b.cpu_ms, 4), "copy_ms": round(b.copy_ms, 4),
                                  "layer_ms": round(b.ms, 4)}
                              for t, b in policy.predicted.items()}}

    def close(self) -> None:
        """Stop the host share's worker (when no step or graph will run this lane again)."""
        if self.host is not None:
            self.host.close()


class _Tagged:
    """A cache's trace as part of a lane's joint trace: each operation tagged with the cache's
    position (``space``) and the lane's stream (``main``) renamed ``compute``."""

    def __init__(self, ops: list, space: int, main: object) -> None:
        self.ops, self.space, self.main = ops, space, main

    def append(self, op: ExpertOp) -> None:
        rename = {self.main: "compute"}  # streams, events and stream handles: hashable
        self.ops.append(ExpertOp(op.kind, rename.get(op.stream, op.stream), op.pairs,
                                 rename.get(op.on, op.on), self.space))

    def __iadd__(self, ops: list[ExpertOp]) -> "_Tagged":
        for op in ops:
            self.append(op)
        return self
