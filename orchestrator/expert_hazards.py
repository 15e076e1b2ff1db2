"""The hazard proof's part for the expert lane: one MoE step's installs and reads, checked.

Note [Expert lane hazards]
    The expert lane (Note [Expert cache]) cannot be proven before it runs the way a Dag is
    (hazards.py): which slot an expert lands in is decided on the device, from the router's
    choice. What can be proven is each step as it ran, from a trace of its operations in issue
    order (``ExpertCache.trace``), and over many random routings in the tests:

    * ``cross-stream``: every install and every read of the step is issued on one stream. The
      lane records no events: stream order is its only order, so an install on another stream
      could overwrite a slot a pass still reads, or a pass could read a slot before its install
      lands.
    * ``read-before-write``: every (expert, slot) a pass reads names the expert the slot holds
      at that point of the step, counting the installs issued before it (a slot poisoned or
      holding an evicted expert is a wrong answer, not a slow one).
    * ``slot-range`` / ``double-write``: installs write slots of the cache, each slot at most
      once per install.
    * ``incomplete``: every expert the step's tokens chose is read by exactly one pass, and no
      other expert is read (a missed expert would drop its tokens' share; one read twice would
      count it twice).

    Pure Python over ints, no torch: the trace is read back from the device by whoever records
    it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringflow.errors import HazardError


@dataclass(frozen=True)
class ExpertOp:
    """One operation of a step, in issue order: ``install`` writes expert ``e`` into slot
    ``s`` for each ``(e, s)`` of ``pairs``; ``read`` (a pass's MoE) reads them."""

    kind: str
    stream: object
    pairs: tuple[tuple[int, int], ...]


def check_expert_step(held: dict[int, int], needed: set[int], ops: list[ExpertOp],
                      slots: int) -> dict[int, int]:
    """Prove one step (Note [Expert lane hazards]); ``held`` is slot → expert before it.

    Returns:
        slot → expert after the step.

    Raises:
        HazardError: the first hazard, with the indices of the offending operations.
    """
    held = dict(held)
    streams = {op.stream for op in ops}
    if len(streams) > 1:
        raise HazardError("cross-stream", f"the step's installs and reads run on {len(streams)} "
                          f"streams ({sorted(map(str, streams))}) with no event between them",
                          range(len(ops)))
    read: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind == "install":
            written = [s for _, s in op.pairs]
            if any(not 0 <= s < slots for s in written):
                raise HazardError("slot-range", f"install {i} writes slots {written}, the cache "
                                  f"has {slots}", [i])
            if len(set(written)) != len(written):
                raise HazardError("double-write", f"install {i} writes slots {written}: a slot "
                                  f"twice", [i])
            held.update({s: e for e, s in op.pairs})
        elif op.kind == "read":
            for e, s in op.pairs:
                if held.get(s) != e:
                    raise HazardError("read-before-write", f"pass {i} reads expert {e} from slot "
                                      f"{s}, which holds {held.get(s, 'nothing')}", [i])
                if e in read:
                    raise HazardError("incomplete", f"expert {e} is read by operations "
                                      f"{read[e]} and {i}: its tokens count twice", [read[e], i])
                read[e] = i
        else:
            raise HazardError("unknown", f"operation {i} is {op.kind!r}, not install or read",
                              [i])
    if set(read) != needed:
        missing, extra = sorted(needed - set(read)), sorted(set(read) - needed)
        raise HazardError("incomplete", f"experts chosen but never read: {missing}; read but not "
                          f"chosen: {extra}", [read[e] for e in extra])
    return held
