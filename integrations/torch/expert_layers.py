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

    Fills take what the slot caches hold (Note [Ring fills from the slots]).

    With ``trace`` set, every fill, read, event record and wait is recorded
    (``ExpertOp``) for the proof of Note [Expert lane hazards]. With ``poison_reads``, a slot is
    poisoned after its read, on the compute stream before its retire event: a read that skips
    its fill's ready event sees NaN.

Note [Ring fills from the slots]
    Between large steps the lane's decode steps leave each layer's slot cache holding some of
    its experts (32 of 128 in the H200 bench: a quarter of the layer). A fill that copied those
    from host memory again would spend a quarter of the host link on bytes already on the
    device, and a step of copy-bound layers (chunked prefill) waits on exactly that link. So a
    fill of position ``p``, given the lane's ``caches``, takes the experts ``p``'s cache holds
    from its slots (device to device, a few hundred MB at device speed) and only the rest
    from host memory:

    1. At a large step's first layer (position 0, or a restart), before any fill, the ring
       reads each cache's slot -> expert table on the compute stream: a device copy of it
       (which slots hold which expert, for the slot-to-buffer kernel) and a copy to pinned host
       memory with an event. The first fill that needs the host's view waits for that event
       (by then the GPU runs the first layer, which is already issued). No slot changes while
       the ring serves a step (the caches serve only small steps, and the lane joins every
       pending lookahead before the ring's first layer, so no side-stream install is still
       writing), so the table holds for every fill the step issues. Fills carried into the
       next step copy their slot rows now, in this step's tail, ahead on the compute stream of
       any decode step that could rewrite them.
    2. The held experts are copied into the buffer on the **compute** stream (kernels/
       expert_fetch.py over device memory): after the buffer's previous readers by stream
       order, after the buffer's previous fill by a wait on its ready event (a fill never read
       may still be copying), and before every later install into those slots by stream order
       (installs run on the compute stream, or on a lookahead's stream that waits for it
       first). A carried fill's slot rows are therefore copied before any decode step in
       between rewrites them.
    3. The buffer's retire event is recorded after that copy; the copy stream waits for it and
       copies the other experts from host memory in runs of consecutive experts, then records
       the ready event. A fill is two ``fill`` operations in the trace, one per stream, and
       :func:`~ringflow.orchestrator.expert_hazards.check_ring` proves their order on the
       buffer. The slot side is traced too: each slot copy is a ``take`` of (expert, slot)
       of that position's cache, and a lane's joint trace (``ExpertLane.trace_all``, the
       caches' installs and reads among the ring's operations) is proven by
       :func:`~ringflow.orchestrator.expert_hazards.check_lane`: every take names what its
       slot holds, after the install that wrote it and before the next install over it
       (Note [Expert lane hazards]; a take off the lane's stream, or by stale tables, fails).

    The buffer ends up holding every expert at its own index, bytes as the host's: the
    layer's compute cannot tell where a row came from.

Note [Ring lends the carried layers' slots]
    A large step's tail fills the ring's buffers with the next step's first positions (0 and
    1 of a ring of two), from their slots and from host memory. From then on those layers'
    slot caches hold nothing the next large step needs: the buffers hold the same experts.
    The first position not carried (2) is then filled only when position 0's buffer retires,
    in the next step, with the copy engines' time of its missing experts on the step's path.
    vLLM's prefetch offloader spends the idle time between steps on every buffer it has; the
    lane's slots are a quarter of its device memory in the H200 bench, and the carried
    layers' quarter sat idle.

    So, with ``lend_slots``, the tail lends the carried positions' slots to the first position
    not carried (``_stage_next``), on the compute stream after the carried fills' slot rows
    were copied (step 2 of Note [Ring fills from the slots]):

    1. each lending cache empties its tables (``ExpertCache.lend``: every slot -1, nothing
       poisoned), so a decode step in between finds nothing there and installs over them;
    2. the target position's experts its own slots do not hold are copied from host memory
       into the lent slots, in expert order, as many as they hold (runs of consecutive
       experts, DMA);
    3. the next large step reads every cache's table at its start (step 1 of Note [Ring
       fills from the slots]). A lent slot whose entry is still -1 was written by nothing
       since (every install sets it to an expert; only ``forget`` and ``lend`` set -1 again,
       and each counts a generation of the cache that the stage checks), so the target's
       fill copies those staged experts from the lent slots into its buffer on the compute
       stream, beside the ones its own slots hold, and only the rest from host memory. A
       staged row whose slot a decode step took is copied from the host as before.

    Every write to and read of a lent slot is on the compute stream (the staging, the
    lenders' installs, the fill's copy), so stream order keeps them apart, as for the slot
    rows of step 2. Back to back (chunked prefill, copy-bound) the host link carries as many
    bytes per step as before: the lenders' next fills find their slots empty and copy those
    experts from the host, and the target copies as many fewer. After an idle gap (a prompt
    arriving at a quiet server) the staging ran in the gap.

    What it costs, and why it is off by default: the staging is on the compute stream, so the
    step after a large one (a decode step, at once, in a server) waits for it: a quarter of a
    layer per lender, 600 MB and about 11 ms in the H200 bench's shape, longer while the
    carried fills share the link. Its decode steps find the lent layers' caches empty, and
    they install over the staged rows first (the lent slots are the least recently used), so
    in the bench's order (decode between prompts) little survives. It gains where large steps
    follow each other after a gap. Bit for bit all-resident on the H200 (engine tests, eager
    and FULL_AND_PIECEWISE, bf16 and fp8); its speed is not measured yet.

Note [Small steps read the held layers]
    Between large steps the ring's buffers hold the next step's first positions whole
    (carried, step 3 of Note [Expert layer ring]), and the decode steps in between read those
    layers from their slot caches, which miss. At the H200 bench's memory (a ring of two and
    a quarter of each layer in slots, 4 layers) that is about 24 experts copied per decode
    step at batch 1, where vLLM's UVA offloader, given the memory as whole layers, reads 8
    to 16 (the bench rounded its ``cpu_offload_gb`` up to whole GiB, two of four layers
    offloaded where one was meant, fixed since): the lane's batch-1 decode ran at 0.67x its
    speed even so. Holding two layers measured 1.95-2.0x the lane on an H100. With uniform
    routing a layer's misses
    fall with the share of its experts on the device, so the same memory serves decode best
    as whole layers plus slots for the rest, not slots everywhere and buffers idle.

    So, with ``hold`` (``experts.decode_from_ring``), positions ``0..buffers-1`` are held:
    they have no slot cache (their share of the slots goes to the other layers), each lives in
    buffer ``p`` (always the same one: a captured graph holds its address), and a small step
    computes them from there (``read_held``) with every expert at its own index:

    1. The ring carries them at its start, and again in every large step's tail as before
       (fills from host memory: they have no slots to fill from). A forget carries them
       again at once, and so does a large step whose layer raised (the lane, before the
       error goes on: a replayed small step runs no Python that could notice). A step that
       raised elsewhere half-way (vLLM stops its engine then) leaves them to the next large
       step, or to the next eager small step, which carries them before it reads; under a
       capture that raises.
    2. A small step waits for the held buffer's ready event. It is an external event, so
       under vLLM's FULL or piecewise capture the graph holds a wait node on its latest
       record (the tail's fill, issued before the replay), where an ordinary event waited on
       in a capture would be refused (recorded before the capture).
    3. Small steps' reads record no retire event (a replay could not record one eagerly).
       The next fill of a held buffer is ordered after them by the compute stream: a large
       step reads position ``p`` before any fill rewrites buffer ``p`` (its retire event
       covers the small steps before it), and a step that starts elsewhere, or a forget,
       makes the copy stream wait for the compute stream first.

    Cost: the first small step after a large one waits for the held fills (two layers from
    host memory, about 45 ms at the H200's 55 GB/s for Qwen3-30B-A3B), once per large step;
    each decode step then copies the misses of fewer layers. The large step's own copies do
    not grow: the held layers' fills copy what their slots would have held, and the other
    layers' fills take more from their bigger caches. With ``buffers < layers < 2 *
    buffers`` a held layer whose buffer no other layer took in the step is copied again in the
    tail all the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringflow.cudart import copy_async
from ringflow.errors import ConfigError, KernelError
from ringflow.graphs.slots import LeaseState, SlotPool, poison
from ringflow.kernels.expert_fetch import fetch_experts
from ringflow.orchestrator.expert_hazards import ExpertOp

LANE = "experts-layers"
_ALIGN = 256  # each parameter's offset in a slot: aligned for any dtype and for DMA
_DEVICE_PROGRAMS = 256  # the slot-to-buffer copy reads device memory: more programs than PCIe needs


class ExpertLayerRing:
    """``buffers`` device slots, each the routed experts of one layer, filled in the order of
    ``hosts`` (per chosen layer: parameter name → tensor [experts, ...], all layers of one
    layout) from host memory, on ``stream`` (None on the CPU: copies in line), and from the
    slots of ``caches`` (per chosen layer, its ``ExpertCache`` over the same host tensors;
    None: host memory only; a None entry: that position has none), the carried positions'
    slots lent to the next one when ``lend_slots``, the first ``buffers`` positions held in
    their buffers between large steps for small steps to read when ``hold``. See Note [Expert
    layer ring], Note [Ring fills from the slots], Note [Ring lends the carried layers' slots]
    and Note [Small steps read the held layers]."""

    def __init__(self, hosts: Sequence[Mapping[str, torch.Tensor]], buffers: int,
                 device: torch.device | str, stream: torch.cuda.Stream | None = None,
                 poison_reads: bool = False, caches: Sequence | None = None,
                 lend_slots: bool = False, hold: bool = False) -> None:
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
        if hold and buffers >= len(hosts):
            raise ConfigError(f"a ring that holds its first {buffers} layers for small steps "
                              f"needs more layers than buffers, got {len(hosts)}: keep those "
                              f"layers resident instead (no experts section for them)")
        if hold and lend_slots:
            raise ConfigError("lend_slots lends the carried layers' slots; with "
                              "decode_from_ring those layers have none: choose one")
        if caches is not None:
            caches = list(caches)
            if len(caches) != len(hosts) or any(
                    c is not None and (set(c.host) != set(h)
                                       or any(c.host[n] is not h[n] for n in h))
                    for c, h in zip(caches, hosts)):
                raise ConfigError("an expert layer ring's caches are the chosen layers' own, "
                                  "one per layer (None: none), over the ring's host tensors")
            if all(c is None for c in caches):
                caches = None
        self.hosts = [dict(h) for h in hosts]
        self.caches = caches
        self.device = torch.empty(0, device=device).device
        if (stream is None) != (self.device.type != "cuda"):
            raise ConfigError("an expert layer ring on a GPU needs a copy stream, and on the "
                              "CPU none")
        self.stream = stream
        offsets, end = {}, 0
        for name, shape, dtype in layout:
            offsets[name] = end
            end += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.layer_bytes = end
        buffers = min(buffers, len(hosts))  # more than the layers would carry one into itself
        #: positions 0..held-1 live in buffers 0..held-1 between large steps (Note [Small
        #: steps read the held layers])
        self.held = buffers if hold else 0
        self.pool = SlotPool(LANE, (end,), torch.uint8, depth=buffers - 1,
                             workspace_bytes=buffers * end, device=self.device)
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
        # held buffers' ready events are waited on inside captured small steps: external
        # ones, so a graph holds a wait on the event's latest record, not an edge
        self._ready = [torch.cuda.Event(external=hold) if cuda else None
                       for _ in range(self.pool.slots)]
        self._retire = [torch.cuda.Event() if cuda else None for _ in range(self.pool.slots)]
        #: per slot, whether a read since its last fill must be waited for before the next
        #: fill (False: never read, or ordered by stream order after an abandon)
        self._retired: list[bool] = [False] * self.pool.slots
        self._next = 0  # the next position to fill: >= len(hosts) is the next step's
        self._reading = None  # (position, lease) of the layer computing now
        self.steps = 0  # large steps served
        self.carried_steps = 0  # of which started with their first layer filled ahead
        self.fills = 0
        self.rows_from_slots = 0  # experts filled from a slot cache (Note [Ring fills from the slots])
        self.rows_from_host = 0
        self.rows_staged = 0  # experts staged in lent slots (Note [Ring lends the carried ...])
        self.rows_from_lent = 0  # of which a fill took from there
        self.lend_slots = lend_slots and caches is not None
        #: the staged experts: (the step that staged them, target position, [(lending
        #: position, slot, expert)], each lender's cache generation after its lend), or None
        self._stage: tuple[int, int, list[tuple[int, int, int]], dict[int, int]] | None = None
        #: this step's slot tables (Note [Ring fills from the slots]): per position the slots
        #: holding an expert first, their experts, how many; the host's view read at first use
        self._held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        if caches is not None:
            pinned = cuda and torch.cuda.is_available()
            width = max(c.slots for c in caches if c is not None)
            self._held_copy = torch.full((len(caches), width), -1, dtype=torch.int64,
                                         pin_memory=pinned)
            self._held_event = torch.cuda.Event() if cuda else None
        #: the host's view of the slot tables (slot -> expert or -1), read at first use
        self._tables: list[list[int]] | None = None
        #: a list to append each operation to (ExpertOp, Note [Expert lane hazards]), or None
        self.trace: list[ExpertOp] | None = None
        self.held_reads = 0  # small steps' reads of held layers, issued (replays not counted)
        self.recarried = 0  # times the held layers were carried again outside a step's tail
        if self.held:  # the held layers' first fills: after the poison above, before any
            self._copy_after_compute()  # step reads them
            self._fill_ahead()

    @staticmethod
    def _describe(host: Mapping[str, torch.Tensor]) -> str:
        return ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in host.items())

    @property
    def _experts(self) -> int:
        return next(iter(self.hosts[0].values())).shape[0]

    @property
    def layers(self) -> int:
        return len(self.hosts)

    @property
    def buffers(self) -> int:
        return self.pool.slots

    @property
    def bytes(self) -> int:
        return self.pool.reserved_bytes

    def begin(self, position: int) -> tuple[dict[str, torch.Tensor], None]:
        """Layer ``position`` of a large step is about to compute on the current stream: order
        it after its fill (issued now if it was not) and return its weights, every expert at
        its own index (no expert map)."""
        if not 0 <= position < self.layers:
            raise KernelError(f"the expert layer ring holds positions 0..{self.layers - 1}, "
                              f"not {position}")
        if self._reading is not None:  # the layer before raised: its read never ended
            self.abandon()
        if position == 0:
            self.steps += 1
            if (LANE, 0) in self.pool.carried:
                self.carried_steps += 1
        restart = self._head() != position
        if restart:
            self.abandon()  # not the position the fills ran ahead for: start over from here
            self._next = position
        if position == 0 or restart:  # a step starts: read what the slots hold now
            self._read_slot_tables()
            if self.held:  # its fills rewrite held buffers small steps read
                self._copy_after_compute()
        self._fill_ahead()
        lease = self.pool.carried.pop((LANE, position))
        compute = self._current()
        if compute is not None:
            compute.wait_event(lease.ready_event)
        self._op("wait", "compute", on=("ready", lease.slot))
        lease.begin_read()
        self._reading = (position, lease)
        self._op("read", "compute", pairs=((position, lease.slot),))
        return self.views[lease.slot], None

    def starting(self, position: int) -> bool:
        """Whether ``begin(position)`` starts a step (reads the slot tables: the caller joins
        any side stream still installing into the slots first)."""
        return position == 0 or self._reading is not None or self._head() != position

    def prepare(self) -> bool:
        """A large step is about to run: nothing to start early (the arena's differs, Note
        [Large steps start early]); small steps never write the ring's buffers, so the
        carried ones need no top-up. Returns False."""
        return False

    def drop_prepared(self) -> bool:
        """Nothing was prepared (``prepare``). Returns False."""
        return False

    def before_small(self, position: int) -> None:
        """A small step of cached layer ``position`` is next: the ring's buffers are not its
        slots, nothing to order (the arena's differs, Note [Large steps stream through the
        slots])."""

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
        if position == self.layers - 1 and self.lend_slots:
            self._stage_next()

    def forget(self) -> None:
        """The host copies changed: nothing filled or carried is current. The next fills' host
        copies run on the copy stream after the ones forgotten; their slot copies, on the
        compute stream, wait for each buffer's last ready event (Note [Ring fills from the
        slots])."""
        self._stage = None  # the caches forgot too: a -1 entry no longer means untouched
        if self.held:
            self.carry_held()
        else:
            self._start_over()

    def read_held(self, position: int) -> dict[str, torch.Tensor]:
        """A small step's read of held position ``position`` (Note [Small steps read the held
        layers]): order the current stream after its fill and return its buffer's weights,
        the same buffer at every call."""
        if not 0 <= position < self.held:
            raise KernelError(f"the expert layer ring holds positions 0..{self.held - 1} for "
                              f"small steps, not {position}")
        lease = self.pool.carried.get((LANE, position))
        if lease is None or self._reading is not None:  # a large step stopped half-way
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise KernelError(f"held layer position {position} is not in its buffer (a "
                                  f"large step stopped half-way) while a CUDA graph is being "
                                  f"captured; run one step eagerly first")
            self.carry_held()
            lease = self.pool.carried[(LANE, position)]
        compute = self._current()
        if compute is not None:
            compute.wait_event(lease.ready_event)
        self._op("wait", "compute", on=("ready", lease.slot))
        self._op("read", "compute", pairs=((position, lease.slot),))
        self.held_reads += 1
        return self.views[lease.slot]

    def carry_held(self) -> None:
        """Fill the held positions again now, from host memory, after every read issued so
        far (a forget, or a large step that stopped half-way: a replayed small step runs no
        Python to notice)."""
        self._start_over()
        self._copy_after_compute()
        self._fill_ahead()
        self.recarried += 1

    def _start_over(self) -> None:
        """Nothing filled ahead, nothing read: the next fill is position 0's, and the slot
        tables are read again."""
        self.abandon()
        self._next = 0
        self._held = self._tables = None

    def _copy_after_compute(self) -> None:
        """Order the copy stream's next fills after everything issued on the compute stream:
        a small step's reads of a held buffer record no retire event."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._op("wait", "copy", on="compute")

    def _read_slot_tables(self) -> None:
        """Step 1 of Note [Ring fills from the slots], issued on the compute stream."""
        self._held = self._tables = None
        if self.caches is None:
            return
        held = []
        for p, cache in enumerate(self.caches):
            if cache is None:  # a held position (Note [Small steps read the held layers])
                held.append(None)
                continue
            table = cache.expert_in[:cache.slots]
            slots = torch.argsort((table < 0).to(torch.int8), stable=True)  # held ones first
            held.append((slots, table[slots], (table >= 0).sum().reshape(1)))
            self._held_copy[p, :cache.slots].copy_(table, non_blocking=True)
        if self._held_event is not None:
            self._held_event.record(self._current())
        self._held = held

    def _held_experts(self, position: int) -> list[int]:
        """The experts position's cache holds this step (the host's view, read once a step)."""
        if self._held is None or self._held[position] is None:
            return []
        if self._tables is None:
            if self._held_event is not None:
                self._held_event.synchronize()
            self._tables = self._held_copy.tolist()
        return [e for e in self._tables[position] if e >= 0]

    def _stage_next(self) -> None:
        """Steps 1 and 2 of Note [Ring lends the carried layers' slots], in a large step's
        tail after its fills ahead, on the compute stream."""
        self._stage = None
        target = self._next  # the next step's first position not carried
        if self._held is None or not 0 < target < self.layers or self.pool.free_count:
            return
        lenders = [p for p in range(target) if (LANE, p) in self.pool.carried]
        held = set(self._held_experts(target))
        wanted = iter(e for e in range(self._experts) if e not in held)
        staged = [(p, slot, e) for p in lenders for slot, e in
                  zip(range(self.caches[p].slots), wanted)]
        if not staged:
            return
        for p in lenders:
            self.caches[p].lend()
        host, compute = self.hosts[target], self._current()
        for p, slot, e, n in _pair_runs(staged):
            self._op("lend", "compute", space=p, pairs=((e + k, slot + k) for k in range(n)))
            for name, dst in self.caches[p].weights.items():
                _copy_rows(dst, slot, host[name], e, n, compute)
        self.rows_staged += len(staged)
        self._stage = (self.steps, target, staged,
                       {p: self.caches[p].generation for p in lenders})

    def _staged(self, position: int, held: Sequence[int]) -> list[tuple[int, int, int]]:
        """Step 3 of Note [Ring lends the carried layers' slots]: the staged experts of
        ``position`` whose lent slot nothing wrote since (its table entry, read at this step's
        start, still -1) and that its own slots do not hold; the stage is used once."""
        if self._stage is None or self._stage[1] != position or self._stage[0] >= self.steps:
            return []
        _, _, staged, generations = self._stage
        self._stage = None
        # a lender that forgot (or lent again) since: its -1 entries say nothing
        staged = [row for row in staged
                  if self.caches[row[0]].generation == generations[row[0]]]
        self._held_experts(position)  # the tables' host view
        if self._tables is None:
            return []
        mine = set(held)
        return [(p, slot, e) for p, slot, e in staged
                if self._tables[p][slot] == -1 and e not in mine]

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

    def _fill_ahead(self) -> None:
        """Fill positions from ``_next`` into free slots, up to the next step's last."""
        while self.pool.free_count and self._next < 2 * self.layers:
            position = self._next % self.layers
            if position == 0 and self._next and (LANE, 0) in self.pool.carried:
                break  # never two fills of one position at once
            if position < self.held:  # its own buffer, whose address a graph may hold
                if not self.pool.is_free(position):
                    break
                lease = self.pool.acquire(position, tag=position)
            else:
                lease = self.pool.acquire(tag=position)
            try:
                self._fill(position, lease)
            except BaseException:
                self._give_back(lease)
                raise
            self.pool.carried[(LANE, position)] = lease
            self._next += 1

    def _give_back(self, lease) -> None:
        """A fill raised half-issued: its slot returns to the pool, and whatever of it reached
        a stream is ordered before the slot's next writer (both streams after the copy)."""
        if lease.state is LeaseState.WRITING:
            lease.mark_ready(None)
        lease.begin_read()
        lease.retire(None)
        lease.release()
        compute = self._current()
        if compute is not None:  # each stream after what the other issued of the fill
            compute.wait_stream(self.stream)
            self.stream.wait_stream(compute)
        self._retired[lease.slot] = False  # ordered by the stream waits: no event to wait for

    def _fill(self, position: int, lease) -> None:
        views, host, slot = self.views[lease.slot], self.hosts[position], lease.slot
        held = self._held_experts(position)
        staged = self._staged(position, held)
        compute = self._current()
        if held or staged:  # Note [Ring fills from the slots], step 2: on the compute stream
            if compute is not None:  # a fill of this buffer never read may still be copying
                compute.wait_event(self._ready[slot])
            self._op("wait", "compute", on=("ready", slot))
            cache, (slots, experts, count) = self.caches[position], self._held[position]
            if held:
                self._op("take", "compute", space=position, pairs=(
                    (e, s) for s, e in enumerate(self._tables[position]) if e >= 0))
            for p, first, e, n in _pair_runs(staged):
                self._op("take", "compute", space=p, pairs=(
                    (e + k, first + k) for k in range(n)))
            for name, v in views.items():
                if held:
                    fetch_experts(cache.weights[name], v, slots, experts, count,
                                  programs=_DEVICE_PROGRAMS)
                for p, first, e, n in _pair_runs(staged):  # lent slots: device to device
                    v[e:e + n].copy_(self.caches[p].weights[name][first:first + n])
            self._op("fill", "compute", pairs=((position, slot),))
            if compute is not None:
                self._retire[slot].record(compute)
            self._op("record", "compute", on=("retired", slot))
            self._retired[slot] = True
        retired = self._retired[slot]
        if retired:
            self._op("wait", "copy", on=("retired", slot))
        self._op("fill", "copy", pairs=((position, slot),))
        self._op("record", "copy", on=("ready", slot))
        self.fills += 1
        taken = [*held, *(e for _, _, e in staged)]
        runs = _runs(taken, self._experts)
        self.rows_from_slots += len(held)
        self.rows_from_lent += len(staged)
        self.rows_from_host += self._experts - len(taken)
        if self.stream is None:  # the CPU: in line, in issue order
            for name, v in views.items():
                for start, n in runs:
                    _copy_rows(v, start, host[name], start, n, None)
            lease.mark_ready(None)
            return
        ready = self._ready[slot]
        if retired:
            self.stream.wait_event(self._retire[slot])  # its last reader (and slot rows) done
        for name, v in views.items():
            for start, n in runs:
                _copy_rows(v, start, host[name], start, n, self.stream)
        ready.record(self.stream)
        lease.mark_ready(ready)

    def _current(self) -> torch.cuda.Stream | None:
        return None if self.stream is None else torch.cuda.current_stream(self.device)

    def _op(self, kind: str, stream: str, pairs: tuple = (), on: object = None,
            space: object = None) -> None:
        """Trace one operation on the ring's logical streams, ``copy`` and ``compute`` (the
        same on the CPU, where both run in line: the proof checks what a GPU would order);
        ``space``: the position whose cache slots it touches (Note [Expert lane hazards])."""
        if self.trace is not None:
            self.trace.append(ExpertOp(kind, stream, tuple(pairs), on, space))

    def describe(self) -> dict:
        return {"layers": self.layers, "buffers": self.buffers, "layer_bytes": self.layer_bytes,
                "steps": self.steps, "carried_steps": self.carried_steps, "fills": self.fills,
                "rows_from_slots": self.rows_from_slots, "rows_from_host": self.rows_from_host,
                "lend_slots": self.lend_slots, "rows_staged": self.rows_staged,
                "rows_from_lent": self.rows_from_lent, "held": self.held,
                "held_reads": self.held_reads, "recarried": self.recarried}


def _runs(held: Sequence[int], experts: int) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive experts in 0..experts-1 not in ``held``."""
    skip, runs, start = set(held), [], None
    for e in range(experts + 1):
        if e < experts and e not in skip:
            start = e if start is None else start
        elif start is not None:
            runs.append((start, e - start))
            start = None
    return runs


def _copy_rows(dst: torch.Tensor, at: int, src: torch.Tensor, start: int, n: int,
               stream: torch.cuda.Stream | None) -> None:
    """Rows ``start..start+n`` of ``src`` into rows ``at..at+n`` of ``dst``: by a copy engine
    (DMA, not the SMs) on ``stream``, or in line where there is none (the CPU)."""
    if stream is None:
        dst[at:at + n].copy_(src[start:start + n])
        return
    row = dst[0].numel() * dst.element_size()
    copy_async(dst.data_ptr() + at * row, src.data_ptr() + start * row, n * row,
               stream.cuda_stream)


def _pair_runs(staged: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(position, first slot, first expert, count) of each run of ``staged`` (position, slot,
    expert) triples whose slots and experts both go up by one in one position's slots."""
    runs: list[list[int]] = []
    for p, slot, e in staged:
        if runs and runs[-1][0] == p and runs[-1][1] + runs[-1][3] == slot \
                and runs[-1][2] + runs[-1][3] == e:
            runs[-1][3] += 1
        else:
            runs.append([p, slot, e, 1])
    return [tuple(r) for r in runs]
