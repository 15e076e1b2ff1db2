"""The hazard proof's part for the expert lane: one MoE step's installs and reads, checked.

Note [Expert lane hazards]
    The expert lane (Note [Expert cache]) cannot be proven before it runs the way a Dag is
    (hazards.py): which slot an expert lands in is decided on the device, from the router's
    choice. What can be proven is each step as it ran, from a trace of its operations in issue
    order (``ExpertCache.trace``), and over many random routings in the tests:

    * ``cross-stream``: every slot access is ordered after the accesses it must follow, by
      stream order or by a ``wait`` (an event recorded on one stream, waited on by another):
      a read after the install that wrote what it reads, an install after every earlier read
      and install of its slot, and after the previous steps (whose reads ran on the lane's
      stream, the stream of the step's reads). Without lookahead (Note [Expert lookahead])
      everything runs on the lane's stream and this holds by stream order; a lookahead
      installs on a side stream that must wait for the lane's stream before it writes, and
      the lane's stream must wait for it before it reads.
    * ``read-before-write``: every (expert, slot) a pass reads names the expert the slot holds
      at that point of the step, counting the installs issued before it (a slot poisoned or
      holding an evicted expert is a wrong answer, not a slow one).
    * ``slot-range`` / ``double-write``: installs write slots of the cache, each slot at most
      once per install.
    * ``incomplete``: every expert the step's tokens chose is read by exactly one pass, and no
      other expert is read (a missed expert would drop its tokens' share; one read twice would
      count it twice). A pass in place (``host``, Note [Expert cache] step 5) reads its experts
      from the host store, which no install writes: it counts here and nowhere else.

    A step that hands misses to the host (Note [Host split], Note [Host node]) adds three
    operations: ``stage`` (the lane's stream copies the step's rows and choices to the pinned
    buffers the host reads), ``cpu`` (the host's worker computes its experts, a stream of its
    own, reading the host store and those buffers) and ``sum`` (the lane's stream reads the
    host's output into the layer's sum). Each ``cpu`` expert counts for ``incomplete`` like
    any read, and:

    * ``cross-stream``: a ``cpu`` happens-after the latest ``stage`` (it reads what was
      staged), and a ``stage`` happens-after every ``cpu`` before it (it rewrites what the
      host may still be reading);
    * ``stage`` and ``sum`` run on the lane's stream, the one the steps before and after are
      ordered on (the next step's ``stage`` then follows this step's ``sum``);
    * ``unjoined-host``: the ``sum`` happens-after every ``cpu`` of the step, and a step with
      a ``cpu`` has a ``sum`` after it (a sum before the join reads an output being written;
      the mutant ``host-join-dropped`` of the tests).

    The layer ring (Note [Expert layer ring]) is proven over a trace of many steps by
    :func:`check_ring`: its ``fill`` writes a whole layer (a position of the chosen layers)
    into a ring slot on the copy stream, its ``read`` is a layer's MoE on the compute stream,
    and the two streams are ordered only by ``record``/``wait`` of named events:

    * ``wrong-layer``: every read names the position the slot's latest fill wrote;
    * ``cross-stream``: every read happens-after that fill, and every fill happens-after every
      read of its slot since the slot's previous fill (write-after-read: a refill before its
      readers retire is the mutant ``layer-refill-before-retire`` of tests/helpers/mutants.py).

    The ring's fills also read the slot caches (Note [Ring fills from the slots]): a ``take``
    copies rows of a cache's slots into a buffer, and with lent slots (Note [Ring lends the
    carried layers' slots]) a ``lend`` writes another layer's experts into them. Ops on a
    cache's slots carry ``space``, the cache's layer position; a lane's joint trace
    (``ExpertLane.trace_all``: the ring's operations and every cache's, in issue order, the
    lane's stream named ``compute``) is proven by :func:`check_lane`, which adds to the
    ring's rules, per cache slot over all steps:

    * ``read-before-write``: a ``read`` or ``take`` names the expert the slot's latest
      ``install`` or ``lend`` wrote (a take of a row a decode step rewrote since the large
      step read the tables copies the wrong expert);
    * ``cross-stream``: it happens-after that write, and every write happens-after every
      read and take of its slot since the previous write (an install over a row a fill is
      still copying). A cache's ``forget`` (its ``forget`` or ``lend``: every slot empty)
      writes all its slots.

    An expert arena (Note [Large steps stream through the slots]) computes a large step's
    layers from the caches' own rows: its ``place`` (copy stream) writes expert ``e`` of the
    position named in ``on`` into slot ``s`` of cache ``space``, its ``read`` (compute stream,
    ``on`` set) reads it there, and ``poison`` empties rows after their read. They are
    checked by the same two rules, each row holding an expert of some layer (a decode step's
    read of a row an arena filled for another layer is ``read-before-write``, an install over
    a row a fill still copies ``cross-stream``).

    An event (``record`` with ``on`` naming it) orders what its stream issued before the
    record; a ``wait`` on an event orders the waiting stream's next operations after it, and
    a ``wait`` on a stream after everything that stream issued so far. The slot cache's steps
    and the ring's share these rules, so one lane's trace mixes both (a prefill on the ring, a
    decode step on the slots) and each part is proven where it ran.

    Pure Python over ints, no torch: the trace is read back from the device by whoever records
    it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringflow.errors import HazardError


@dataclass(frozen=True)
class ExpertOp:
    """One operation of a step, in issue order: ``install`` writes expert ``e`` into slot
    ``s`` for each ``(e, s)`` of ``pairs``; ``read`` (a pass's MoE) reads them; ``host`` (a
    pass in place) reads expert ``e`` from the host store (``s`` is ``e``); ``record`` names
    (``on``) an event after what ``stream`` issued so far; ``wait`` orders what ``stream``
    issues next after that event, or, where ``on`` names no event, after everything issued
    so far on stream ``on``. ``stage``, ``cpu`` (``(e, e)`` per expert the host computes)
    and ``sum`` are the host's share of a step. The layer ring's ``fill`` writes layer
    position ``p`` into ring slot ``s`` for each ``(p, s)``, and its ``read`` reads them; its
    ``take`` reads expert ``e`` from slot ``s`` of cache ``space`` (a layer position) and its
    ``lend`` writes it there. An expert arena's ``place`` writes expert ``e`` of layer position
    ``on`` into slot ``s`` of cache ``space``, its ``read`` (``on`` set) reads it there, its
    ``poison`` (``(-1, s)`` pairs) empties those rows. ``space`` names the cache of a lane's joint trace (None: the
    ring's slots, or a cache's own trace)."""

    kind: str
    stream: object
    pairs: tuple[tuple[int, int], ...] = ()
    on: object = None
    space: object = None


_PREVIOUS = -1  # the steps before this one, in the happens-before sets below


class _Order:
    """Happens-before over a trace's streams: per stream, the operations ordered before its
    next one (stream order, ``record``/``wait`` of events, ``wait`` on a stream)."""

    def __init__(self, knows: dict[object, set[int]] | None = None) -> None:
        self.knows = knows or {}
        self.issued: dict[object, list[int]] = {}
        self.events: dict[object, set[int]] = {}

    def before(self, i: int, op: ExpertOp) -> set[int] | None:
        """What happens-before operation ``i``; None for a ``record`` or ``wait``, which only
        order (consumed here)."""
        known = self.knows.setdefault(op.stream, set())
        if op.kind == "wait":
            if op.on in self.events:
                known |= self.events[op.on]
            else:
                known |= self.knows.get(op.on, set()) | set(self.issued.get(op.on, ()))
            return None
        after = known | set(self.issued.get(op.stream, ()))
        if op.kind == "record":
            self.events[op.on] = after
            return None
        return after

    def issue(self, i: int, op: ExpertOp) -> None:
        self.issued.setdefault(op.stream, []).append(i)


def check_expert_step(held: dict[int, int], needed: set[int], ops: list[ExpertOp],
                      slots: int) -> dict[int, int]:
    """Prove one step (Note [Expert lane hazards]); ``held`` is slot → expert before it.

    Returns:
        slot → expert after the step.

    Raises:
        HazardError: the first hazard, with the indices of the offending operations.
    """
    held = dict(held)
    lane = next((op.stream for op in ops if op.kind in ("read", "host")),
                ops[0].stream if ops else None)
    order = _Order({lane: {_PREVIOUS}})  # the lane's stream follows the previous steps
    writer: dict[int, int] = {}  # slot -> the install that wrote it this step
    readers: dict[int, list[int]] = {}  # slot -> reads of it since
    read: dict[int, int] = {}
    staged: int | None = None  # the latest stage of the host's inputs
    cpu: list[int] = []  # the host's computes so far
    summed: set[int] = set()  # those a sum read after

    def unordered(i: int, after: set[int], first: list[int], what: str,
                  kind: str = "cross-stream") -> None:
        late = [j for j in first if j not in after]
        if late:
            raise HazardError(kind, f"operation {i} ({ops[i].kind}, stream {ops[i].stream}) "
                              f"{what} with no event after operation(s) {late} on stream(s) "
                              f"{sorted({str(ops[j].stream) for j in late})}", [*late, i])

    for i, op in enumerate(ops):
        after = order.before(i, op)
        if after is None:
            continue
        if op.kind == "install":
            written = [s for _, s in op.pairs]
            if any(not 0 <= s < slots for s in written):
                raise HazardError("slot-range", f"install {i} writes slots {written}, the cache "
                                  f"has {slots}", [i])
            if len(set(written)) != len(written):
                raise HazardError("double-write", f"install {i} writes slots {written}: a slot "
                                  f"twice", [i])
            for s in written:
                if _PREVIOUS not in after:
                    raise HazardError("cross-stream", f"install {i} (stream {op.stream}) writes "
                                      f"slot {s} with no event after the previous steps' reads "
                                      f"on the lane's stream {lane}", [i])
                unordered(i, after, [*readers.get(s, ()), *([writer[s]] if s in writer
                                                            else ())], f"touches slot {s}")
                writer[s], readers[s] = i, []
            held.update({s: e for e, s in op.pairs})
        elif op.kind == "forget":  # every slot empty (ExpertCache.forget or lend)
            held.clear()
        elif op.kind in ("stage", "sum") and op.stream != lane:
            raise HazardError("cross-stream", f"{op.kind} {i} runs on stream {op.stream}, not "
                              f"the lane's ({lane}): the steps before and after order only "
                              f"the lane's stream", [i])
        elif op.kind == "stage":
            unordered(i, after, cpu, "rewrites the host's inputs")
            staged = i
        elif op.kind == "sum":
            unordered(i, after, cpu, "reads the host's output (no join)", "unjoined-host")
            summed.update(cpu)
        elif op.kind in ("read", "host", "cpu"):
            if op.kind == "cpu":
                if staged is None:
                    raise HazardError("cross-stream", f"host compute {i} reads inputs that no "
                                      f"stage wrote this step", [i])
                unordered(i, after, [staged], "reads the staged inputs")
                cpu.append(i)
            for e, s in op.pairs:
                if op.kind == "read":
                    if held.get(s) != e:
                        raise HazardError("read-before-write", f"pass {i} reads expert {e} from "
                                          f"slot {s}, which holds {held.get(s, 'nothing')}", [i])
                    unordered(i, after, [writer[s]] if s in writer else [], f"touches slot {s}")
                    readers.setdefault(s, []).append(i)
                if e in read:
                    raise HazardError("incomplete", f"expert {e} is read by operations "
                                      f"{read[e]} and {i}: its tokens count twice", [read[e], i])
                read[e] = i
        else:
            raise HazardError("unknown", f"operation {i} is {op.kind!r}, not install, read, "
                              f"host, stage, cpu, sum, record or wait", [i])
        order.issue(i, op)
    unjoined = [j for j in cpu if j not in summed]
    if unjoined:
        raise HazardError("unjoined-host", f"host compute(s) {unjoined} are never summed after "
                          f"a join: the step ends without their experts", unjoined)
    if set(read) != needed:
        missing, extra = sorted(needed - set(read)), sorted(set(read) - needed)
        raise HazardError("incomplete", f"experts chosen but never read: {missing}; read but not "
                          f"chosen: {extra}", [read[e] for e in extra])
    return held


def check_ring(ops: list[ExpertOp], slots: int) -> dict[int, int]:
    """Prove a layer ring's trace over any number of steps (Note [Expert lane hazards]); the
    ring has ``slots`` slots, empty when the trace starts. Operations on caches' slots
    (``space`` set) are ordered but not checked here: :func:`check_lane` checks them.

    Returns:
        slot → layer position it holds at the end.

    Raises:
        HazardError: the first hazard, with the indices of the offending operations.
    """
    return _check(ops, slots, caches=False)


def check_lane(ops: list[ExpertOp], slots: int) -> dict[int, int]:
    """Prove a lane's joint trace (``ExpertLane.trace_all``): the ring's slots as
    :func:`check_ring` does, and every cache slot (``space``: the cache's layer position)
    across the steps, every slot empty when the trace starts (Note [Expert lane hazards]).

    Returns:
        ring slot → layer position it holds at the end.

    Raises:
        HazardError: the first hazard, with the indices of the offending operations.
    """
    return _check(ops, slots, caches=True)


def _check(ops: list[ExpertOp], slots: int, caches: bool) -> dict[int, int]:
    """``check_ring`` (the caches' slots ordered, not checked) or ``check_lane`` (checked)."""
    order = _Order()
    ring = _Slots("ring slot {s}", "wrong-layer", "layer position")
    cache = _Slots("slot {s} of cache {space}", "read-before-write", "(layer position, expert)")
    for i, op in enumerate(ops):
        after = order.before(i, op)
        if after is None:
            continue
        if op.space is not None:
            if caches and op.kind == "forget":  # every slot empty (poisoned, or lent): a write
                for key in [k for k in cache.holds if k[0] == op.space]:
                    cache.write(i, op, key, None, after)
            elif caches and op.kind == "poison":  # an arena's copied rows, after their read
                for _, s in op.pairs:
                    cache.write(i, op, (op.space, s), None, after)
            elif caches and op.kind in ("install", "lend", "read", "take", "place"):
                # other kinds (in place, the host's, a table's drop) touch no slot's bytes; a
                # row holds an expert of a layer: the cache's own, or (an arena's ``place``
                # and ``read``) the position named in ``on``
                owner = op.on if op.kind in ("place", "read") and op.on is not None else op.space
                for e, s in op.pairs:
                    access = cache.write if op.kind in ("install", "lend", "place") else cache.read
                    access(i, op, (op.space, s), (owner, e), after)
        elif op.kind in ("fill", "read"):
            for position, s in op.pairs:
                if not 0 <= s < slots:
                    raise HazardError("slot-range", f"operation {i} ({op.kind}) names ring slot "
                                      f"{s}; the ring has {slots}", [i])
                access = ring.write if op.kind == "fill" else ring.read
                access(i, op, s, position, after)
        else:
            raise HazardError("unknown", f"operation {i} is {op.kind!r}, not fill, read, record "
                              f"or wait", [i])
        order.issue(i, op)
    return ring.holds


class _Slots:
    """What each slot holds, its latest write and the reads since, for the proof of a ring's or
    the caches' slots (``key``: a ring slot, or a cache's (position, slot))."""

    def __init__(self, name: str, wrong: str, what: str) -> None:
        self.name, self.wrong, self.what = name, wrong, what
        self.holds: dict = {}
        self.writer: dict = {}
        self.readers: dict = {}

    def _named(self, key) -> str:
        space, s = key if isinstance(key, tuple) else (None, key)
        return self.name.format(s=s, space=space)

    def write(self, i: int, op: ExpertOp, key, value, after: set[int]) -> None:
        """A write after every read and write of its slot since the last write."""
        late = [j for j in [*self.readers.get(key, ()), *([self.writer[key]]
                                                          if key in self.writer else ())]
                if j not in after]
        if late:
            raise HazardError("cross-stream", f"{op.kind} {i} (stream {op.stream}) rewrites "
                              f"{self._named(key)} with no event after operation(s) {late} "
                              f"that read or wrote it", [*late, i])
        self.holds[key], self.writer[key], self.readers[key] = value, i, []

    def read(self, i: int, op: ExpertOp, key, value, after: set[int]) -> None:
        """A read of what the slot's latest write wrote, after that write."""
        if self.holds.get(key) != value:
            raise HazardError(self.wrong, f"{op.kind} {i} takes {self.what} {value} from "
                              f"{self._named(key)}, which holds "
                              f"{self.holds.get(key, 'nothing')}", [i])
        if self.writer[key] not in after:
            raise HazardError("cross-stream", f"{op.kind} {i} (stream {op.stream}) reads "
                              f"{self._named(key)} with no event after its write "
                              f"{self.writer[key]}", [self.writer[key], i])
        self.readers[key].append(i)
