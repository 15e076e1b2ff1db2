"""ExpertLayerRing: whole layers of routed experts streamed ahead on the copy engines, for steps
that need nearly every expert (prefill, large batches).

Note [Expert layer ring]
    A step of many tokens chooses nearly every expert of every layer (at top-8 of 128, a step
    of 64 tokens leaves about one expert unchosen). Its router then tells nothing worth
    waiting for: the cache's device-indexed fetch (Note [Expert cache]) would copy almost the
    whole layer through the SMs, on the step's own stream, after the router, with nothing to
    overlap. Such a step is better served as the weight streamer serves layers: copy each
    chosen layer's experts whole, in their own layout, on a copy engine, ahead of the layer,
    while the layers before it compute.

    The ring is a :class:`~ringflow.graphs.slots.SlotPool` of ``buffers`` byte slots, each one
    layer's ``w13`` and ``w2`` back to back, allocated once with the lane (before vLLM sizes
    its KV cache). Its leases keep the usual lifecycle (Note [Lease lifecycle]):

    1. A fill (position ``p`` of the chosen layers) leases the longest-free slot; the copy
       stream waits for that slot's last retire event (recorded on the compute stream after
       its last read) and copies the layer's experts from host memory with ``copy_`` (DMA: a
       copy engine, not the SMs), then records the lease's ready event.
    2. Layer ``p`` waits for its ready event on the compute stream, computes from the slot and
       records the retire event; the lease goes back; the freed slot is filled next with
       position ``p + buffers``: each copy starts as soon as its slot's reader is done, never a
       fixed number of layers ahead (Note [When a gather is issued]).
    3. In a step's tail, past the last chosen layer, the freed slots take the next step's first
       positions (carried, ``SlotPool.carried``): the next large step starts with them filled,
       and the copies ran while the GPU finished this step and vLLM scheduled the next. A step
       whose first position is not carried (the first one, after ``forget``) fills at its
       start. Carried fills are only ever waited on by a layer step, so slot-cache steps in
       between leave them as they are.

    Where the ring serves a step is the caller's choice, by the step's token count
    (``experts.layer_tokens``), never under a CUDA graph capture: a fork to the copy stream in
    one layer and its join in another would straddle vLLM's piecewise graphs, and a carried
    fill outlives the step a graph holds. Large steps are not captured by vLLM anyway (its
    capture sizes end at a few hundred tokens); steps that are fall back to the slot cache.

    With ``trace`` set, every fill, read, event record and wait is recorded
    (``ExpertOp``) for the proof of Note [Expert lane hazards]. With ``poison_reads``, a slot is
    poisoned after its read, on the compute stream before its retire event: a read that skips
    its fill's ready event sees NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ringflow.cudart import copy_async
from ringflow.errors import ConfigError, KernelError
from ringflow.graphs.slots import SlotPool, poison
from ringflow.orchestrator.expert_hazards import ExpertOp

LANE = "experts-layers"
ALIGN = 256  # each parameter's offset in a slot: aligned for any dtype and for DMA


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layer_layout(host: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Where each of a layer's parameters starts in a layer buffer, and the buffer's bytes."""
    offsets, end = {}, 0
    for name, t in host.items():
        offsets[name] = end
        end += aligned(t.numel() * t.element_size())
    return offsets, end


class ExpertLayerRing:
    """``buffers`` device slots, each the routed experts of one layer, filled in the order of
    ``hosts`` (per chosen layer: parameter name → tensor [experts, ...], all layers of one
    layout) from host memory, on ``stream`` (None on the CPU: copies in line). See
    Note [Expert layer ring]."""

    def __init__(self, hosts: Sequence[Mapping[str, torch.Tensor]], buffers: int,
                 device: torch.device | str, stream: torch.cuda.Stream | None = None,
                 poison_reads: bool = False, storage: torch.Tensor | None = None,
                 lend: Callable[[], None] | None = None) -> None:
        if not hosts:
            raise ConfigError("an expert layer ring needs at least one layer")
        layout = [(name, t.shape, t.dtype) for name, t in hosts[0].items()]
        for i, host in enumerate(hosts):
            if [(n, t.shape, t.dtype) for n, t in host.items()] != layout:
                raise ConfigError(f"the expert layers of a ring share one layout; layer "
                                  f"position {i} has {self._describe(host)}, the first "
                                  f"{self._describe(hosts[0])}")
        if buffers < 1:
            raise ConfigError(f"an expert layer ring needs at least 1 buffer, got {buffers}")
        for host in hosts:
            for name, t in host.items():
                if not t.is_contiguous():
                    raise ConfigError(f"expert parameter {name} must be contiguous (one "
                                      f"expert after another) to be copied whole")
        self.hosts = [dict(h) for h in hosts]
        self.device = torch.empty(0, device=device).device
        if (stream is None) != (self.device.type != "cuda"):
            raise ConfigError("an expert layer ring on a GPU needs a copy stream, and on the "
                              "CPU none")
        self.stream = stream
        offsets, end = layer_layout(hosts[0])
        self.layer_bytes = end
        #: the ring's own buffers; the storage's rows past them are borrowed from the slot
        #: caches' memory (Note [Borrowed layer buffers])
        self.own = min(buffers, len(hosts))  # more than the layers would carry one into itself
        slots = self.own if storage is None else storage.shape[0]
        if not self.own <= slots <= len(hosts) or (slots > self.own) != (lend is not None):
            raise ConfigError(f"an expert layer ring of {self.own} buffers over {len(hosts)} "
                              f"layers takes storage of {self.own} to {len(hosts)} layer rows, "
                              f"and a lend function exactly when it has more than its own; "
                              f"given {slots} rows, lend {'set' if lend else 'unset'}")
        self.pool = SlotPool(LANE, (end,), torch.uint8, depth=slots - 1,
                             workspace_bytes=slots * end, device=self.device, storage=storage)
        self.views = [{name: slot[offsets[name]:offsets[name] + torch.Size(shape).numel()
                                  * dtype.itemsize].view(dtype).view(shape)
                       for name, shape, dtype in layout} for slot in self.pool.storage]
        for views in self.views:
            for v in views.values():
                poison(v)
        self.poison_reads = poison_reads
        # one ready and one retire event per slot, made once: a slot's event is recorded
        # again only after every wait on its previous record was issued (host order), so no
        # event is made per layer on the step's path
        cuda = self.device.type == "cuda"
        self._ready = [torch.cuda.Event() if cuda else None for _ in range(self.pool.slots)]
        self._retire = [torch.cuda.Event() if cuda else None for _ in range(self.pool.slots)]
        #: per slot, whether a read since its last fill must be waited for before the next
        #: fill (False: never read, or ordered by stream order after an abandon)
        self._retired: list[bool] = [False] * self.pool.slots
        self._next = 0  # the next position to fill: >= len(hosts) is the next step's
        self._reading = None  # (position, lease) of the layer computing now
        # borrowing (Note [Borrowed layer buffers]): the slot caches' memory is the ring's
        # while ``lent``; ``_lent_at`` (compute) orders the borrowed fills after the caches'
        # last use, ``_returned`` (copy) orders the caches' next use after the borrowed fills
        self._lend, self.lent = lend, False
        self._lent_at = torch.cuda.Event() if cuda else None
        self._returned = torch.cuda.Event() if cuda else None
        self.steps = 0  # large steps served
        self.carried_steps = 0  # of which started with their first layer filled ahead
        self.carried_layers = 0  # layers filled ahead at those steps' starts, in all
        self.fills = 0
        self.lends = 0  # times the slot caches' memory was borrowed
        #: a list to append each operation to (ExpertOp, Note [Expert lane hazards]), or None
        self.trace: list[ExpertOp] | None = None

    @staticmethod
    def _describe(host: Mapping[str, torch.Tensor]) -> str:
        return ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in host.items())

    @property
    def layers(self) -> int:
        return len(self.hosts)

    @property
    def buffers(self) -> int:
        """Layer buffers in large steps: the ring's own and the borrowed ones."""
        return self.pool.slots

    @property
    def borrowed(self) -> int:
        return self.pool.slots - self.own

    @property
    def bytes(self) -> int:
        """Device bytes of the ring's own buffers (the borrowed ones are the caches')."""
        return self.own * self.layer_bytes

    def begin(self, position: int) -> dict[str, torch.Tensor]:
        """Layer ``position`` of a large step is about to compute on the current stream: order
        it after its fill (issued now if it was not) and return its weights."""
        if not 0 <= position < self.layers:
            raise KernelError(f"the expert layer ring holds positions 0..{self.layers - 1}, "
                              f"not {position}")
        if self._reading is not None:  # the layer before raised: its read never ended
            self.abandon()
        if position == 0:
            self.steps += 1
            if (LANE, 0) in self.pool.carried:
                self.carried_steps += 1
                self.carried_layers += len(self.pool.carried)
        if self._head() != position:
            self.abandon()  # not the position the fills ran ahead for: start over from here
            self._next = position
        self._fill_ahead()
        lease = self.pool.carried.pop((LANE, position))
        compute = self._current()
        if compute is not None:
            compute.wait_event(lease.ready_event)
        self._op("wait", "compute", on=("ready", lease.slot))
        lease.begin_read()
        self._reading = (position, lease)
        self._op("read", "compute", pairs=((position, lease.slot),))
        return self.views[lease.slot]

    def end(self, position: int) -> None:
        """Layer ``position``'s compute is issued: retire its slot, fill the next position."""
        if self._reading is None or self._reading[0] != position:
            raise KernelError(f"end({position}) without begin({position})")
        _, lease = self._reading
        self._reading = None
        if self.poison_reads:  # after the read, before the retire event: same stream
            for v in self.views[lease.slot].values():
                poison(v)
        event = self._retire[lease.slot]
        if event is not None:
            event.record(self._current())
        self._op("record", "compute", on=("retired", lease.slot))
        lease.retire(event)
        self._retired[lease.slot] = True
        lease.release()
        if position == self.layers - 1:
            self._next -= self.layers  # what was filled past the end is the next step's
        self._fill_ahead()

    def forget(self) -> None:
        """The host copies changed: nothing filled or carried is current. The next fills run
        on the copy stream after the ones forgotten, so their slots need no wait."""
        self.abandon()
        self._next = 0

    def abandon(self) -> None:
        """Drop every fill issued ahead (a step that stopped half-way, or a new step that does
        not start where the fills ran ahead for)."""
        if self._reading is not None:
            _, lease = self._reading
            self._reading = None
            lease.retire(None)  # never read past this point: the next fill waits for its
            self._retired[lease.slot] = False  # reads by stream order on the compute stream
            lease.release()
            if self.stream is not None:  # the reads were issued on the compute stream
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._op("wait", "copy", on="compute")
        self.pool.forget_carried()

    def _head(self) -> int | None:
        """The position of the oldest fill issued ahead (None: none)."""
        return next(iter(self.pool.carried), (None, None))[1]

    def _fill_ahead(self, own_only: bool = False) -> None:
        """Fill positions from ``_next`` into free slots (``own_only``: the ring's own), up to
        the next step's last."""
        while self._next < 2 * self.layers:
            position = self._next % self.layers
            if position == 0 and self._next and (LANE, 0) in self.pool.carried:
                break  # never two fills of one position at once
            free = [s for s in self.pool.free_slots() if s < self.own or not own_only]
            if not free:
                break
            lease = self.pool.acquire(free[0], tag=position)
            self._fill(position, lease)
            self.pool.carried[(LANE, position)] = lease
            self._next += 1

    def _fill(self, position: int, lease) -> None:
        views, host = self.views[lease.slot], self.hosts[position]
        borrowed = lease.slot >= self.own
        if borrowed and not self.lent:
            self._borrow()
        retired = self._retired[lease.slot]
        if retired:
            self._op("wait", "copy", on=("retired", lease.slot))
        if borrowed:
            self._after_lend()
        self._op("fill", "copy", pairs=((position, lease.slot),))
        self._op("record", "copy", on=("ready", lease.slot))
        if borrowed:
            self._op("record", "copy", on="returned")
        self.fills += 1
        if self.stream is None:  # the CPU: in line, in issue order
            for name, v in views.items():
                v.copy_(host[name])
            lease.mark_ready(None)
            return
        ready = self._ready[lease.slot]
        if retired:
            self.stream.wait_event(self._retire[lease.slot])  # its last reader is done
        for name, v in views.items():  # a copy engine (DMA), not the SMs
            copy_async(v.data_ptr(), host[name].data_ptr(), v.numel() * v.element_size(),
                       self.stream.cuda_stream)
        ready.record(self.stream)
        if borrowed:
            self._returned.record(self.stream)
        lease.mark_ready(ready)

    def _borrow(self) -> None:
        """Take the slot caches' memory (Note [Borrowed layer buffers], step 1): empty the
        caches on the compute stream, then mark that point for the borrowed fills."""
        self._lend()
        if self._lent_at is not None:
            self._lent_at.record(self._current())
        self._op("record", "compute", on="lent")
        self.lent, self.lends = True, self.lends + 1

    def _after_lend(self) -> None:
        """Order a borrowed fill after the caches' last use (the lend's event)."""
        self._op("wait", "copy", on="lent")
        if self.stream is not None:
            self.stream.wait_event(self._lent_at)

    def give_back(self) -> None:
        """The slot caches' memory goes back to them (Note [Borrowed layer buffers], step 3):
        the current (compute) stream waits for the borrowed fills, and the fills carried in
        borrowed buffers are dropped, with every one after them; the ring's own free buffers
        then take the next large step's first layers again. Call it eagerly before a step
        that uses the caches; nothing when nothing is lent."""
        if not self.lent:
            return
        if self._reading is not None:
            self.abandon()
        compute = self._current()
        if compute is not None:
            if torch.cuda.is_current_stream_capturing():
                raise KernelError("the expert layer ring still holds the slot caches' memory "
                                  "as a CUDA graph capture begins; it is given back before "
                                  "each step vLLM runs under a graph (the forward-context "
                                  "hook), which did not run here")
            compute.wait_event(self._returned)
        self._op("wait", "compute", on="returned")
        kept = []
        for key, lease in self.pool.carried.items():
            if lease.slot >= self.own or key[1] != len(kept):
                break
            kept.append(key)
        self.pool.forget_carried([k for k in self.pool.carried if k not in kept])
        self._next = len(kept)
        self.lent = False
        self._fill_ahead(own_only=True)  # the next large step's first layers, as without borrowing

    def _current(self) -> torch.cuda.Stream | None:
        return None if self.stream is None else torch.cuda.current_stream(self.device)

    def _op(self, kind: str, stream: str, pairs: tuple = (), on: object = None) -> None:
        """Trace one operation on the ring's logical streams, ``copy`` and ``compute`` (the
        same on the CPU, where both run in line: the proof checks what a GPU would order)."""
        if self.trace is not None:
            self.trace.append(ExpertOp(kind, stream, pairs, on, owner="ring"))

    def describe(self) -> dict:
        return {"layers": self.layers, "buffers": self.own, "borrowed_buffers": self.borrowed,
                "layer_bytes": self.layer_bytes, "steps": self.steps,
                "carried_steps": self.carried_steps, "carried_layers": self.carried_layers,
                "fills": self.fills, "lends": self.lends}
