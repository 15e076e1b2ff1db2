"""ExpertArena: the slot caches' memory, one arena of expert rows, as the large steps' layer
buffers (``experts.layer_buffers: slots``).

Note [Large steps stream through the slots]
    Back to back large steps (a long prompt in chunks) are copy-bound: each copies whatever
    of every chosen layer the device does not hold. With a ring of layer buffers beside the
    slots (Note [Expert layer ring]) the device holds, between two such steps, the carried
    buffers and the slots; at the H100 bench's memory (4 layers: a ring of two and a quarter
    of each layer in slots) that left 3.6 GB to copy per chunk, where vLLM's prefetch
    offloader, given the same memory as two resident layers and one buffer, copies 2.4 GB.
    Holding layers in the ring's buffers (Note [Small steps read the held layers]) does not
    help there: the large step's other layers pass through the held buffers, which are then
    carried again.

    The cheaper layout is the offloader's: leave the first layers resident (not chosen) and
    stream the chosen ones through one region. The slots are that region: a large step does
    not need what the slots cache for decode, it needs each layer whole. So the chosen
    layers' slots are one allocation per parameter (the arena, ``sum(slots)`` rows, each
    cache's slots a run of its rows), and a large step computes each chosen layer from rows
    of the arena through an expert map (expert -> row, ``experts`` of them, anywhere in the
    arena): vLLM's kernel over the whole arena with the map is the resident call (Note [Same
    bits as resident]: the map sorts the rows by expert as the resident call does, and the
    tiles are the resident layer's whatever the arena's row count). A layer's rows follow
    the ring buffer's lifecycle (Note [Lease lifecycle]): a fill waits for its rows' last
    readers (their positions' retire events), copies on the copy stream, records the
    position's ready event; the layer waits for it, computes, records its retire event;
    its rows are then free for the next fill, and past the step's last layer the next step's
    first is filled (carried). Per step, in order:

    1. **Start** (the step's first layer): the copy stream waits for the compute stream (the
       small steps since the last large one read and installed rows there, and record no
       event a replay could not), and the caches' slot tables are read to the host (one
       sync, as the ring does).
    2. **Fill** position ``p``: rows that already hold one of ``p``'s experts stay where they
       are (``p``'s own cache entries, or rows a fill wrote earlier that nothing rewrote
       since); ``p``'s other experts are copied from host memory into other rows not held
       by a fill or read in flight, in runs of consecutive experts and rows (DMA). Which
       rows (``_spare_rank``), in this order, and within each class ``p``'s own rows first
       (one copied there is entered in its table, ``ExpertCache.adopt``: the small steps
       after find it):

       a. empty rows;
       b. rows a fill wrote for another layer that the layer before ``p`` does not read,
          those whose layer the steps ahead need last first; then a whole first layer's own
          rows that the layer before does not read (it ran, and the tail gives them back;
          as own entries, only when no read is pending, as in c, or when every row a read
          in flight or pending holds is its owner's own entry: none would rank before them
          once freed. With layers 0 and 1 whole, layer 2's fill is so issued right after
          layer 0's read, not after layer 1's: an H100's torch.profiler trace of vLLM's lone
          8k prompt at 8 layers (``7623a46``) had the host issue the first layers slower
          than the GPU ran them, and the copy engine's first copy started 18.3 ms into the
          step, 5 ms after layer 0 retired, where the prefetch offloader's started at 7.3;
          at ``bd1fef9``, with the host's cuts of Note [Arena timeline], 7.2 against 5.6
          and the prompt 0.99x the offloader's);
          then the rows a fill wrote that the layer before reads (a copy into one waits for
          that layer's compute). At 8 layers this lets each half layer's fill copy while the
          layer before computes: modeled 0.97x the prefetch offloader's lone step, where
          every fill waited for the layer before (0.90x); on an H100 0.80x in one round,
          until the arena's small tables stopped queueing behind its copies (0.96x, below);
          the 4-layer layouts' traces do not change;
       c. other layers' own cached experts: those of the layers that already ran in this
          step, the earliest first (the next step's first layer gets its rows back in this
          step's tail, a later one only between the next step's layers: taking the layer
          that ran last, as the rank did until December 2026, left a whole layer between two
          half ones to copy its rows back on the step's path after a prompt that ended at
          its first token, modeled 34.0 ms against 27.4 for the 4-layer lone step, Note
          [Arena timeline]); then the layers still ahead, the one needed last first. These
          only when no read is in flight or pending: until the layer before ``p`` retires,
          its rows may free up for ``p`` (a whole layer's, once it ran, rather than a half
          layer's cache that the step still needs), and a fill that cannot take enough
          waits for that.

       A row written for ``p`` leaves its owner's slot table (``ExpertCache.drop``), and the
       arena records what it wrote there: the record counts only while that table entry
       stays empty within the owner's generation (an install sets it; a forget or lend
       counts a generation). The fill copies the rows no read holds first, then each
       reader's rows after that reader's retire event, the oldest reader first: the copy
       engine does not wait for the layer before to copy what that layer does not read
       (Note [Arena timeline] in tools/arena_timeline.py: at the bench's 4 layers, whole
       layers beside half ones, a lone large step 27.4 ms where every copy of a fill waited
       for all its readers took 30.9, chunks 35.1 against 38.7, modeled; exact on an H100,
       its bench below). That lone step followed the first large step from empty slots, a
       transient; from a steady state both orders replay 27.4 ms at 4 layers, and at the
       bench's 8 layers this order gives 94.2 ms against 101.4.
    3. **Carried** fills (issued in a step's tail) are topped up at the next start: what the
       small steps in between installed over is copied again, nothing else.
    4. **Small steps** of a chosen layer wait for every position's ready event before they
       read or install (a carried fill may still be writing, into this layer's rows or the
       next one's, where its lookahead installs): external events, so a captured step holds
       a wait on their latest record (as a held buffer's, Note [Small steps read the held
       layers]); each is recorded once when the arena is made, so that a step captured
       before any fill holds that wait too. An eager small step makes the next large step
       start afresh (step 1) wherever it begins; a replayed one runs no Python, so a large
       step cut short must be followed by one from its first layer, as vLLM's are.

    What stays true: every write to a row (a fill's copy, a small step's install) is ordered
    after every earlier read and write of it, by the start's stream wait, a retire event or a
    ready event (a retire event re-recorded since a row's last read was recorded later on
    the same stream: waiting on it orders after that read too); a layer reads a row only
    after the write of what its map names there. The trace (``place`` on the copy stream,
    ``read`` on the compute stream, both naming the position they serve in ``on`` and the
    cache whose rows they touch in ``space``) is proven with the caches' own operations by
    ``check_lane`` (Note [Expert lane hazards]).

    One layout for decode, lone prompts and chunks: slots per layer (``experts.slots`` as a
    mapping) where some layers keep every expert, e.g. at the bench's 4 layers ``{0: 128,
    1: 64, 2: 128, 3: 64}`` (384 rows, the memory of two resident layers and two with 64
    slots). Decode computes the whole layers from their slots as resident layers (every
    choice hits, one pass). A lone large step copies layer 1's 64 missing experts into layer
    0's rows once layer 0 ran, and layer 3's into the same rows once layer 1 ran (a fill's
    rows, before any cache's own); its tail copies layer 0's 64 back (a carried fill of the
    next step's first position), so decode after it finds layer 0 whole. Per step: 128 on
    the step's path, what the device cannot hold (the prefetch offloader, with the same
    memory, copies its one offloaded layer that is not prefetched, 128), and 64 in the tail;
    back to back 192 per chunk (the prefetch offloader: 256). Counted on the CPU
    (tests/unit/test_expert_arena.py). Equal slots with no whole layer keep their old counts:
    two layers of 64 copy 64 + 128 per lone step and 256 per chunk; layers whose rows hold
    half of every layer copy fewer than every layer whole back to back (the fixed windows of
    consecutive rows this arena used until December 2026 copied every layer whole).
    Measured on an H100 (vLLM 0.26, the bench's 4 layers, that layout with ``early_start``
    and the plan kernel, five interleaved rounds against vLLM's offloaders with the same
    device memory; ``profiles/results/experts-bench-4l-whole-prefetch-uva-h100.json``): a
    lone 8k prompt 1.01x the prefetch offloader (level within the rounds' spread), 32k in 8k
    chunks 1.32x, batch-1 decode 14.1x the prefetch offloader and 0.92x the UVA offloader;
    198 experts copied per large step over 56, as counted; bit for bit all-resident vLLM in
    eager and FULL_AND_PIECEWISE (``arena-whole-13``). With both rules of step 2 (the fills'
    order and the earliest layer's rows, tree ``1e011cf``), each prompt after the same
    16-token decode, five rounds on an H100 (``experts-bench-4l-rank-prefetch-h100.json``):
    8k 1.03x the prefetch offloader (ranges overlap), 32k 1.32x; per-tensor fp8 1.08x and
    1.20x (``experts-bench-4l-rank-fp8tensor-h100.json``).

    At 8 layers (the same memory as 4 resident layers: layers 0 and 4 whole, the others 42
    slots), measured on an H100 at ``7cc1b8b`` (``experts-bench-8l-whole-prefetch-h100.json``,
    four rounds): a lone 8k prompt 0.89x vLLM's prefetch offloader, 32k in chunks 1.34x. The
    lone step copies what the device cannot hold (516 experts before its last layer), as many as
    the offloader copies inside its step; but every half layer's fill went into rows that the
    layer before it reads, so each waited for that layer's compute and the copy engine idled
    through six of them, where the offloader's four buffers keep it busy. Replaying the arena's
    trace (Note [Arena timeline]) gave 0.90x for that, and the layouts tried with the same
    memory (whole layers 0 and 1, one whole layer, none whole) no better. Since the fills take
    the whole first layer's other rows before those the layer before reads (step 2), the replay
    gives 0.97x (whole layers 0 and 1: 1.0x) and chunks 1.42x; each lone step copies 42 more
    experts, in its tail (644 in all). On the H100 at ``0b7744e``
    (``experts-bench-8l-rank2-prefetch-h100.json``, one round: the engines' start-up spent the
    bench's deadline) the lone 8k prompt took 125 ms, 0.80x the offloader's 100 (whole layers 0
    and 1: 0.78x), 32k 1.29x: inside the spread of ``7cc1b8b``'s four rounds (111-129 ms), so
    the rank's gain is not shown, and the replay (94 ms) misses 31 ms of the GPU's step where it
    misses 9 of the offloader's. The lane alone on the GPU (``tools/arena_timeline.py --gpu``,
    no vLLM) showed where: its step's small table writes (the tail's maps, drops and adoptions)
    went through a copy engine and waited there behind the copy stream's queued experts, holding
    the compute stream 19 ms past its last layer (Note [Small writes beside bulk copies],
    integrations/torch/expert_cache.py). Written by a kernel since (tree ``dbb748f``, five
    rounds, ``experts-bench-8l-kernelints-prefetch-h100.json``): the lone 8k prompt 79,770
    [79,609-79,947] tok/s, **0.96x** the offloader's 82,778 [82,072-83,241] (was 0.80x), 32k
    1.40x; the tail's copies moved to the next token (32 ms after the prompt, was 9): prompt and
    next token together take what they took. Held layers (``ringflow-held``, a ring of two layer
    buffers beside 32 slots per layer) took 102 ms there at ``3d9c6a3`` (0.97x, three rounds),
    copy-bound, at the cost of an 82 ms second token.

    Cost and gain: a large step copies each chosen layer's experts that the arena does not
    hold where it can keep them. When a layer's copy must wait for the layer before it to
    retire, the copy engine idles for that layer's compute. Small steps after a large one
    find the rows it borrowed gone from their caches until a carried fill brings them back.

    Measured with the fixed windows (before the expert maps over the whole arena), once on an
    H100 (vLLM 0.26, the bench's 4 layers, layers 0 and 1 chosen with 64 slots each;
    ``profiles/results/experts-bench-arena-held-h100.json``): 32k prompts in 8k chunks 1.20x the
    held-layer ring at the same memory, the first decode step after a prompt 16 ms where the
    held ring waits 78; a lone 8k prompt 0.69x, because vLLM's offloader puts the chosen layers
    first, so the first layer's copies have nothing before them to hide behind. Since ringflow
    places the chosen layers' experts itself (Note [Ringflow places the chosen experts]), the
    resident layers sit between them: layers 1 and 3 chosen, five interleaved rounds on an H100
    against vLLM's prefetch offloader in the same run
    (``experts-bench-4l-held-arena-prefetch-h100.json``): a lone 8k prompt 0.79x (was 0.71x with
    layers 0 and 1), 32k in chunks 1.01x, batch-1 decode 16.7x.

    Where a lone 8k prompt's time goes, traced on that H100 (``experts_bench.py --trace``,
    ``profiles/results/experts-trace-arena-8k-h100.json``): 48.5 ms wall, kernels 12.5 ms,
    3.02 GB copied at 55.4 GB/s in the GPU's 64 ms window (the step and its tail), 49.7 ms
    of it with no kernel beside it, 2 ms idle. Copy-bound, not host-bound. On its critical
    path: the start's top-up of layer 1 (decode left half of it, 64 experts, 11 ms) and layer
    3's fill (128, 22 ms) once layer 1 retires; the tail's 128 for the next step run after
    the token is out. The prefetch offloader's buffer ends decode holding layer 1 whole (its
    decode copies both layers every step, 21 tok/s), so its critical path holds layer 3's
    copy only: 11 ms of 48 less, 0.77x, as measured (0.79x). The bytes that count are those
    before the step's last chosen layer, not the step's total: over the five-round run's 56
    large steps the window's counters (``experts-bench-4l-held-arena-prefetch-h100.json``)
    average 119 rows in place and 265 copied per step, 3% over the offloader's 256.

    The top-up starts late, too: 6.4 ms into the window, after layer 0 and layer 1's router,
    as ``begin`` is first reached at the first chosen layer's MoE; the copy engine idles
    until then, and no kernel runs during the top-up's 11 ms. Hence the early start below.

Note [Large steps start early]
    ``prepare`` runs step 1 of Note [Large steps stream through the slots] (the copy stream's
    wait, the tables, the carried fills' top-up, the fills ahead) before the step's forward
    is issued: in vLLM, at the model runner's ``execute_model``, from the step's scheduled
    token count (``experts.early_start``). The top-up then copies while the host prepares
    the step's inputs and the layers before the first chosen one compute, where ``begin(0)``
    would have issued it at the first chosen layer's MoE; the table read's host sync then
    waits for the previous step, not for this step's first layers. ``begin(0)`` goes on from
    there. What a prepare issued stays correct whatever follows it: a small step instead
    (``before_small``) waits for the positions' fills and makes the next large step start
    afresh, as after a tail's carried fill; a forward that starts at another position
    restarts there; a second prepare tops up again; a step that runs no first layer's
    ``begin`` at all (vLLM replays it from a CUDA graph: ``layer_tokens`` at or below its
    largest captured size; or runs no forward) is dropped after ``execute_model``
    (``drop_prepared``), so the next large step starts afresh, and one line says so once.
    The order it relies on: everything that read or wrote the rows before it was issued on
    the stream current at the prepare, which the step's layers must run on too (``begin``
    refuses another). The report counts prepares (``early_starts``), those a first layer
    went on from (``early_used``) and those dropped (``early_dropped``: unused after
    ``execute_model``, replaced by another prepare or start, or followed by a small step);
    all but the latest are one or the other. What it should gain, by the trace above: up to
    the 6.4 ms the copy engine idled at a lone 8k prompt's start. Measured on an H100 (three
    interleaved rounds, ``experts-bench-4l-arena-early-prefetch-h100.json``): a lone 8k
    prompt 184,446 [183,662-186,574] tok/s against 176,956 [176,294-178,117] without it
    (1.04x, about 1.9 ms of the step), 0.81x the prefetch offloader (0.78x without); 32k in
    chunks 1.07x the prefetch offloader (1.05x without); every one of 35 large steps went on
    from its prepare. Its cost: the table read's host sync moves to before vLLM prepares the
    step, so under async scheduling the host's input preparation no longer overlaps the
    previous step's end.

    Slots per layer (``experts.slots: {1: 120, 3: 8}``, the same rows) were built to cut the
    top-up: layer 1 ends decode nearly whole, so the critical path would hold about 8 + 128
    experts, about 39 ms (the traced 48.5 less 11 ms of top-up plus 1.4). Measured on that
    H100 (five rounds, ``experts-bench-4l-arena-skewed-prefetch-h100.json``) a lone 8k prompt
    took 60 ms, 0.60x the prefetch offloader, 32k 0.96x; the second call (the same prompt and
    one decode step) took no longer than the first, so the first waited about 21 ms, about a
    layer's copy, for a reason not found (the arena's own logic, replayed on the CPU with
    those slots, copies 1 + 12 + 12 of 12-expert layers at such a step, as designed). That
    layout was dropped (2939c4b..3d9c6a3 in the history; a trace of it would say where those
    21 ms went); the mapping came back for whole layers over expert maps (Note [Large steps
    stream through the slots]), which measured at the prefetch offloader's level there.

    Why neither the fixed windows nor held layers served both prompt shapes, in rows at the
    bench's memory (384): a lone large step needs all 512 of the four layers' experts, so at
    least 128 cross the host link. Held layers copy exactly those, but then carry both held
    layers again in the tail: 384 per chunk. A window of 128 consecutive rows copied 256 per
    chunk, but 192 per lone step (the first layer's top-up overwrote the other layer's
    slots). Expert maps over the whole arena with whole layers among its caches copy 128 and
    192 (Note [Large steps stream through the slots]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ringflow.cudart import copy_async
from ringflow.errors import ConfigError, KernelError
from ringflow.graphs.slots import poison
from ringflow.integrations.torch.expert_cache import ExpertCache, device_ints
from ringflow.orchestrator.expert_hazards import ExpertOp


def arena_rows(host: Mapping[str, torch.Tensor], slots: Sequence[int],
               device: torch.device | str) -> tuple[dict[str, torch.Tensor],
                                                    list[dict[str, torch.Tensor]]]:
    """One tensor per parameter of ``host`` (one layer's host store, [experts, ...]) with
    ``sum(slots)`` rows, allocated once here, and each layer's run of them (``ExpertCache``'s
    ``rows``), in order."""
    total = sum(slots)
    rows = {name: torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=device)
            for name, t in host.items()}
    views, at = [], 0
    for n in slots:
        views.append({name: r[at:at + n] for name, r in rows.items()})
        at += n
    return rows, views


class ExpertArena:
    """Large steps of the chosen layers ``caches`` (in order: position 0, 1, ...; each over
    its run of ``rows``, from ``arena_rows``) computed from rows of the arena, filled from
    the caches' host stores on ``stream`` (None on the CPU: copies in line); with
    ``poison_reads``, the rows a fill copied are poisoned after their layer read them. See
    Note [Large steps stream through the slots]."""

    held = 0  # holds no layer between large steps (the layer ring's decode_from_ring)

    def __init__(self, caches: Sequence[ExpertCache], rows: Mapping[str, torch.Tensor],
                 stream: torch.cuda.Stream | None = None, poison_reads: bool = False) -> None:
        caches = list(caches)
        if not caches:
            raise ConfigError("an expert arena needs at least one cached layer")
        self.caches, self.rows = caches, dict(rows)
        #: one row's bytes per parameter, for the fills' copies (a view per run to measure it
        #: cost the host a torch op per run and parameter: 1 ms a fill in a profiled trace)
        self._row_bytes = {name: math.prod(dst.shape[1:]) * dst.element_size()
                           for name, dst in self.rows.items()}
        self.experts = caches[0].experts
        self.device = caches[0].device
        self._owner: list[tuple[int, int]] = []  # arena row -> (position, slot)
        self._first_row: list[int] = []  # position -> its first row
        for q, cache in enumerate(caches):
            start = len(self._owner)
            self._first_row.append(start)
            if cache.experts != self.experts or set(cache.weights) != set(self.rows) or any(
                    cache.weights[n].data_ptr() != self.rows[n][start:].data_ptr()
                    or cache.weights[n].shape[1:] != self.rows[n].shape[1:]
                    or cache.weights[n].dtype != self.rows[n].dtype for n in self.rows):
                raise ConfigError(f"an expert arena's caches are its rows in order (arena_rows):"
                                  f" position {q}'s slots are not rows {start}.. of the arena")
            self._owner += [(q, s) for s in range(cache.slots)]
        total = next(iter(self.rows.values())).shape[0]
        if len(self._owner) != total:
            raise ConfigError(f"the arena has {total} rows, its caches' slots {len(self._owner)}")
        self.windows = total // self.experts  # layers' worth of rows (a large step needs one)
        if self.windows < 1:
            raise ConfigError(
                f"experts.layer_buffers: slots streams each layer through its slots' memory, "
                f"but the {len(caches)} layers' slots hold {total} experts, fewer than one "
                f"layer's {self.experts}: give them at least {-(-self.experts // len(caches))} "
                f"slots each, or set layer_buffers to a number of layer buffers")
        if (stream is None) != (self.device.type != "cuda"):
            raise ConfigError("an expert arena on a GPU needs a copy stream, and on the CPU none")
        self.stream, self.poison_reads = stream, poison_reads
        layers, e = len(caches), self.experts
        self.maps = torch.full((layers, e), -1, dtype=torch.int64, device=self.device)
        self._written: list[list[int] | None] = [None] * layers  # what each map holds
        cuda = self.device.type == "cuda"
        # waited on inside captured small steps: external, so a graph waits on the latest record
        self._ready = [torch.cuda.Event(external=True) if cuda else None for _ in range(layers)]
        self._retire = [torch.cuda.Event() if cuda else None for _ in range(layers)]
        for ready in self._ready if cuda else ():  # recorded once now: torch makes an event at
            ready.record(stream)  # its first record, and a small step captured before any
            # fill must still hold a wait node on it (an unmade event is no wait at all)
        #: arena row -> the position whose read of it was issued last (its retire event orders
        #: the row's next write); None: no read since the row's last write
        self._read_by: list[int | None] = [None] * total
        self._at: dict[int, list[int]] = {}  # position -> its rows, fills issued, not yet read
        self._reading: tuple[int, list[int]] | None = None
        self._next = 0  # the next position to fill; >= layers: the next step's
        self._expected: int | None = None  # the next layer of the step in progress
        #: arena row -> (position, expert, owner's generation): what a fill wrote there
        self._records: dict[int, tuple[int, int, int]] = {}
        self._tables: list[list[int]] | None = None  # the host's view of the slot tables
        # the slot tables side by side on the device, then in pinned memory: one kernel and
        # one copy per start, where a copy per cache cost the step's start 0.3 ms of host time
        self._table_stage = (torch.empty(total, dtype=torch.int64, device=self.device)
                             if cuda else None)
        self._table_copy = (torch.full((total,), -1, dtype=torch.int64, pin_memory=True)
                            if cuda else None)
        self._table_event = torch.cuda.Event() if cuda else None
        self.trace: list[ExpertOp] | None = None
        self.steps = self.carried_steps = self.fills = self.topped_up = 0
        self.early_starts = self.early_used = self.early_dropped = 0
        self._early: object | None = None  # the stream a prepare ordered its fills after
        self.rows_in_place = self.rows_from_host = 0
        #: the first position keeps every expert: its rows, once it ran, rank as fills' (step 2b)
        self._whole_first = caches[0].slots >= self.experts
        #: bumped wherever what a fill reads changes (rows read, claimed or written, the
        #: tables): a fill that failed is not tried again until it moves (``_fill_ahead``)
        self._epoch = 0
        self._stuck: tuple | None = None  # (next, epoch, generations) of the last failed fill
        self.fills_waited = 0  # fills that found too few rows and were left for later

    @property
    def layers(self) -> int:
        return len(self.caches)

    @property
    def bytes(self) -> int:
        """Device bytes beside the caches' (the rows are theirs): the positions' expert maps."""
        return self.maps.numel() * self.maps.element_size()

    def begin(self, position: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Layer ``position`` of a large step is about to compute on the current stream: order
        it after its fill (issued now if it was not) and return the arena's rows and the
        layer's expert map (expert -> row)."""
        if not 0 <= position < self.layers:
            raise KernelError(f"the expert arena serves positions 0..{self.layers - 1}, not "
                              f"{position}")
        if self._reading is not None:  # the layer before raised: its read never ended
            self._drop_reading()
        if self._early is not None and position == 0 and self._early != self._stream_id():
            raise KernelError(f"the expert arena's large step was prepared on stream "
                              f"{self._early} and its first layer runs on "
                              f"{self._stream_id()}: its early fills are ordered after the "
                              f"first only (Note [Large steps start early]); set "
                              f"experts.early_start to false")
        if self.starting(position):
            self._unprepare()  # a prepare this start replaces (another position) is dropped
            self._start(position)
        elif self._early is not None:
            self.early_used += 1
            self._early = None
        self._fill_ahead()
        rows = self._at.pop(position)
        self._epoch += 1
        compute = self._current()
        if compute is not None:
            compute.wait_event(self._ready[position])
        self._op("wait", "compute", on=("ready", position))
        self._trace_rows("read", "compute", position)
        self._reading, self._expected = (position, rows), position + 1
        return self.rows, self.maps[position]

    def end(self, position: int) -> None:
        """Layer ``position``'s compute is issued: its rows may be written again once it
        retires; fill the positions after it."""
        if self._reading is None or self._reading[0] != position:
            raise KernelError(f"end({position}) without begin({position})")
        _, rows = self._reading
        self._reading = None
        self._epoch += 1
        if self.poison_reads:  # the copied rows, after the read, before the retire event
            self._poison_copied(rows)
        if self._retire[position] is not None:
            self._retire[position].record(self._current())
        self._op("record", "compute", on=("retired", position))
        for r in rows:
            self._read_by[r] = position
        if position == self.layers - 1:
            self._expected = None
            self._next -= self.layers  # what was filled past the end is the next step's
        self._fill_ahead()

    def prepare(self) -> bool:
        """A large step is about to run, its forward not yet issued: start it now (Note [Large
        steps start early]); its ``begin(0)`` goes on from here. Returns True (it started)."""
        if self._reading is not None:
            self._drop_reading()
        self._unprepare()  # a prepare not yet used: this one replaces it
        self._start(0)
        self._fill_ahead()
        self._expected, self._early = 0, self._stream_id()
        self.early_starts += 1
        return True

    def drop_prepared(self) -> bool:
        """After the engine ran a prepared step: if no first layer went on from the prepare
        (vLLM replayed the step from a CUDA graph, or ran no forward), the next large step
        starts afresh; what the prepare filled stays, as a tail's carried fill does. Returns
        whether a prepare was dropped."""
        if not self._unprepare():
            return False
        self._expected = None
        return True

    def _unprepare(self) -> bool:
        """Forget a prepare no first layer went on from (counted as dropped)."""
        if self._early is None:
            return False
        self._early = None
        self.early_dropped += 1
        return True

    def before_small(self, position: int) -> None:
        """A small step of ``position`` reads and installs its slots next (and its lookahead
        the next layer's): order it after every position's latest fill (step 4 of the Note)."""
        self._unprepare()  # a prepared step that ran small after all
        self._expected = None  # the next large step starts afresh: tables read, copy waits
        compute = self._current()
        for p in range(self.layers):
            if compute is not None:
                compute.wait_event(self._ready[p])
            self._op("wait", "compute", on=("ready", p))

    def starting(self, position: int) -> bool:
        """Whether ``begin(position)`` starts a step (step 1 of the Note: the tables are read
        there, so the caller joins any side stream still installing into the slots first):
        at position 0, unless ``prepare`` started it; anywhere the step in progress did not
        expect."""
        if self._early is not None and position == 0:
            return False
        return position == 0 or position != self._expected

    def forget(self) -> None:
        """The host copies changed: nothing filled or recorded is current. Call it before the
        caches forget: their poison (on the compute stream) then follows every fill issued.
        The next fills run on the copy stream after everything issued so far."""
        self.before_small(0)
        self._drop_reading()
        self._at.clear()
        self._records.clear()
        self._tables, self._expected, self._next = None, None, 0
        self._epoch += 1
        self._copy_after_compute()

    def _start(self, position: int) -> None:
        """Steps 1 and 3 of the Note: a large step starts at ``position`` (0, or a restart)."""
        self.steps += 1
        self._epoch += 1
        self._copy_after_compute()
        self._read_tables()
        keep, at = {}, position  # the carried run from ``position`` on; the rest is dropped
        while at < self.layers and at in self._at:
            keep[at] = self._at[at]
            at += 1
        self._at, self._next = {}, position
        if position in keep:
            self.carried_steps += 1
        for p in keep:  # in order: each finds its rows in place, copies what small steps rewrote
            copied = self._fill(p)
            if copied < 0:
                break
            self.topped_up += copied > 0
            self._next = p + 1

    def _fill_ahead(self) -> None:
        """Fill positions from ``_next`` on, up to the next step's last, while rows allow
        (step 2 of the Note). A fill that found too few rows is tried again only once
        something it reads changed (a read issued or retired, a start, a cache's
        generation): ``begin`` after a failed ``end`` or ``prepare`` would scan every row to
        fail again, host time on the path of the step's first layers."""
        while self._next < 2 * self.layers:
            position = self._next % self.layers
            if position in self._at:
                break  # never two fills of one position at once
            state = (self._next, self._epoch, tuple(c.generation for c in self.caches))
            if state == self._stuck:
                break
            if self._fill(position) < 0:
                self._stuck = state
                self.fills_waited += 1
                break
            self._next += 1

    def _content(self, r: int) -> tuple[int, int] | None:
        """(position, expert) arena row ``r`` holds in the host's view; None: nothing known."""
        q, s = self._owner[r]
        e = self._tables[q][s]
        if e >= 0:
            return q, e
        return self._recorded(r)

    def _recorded(self, r: int) -> tuple[int, int] | None:
        """(position, expert) a fill wrote at row ``r``, while that counts: its owner's table
        entry still empty, within the owner's generation (step 2 of the Note)."""
        rec = self._records.get(r)
        if rec is None:
            return None
        q, s = self._owner[r]
        if self._tables[q][s] < 0 and rec[2] == self.caches[q].generation:
            return rec[0], rec[1]
        return None

    def _kept(self, position: int, claimed: set[int]) -> dict[int, int]:
        """Expert -> the row that holds it for ``position`` and stays (step 2 of the Note):
        the lowest unclaimed row whose content (``_content``) is that expert of
        ``position``, found from its own table and the fills' records rather than by
        reading every row's content (a whole layer's fill at each step's start did that)."""
        first = self._first_row[position]
        found = [(first + s, x) for s, x in enumerate(self._tables[position]) if x >= 0]
        for r, record in self._records.items():
            if record[0] == position:
                c = self._recorded(r)
                if c is not None:
                    found.append((r, c[1]))
        kept: dict[int, int] = {}
        for r, x in sorted(found):
            if x not in kept and r not in claimed:
                kept[x] = r
        return kept

    def _fill(self, position: int) -> int:
        """Step 2 of the Note: the rows ``position`` computes from, its experts found in place
        or copied into spare rows (``_spare_rank``). Returns how many experts were
        copied, or -1 where the rows it may take now are too few."""
        e = self.experts
        now = self._reading is None and not self._at  # no read to wait for: take what it must
        claimed = {r for rows in self._at.values() for r in rows}
        if self._reading is not None:
            claimed.update(self._reading[1])
        kept = self._kept(position, claimed)
        need = [x for x in range(e) if x not in kept]
        # a whole first layer's rows need not wait for the reads in flight or pending where
        # each row those hold is its owner's own entry: freed, none ranks before them (b)
        whole = bool(need) and (now or (self._whole_first and all(
            self._tables[q][s] >= 0 for q, s in (self._owner[r] for r in claimed))))
        spare: list[tuple[tuple, int]] = []  # (rank, row) of the rows it may take
        held = set(kept.values()) | claimed if need else set()  # found whole: ranks nothing
        for r in range(len(self._owner)) if need else ():
            if r not in held:
                rank = self._spare_rank(r, self._content(r), position, now, whole)
                if rank is not None:
                    spare.append((rank, r))
        if len(spare) < len(need):
            if now:
                raise KernelError(f"the expert arena has {len(spare)} rows to spare for "
                                  f"position {position}'s {len(need)} missing experts")
            return -1
        spare.sort()
        placed = list(zip(need, sorted(r for _, r in spare[:len(need)])))
        drops: dict[int, list[int]] = {}
        mine = set(self._tables[position])  # what position's own cache holds
        adopted: list[tuple[int, int]] = []
        for x, r in placed:
            q, s = self._owner[r]
            if q == position and x not in mine:  # its own slot: its table says so
                adopted.append((s, x))
                self._tables[q][s] = x
                self._records.pop(r, None)
                continue
            if self._tables[q][s] >= 0:
                drops.setdefault(q, []).append(s)
                self._tables[q][s] = -1
            self._records[r] = (position, x, self.caches[q].generation)
        for q, slots in drops.items():  # on the compute stream, before any later small step
            self.caches[q].drop(slots)
        if adopted:
            self.caches[position].adopt(adopted)
        where = [0] * e
        for x, r in [*kept.items(), *placed]:
            where[x] = r
        self._write_map(position, where)
        self._at[position] = sorted(where)
        self._epoch += 1
        self.fills += 1
        self.rows_in_place += len(kept)
        self.rows_from_host += len(placed)
        # rows no read holds first, then each reader's, oldest first, after its retire event:
        # the copy engine need not wait for the layer before to copy what it does not read
        # (Note [Large steps stream through the slots], step 2)
        by_reader: dict[int | None, list[tuple[int, int]]] = {}
        for x, r in placed:
            by_reader.setdefault(self._read_by[r], []).append((x, r))
            self._read_by[r] = None  # written now: the next write waits for its next reader
        host = self.caches[position].host
        for q in sorted(by_reader, key=lambda q: -1 if q is None
                        else self.layers - (position - q - 1) % self.layers):
            if q is not None:
                self._op("wait", "copy", on=("retired", q))
                if self.stream is not None:
                    self.stream.wait_event(self._retire[q])
            group = by_reader[q]
            for owner, pairs in _by_owner(group, self._owner).items():
                self._op("place", "copy", pairs=pairs, on=position, space=owner)
            for x, r, n in _runs(sorted(group)):
                for name, dst in self.rows.items():
                    if self.stream is None:  # the CPU: in line
                        dst[r:r + n].copy_(host[name][x:x + n])
                        continue
                    row = self._row_bytes[name]
                    copy_async(dst.data_ptr() + r * row, host[name].data_ptr() + x * row,
                               n * row, self.stream.cuda_stream)
        self._op("record", "copy", on=("ready", position))
        if self.stream is not None:
            self._ready[position].record(self.stream)
        return len(placed)

    def _spare_rank(self, r: int, c: tuple[int, int] | None, position: int,
                    now: bool, whole: bool) -> tuple | None:
        """How readily a fill of ``position`` takes row ``r`` (holding ``c``), lower first;
        None: not now (another layer's own entry while a read is pending: its rows may free
        up when it retires; ``whole``: a whole first layer's may be taken all the same). The
        classes and their order: step 2 of the Note, a to c."""
        foreign = self._owner[r][0] != position  # False (first): the position's own row
        if c is None or c[0] == position:  # empty, or a second copy of one of its own
            return 0, foreign, 0
        q = c[0]
        q_owns = self._owner[r][0] == q and self._tables[q][self._owner[r][1]] == c[1]
        busy = self._read_by[r] == (position - 1) % self.layers  # a copy waits for its compute
        if not q_owns:
            return 1, foreign, busy, 0, -((q - position) % self.layers)  # needed last first
        if q == 0 and position > 0 and not busy and self._whole_first and whole:
            return 1, foreign, False, 1, 0  # the whole first layer's: the tail gives them back
        if not now:
            return None
        return 2, foreign, (q > position, q if q < position else -q)

    def _write_map(self, position: int, where: list[int]) -> None:
        """Position ``position``'s expert -> row map, on the compute stream (the layer that
        reads it next is issued there, and the one before it was)."""
        if self._written[position] == where:  # the device's map already (a whole layer's,
            return  # step after step): no staging, kernel and copy on the step's path
        self.maps[position].copy_(device_ints(where, self.device))
        self._written[position] = where

    def _poison_copied(self, read: list[int]) -> None:
        """Poison the rows ``read`` that a fill wrote (not the caches' own entries) and forget
        them, so a read that skips the next fill's ready event sees NaN."""
        rows = [r for r in read  # not what a small step installed since
                if r in self._records and self._tables[self._owner[r][0]][self._owner[r][1]] < 0]
        for r in rows:
            del self._records[r]
        for q, pairs in _by_owner([(-1, r) for r in rows], self._owner).items():
            self._op("poison", "compute", pairs=pairs, space=q)
        for _, r, n in _runs([(r, r) for r in sorted(rows)]):
            for dst in self.rows.values():
                poison(dst[r:r + n])

    def _read_tables(self) -> None:
        """Every cache's slot -> expert table, read to the host now (one sync)."""
        if self.device.type != "cuda":
            self._tables = [c.expert_in[:c.slots].tolist() for c in self.caches]
            return
        torch.cat([c.expert_in[:c.slots] for c in self.caches], out=self._table_stage)
        self._table_copy.copy_(self._table_stage, non_blocking=True)
        self._table_event.record(self._current())
        self._table_event.synchronize()
        flat = self._table_copy.tolist()
        self._tables = [flat[first:first + c.slots]
                        for first, c in zip(self._first_row, self.caches)]

    def _drop_reading(self) -> None:
        """The layer being read never ended (it raised): its rows go back, their next write
        ordered after the reads by the copy stream's wait on the compute stream."""
        if self._reading is None:
            return
        self._reading = None
        self._epoch += 1
        self._copy_after_compute()

    def _copy_after_compute(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._op("wait", "copy", on="compute")

    def _current(self) -> torch.cuda.Stream | None:
        return None if self.stream is None else torch.cuda.current_stream(self.device)

    def _stream_id(self) -> object:
        """The current compute stream's handle ("compute" on the CPU)."""
        current = self._current()
        return "compute" if current is None else current.cuda_stream

    def _trace_rows(self, kind: str, stream: str, position: int) -> None:
        if self.trace is None:
            return
        where = self.maps[position].tolist()  # a host sync: traces are for tests
        for q, pairs in _by_owner(list(enumerate(where)), self._owner).items():
            self._op(kind, stream, pairs=pairs, on=position, space=q)

    def _op(self, kind: str, stream: str, pairs: tuple = (), on: object = None,
            space: object = None) -> None:
        if self.trace is not None:
            self.trace.append(ExpertOp(kind, stream, tuple(pairs), on, space))

    def describe(self) -> dict:
        return {"arena": True, "layers": self.layers, "windows": self.windows,
                "rows": len(self._owner), "steps": self.steps,
                "carried_steps": self.carried_steps, "early_starts": self.early_starts,
                "early_used": self.early_used, "early_dropped": self.early_dropped,
                "fills": self.fills,
                "topped_up": self.topped_up, "rows_in_place": self.rows_in_place,
                "rows_from_host": self.rows_from_host}


def _by_owner(pairs: Sequence[tuple[int, int]],
              owner: Sequence[tuple[int, int]]) -> dict[int, tuple[tuple[int, int], ...]]:
    """(expert, arena row) pairs grouped by the position owning the row, as (expert, slot)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for x, r in pairs:
        q, s = owner[r]
        out.setdefault(q, []).append((x, s))
    return {q: tuple(p) for q, p in out.items()}


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first expert, first row, count) of each run of (expert, row) pairs, both going up by
    one; ``pairs`` sorted by expert."""
    runs: list[list[int]] = []
    for x, r in pairs:
        if runs and runs[-1][0] + runs[-1][2] == x and runs[-1][1] + runs[-1][2] == r:
            runs[-1][2] += 1
        else:
            runs.append([x, r, 1])
    return [tuple(run) for run in runs]
