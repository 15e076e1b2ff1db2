"""ExpertArena: one device allocation for an expert lane's slot caches and its layer ring, laid
out so that a large step can use the caches' memory as more layer buffers.

Note [Borrowed layer buffers]
    A lane holds two kinds of expert memory on the device: each chosen layer's slot cache
    (Note [Expert cache]), read by steps of few tokens, and the layer ring's buffers (Note
    [Expert layer ring]), read by steps of many. A step uses one kind only (Note [Expert lane
    modes]), so during a large step the caches' memory sits idle. The arena lays the ring's
    own buffers first and the caches after them, back to back, so that the caches' memory
    also reads as whole layer buffers (as many as fit): the ring *borrows* them for large
    steps. With four layers of 128 experts and 32 slots each, the caches hold one layer's
    worth: the ring of two buffers serves large steps with three, and carries three layers
    of the next step in a step's tail instead of two. The memory budget is unchanged.

    The caches' memory belongs to one owner at a time, and each handover is ordered:

    1. **Lend** (the ring, at its first borrowed fill after a give-back, eagerly on the
       compute stream): every cache is emptied (``ExpertCache.evict``: what its slots held
       will be overwritten), then an event is recorded; each borrowed fill on the copy stream
       waits for it, so it starts after the caches' last reads and installs.
    2. **Borrowed**: the ring fills and reads borrowed buffers like its own (ready and retire
       events per buffer); after each borrowed fill the copy stream records ``returned``.
    3. **Give back** (before any step that uses the caches): the compute stream waits for
       ``returned``, so no install overwrites a borrowed fill still being copied, and the
       ring drops its carried fills from the first borrowed one on (the caches will write
       over them; the fills before it, in its own buffers, stay carried). The next step
       starts with empty caches and fetches what it needs.

    A give-back must be issued eagerly, before the step that uses the caches: a wait on an
    event recorded outside a CUDA graph capture cannot be captured, and a replayed graph runs
    none of ringflow's Python. So the lane gives back at the start of every step it runs
    eagerly through the caches, and vLLM's forward context (set for every step, graphs
    included) gives back before every step vLLM runs or captures under a graph
    (``experts.on_forward_context``). Where that hook is missing the ring does not borrow
    (one line says so). A step after a large one may wait for the borrowed copies still in
    flight (at most the borrowed layers' copy time) and starts with cold caches: the price of
    carrying more of the next large step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringflow.errors import AllocationError, ConfigError
from ringflow.integrations.torch.expert_layers import aligned, layer_layout


class ExpertArena:
    """The device memory of a lane over ``hosts`` (per chosen layer: parameter name → tensor
    [experts, ...], one layout): ``slots[i]`` cache slots for layer ``i`` and a ring of
    ``buffers`` layer buffers (0: no ring), with as many more borrowed from the caches as fit
    when ``lend`` (Note [Borrowed layer buffers])."""

    def __init__(self, hosts: Sequence[Mapping[str, torch.Tensor]], slots: Sequence[int],
                 buffers: int, device: torch.device | str, lend: bool = True) -> None:
        if len(hosts) != len(slots) or not hosts:
            raise ConfigError(f"an expert arena needs one slot count per layer: {len(hosts)} "
                              f"layers, {len(slots)} slot counts")
        if buffers < 0:
            raise ConfigError(f"layer buffers must be >= 0, got {buffers}")
        _, self.layer_bytes = layer_layout(hosts[0])
        self.own = min(buffers, len(hosts))
        cache_offsets, end = [], 0
        for host, count in zip(hosts, slots):
            offsets = {}
            for name, t in host.items():
                offsets[name] = end
                end += aligned(count * t[0].numel() * t.element_size())
            cache_offsets.append(offsets)
        self.cache_bytes = end
        self.borrowed = (min(end // self.layer_bytes, len(hosts) - self.own)
                         if lend and self.own else 0)
        ring_bytes = self.own * self.layer_bytes
        try:
            self.memory = torch.empty(ring_bytes + end, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as exc:
            raise AllocationError(f"the expert lane's {ring_bytes + end:,} bytes (a ring of "
                                  f"{self.own} layers and {sum(slots)} expert slots) cannot be "
                                  f"allocated on {device} ({str(exc).splitlines()[0]}); give "
                                  f"fewer slots or layer buffers") from exc
        rows = self.own + self.borrowed
        #: the ring's buffers, own then borrowed, as rows of bytes (None: no ring)
        self.ring_storage = (self.memory[:rows * self.layer_bytes].view(rows, self.layer_bytes)
                             if self.own else None)
        caches = self.memory[ring_bytes:]
        #: per layer, its cache's slots by parameter name
        self.cache_storage = [
            {name: caches[off:off + count * t[0].numel() * t.element_size()]
             .view(t.dtype).view(count, *t.shape[1:]) for (name, t), off
             in zip(host.items(), offsets.values())}
            for host, count, offsets in zip(hosts, slots, cache_offsets)]

    @property
    def bytes(self) -> int:
        return self.memory.numel()
