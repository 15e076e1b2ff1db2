"""ExpertCache: a MoE layer's routed experts in host memory, a budgeted set of GPU slots for them.

Note [Expert cache]
    A decode step of a few tokens reads top_k of a layer's experts; copying the whole layer
    each step copies experts nobody reads. The cache keeps ``slots`` experts of one layer on the
    GPU (preallocated once, never grown) and, per step, brings in only the experts the router
    chose that are not there. Everything it decides is decided on the device with fixed-shape
    torch ops: the router's choice lives on the GPU, inside a step vLLM may have captured, and a
    host sync per layer would cost more than most misses. Per step, in stream order on the
    stream that runs the layer:

    1. ``needed``: which experts any token picked; hits are needed experts already in a slot.
    2. Slots that hold a needed expert are stamped with the step's clock; the others are the
       victims, least recently used (empty ones) first.
    3. Pass 0 installs the first ``min(misses, victims)`` missed experts into victims
       (kernels/expert_fetch.py, device-indexed) and yields the expert→slot map of every expert
       it serves (hits and installed); the caller runs its MoE kernel with that map (experts
       mapped to -1 contribute nothing, as in vLLM's expert-parallel ``expert_map``).
    4. When one step needs more experts than there are slots, further passes install the rest
       ``slots`` at a time into any slot (the previous pass has been computed: same stream) and
       yield maps of only what they installed, so every (token, expert) pair is summed once.
       How many passes a step gets is fixed by its shape, ``ceil(min(experts, tokens * top_k) /
       slots)``, so a captured graph holds enough passes for any routing of its batch: a cache
       smaller than a step's experts is slower, never wrong.
    5. In place: a step of at most ``in_place_tokens`` tokens that needs several passes instead
       takes one more, computed straight from the host store over the experts pass 0 could not
       install (the host store must be readable by the kernel where the slots are: a CUDA view
       of pinned memory, as vLLM's UVA offloader makes). A kernel reading an expert in place
       reads it across the host link once per block of its tokens: for a few tokens per
       expert that is the bytes a copy would move, without the copy's passes or its second
       write, and what pass 0 installed still serves the next steps; for many tokens per
       expert (a long prefill) copying once and computing from the slots is cheaper. The
       crossing point was measured (``tools/experts_in_place_bench.py``). The choice depends
       on the step's shape only, so a captured graph replays it for any routing.

    6. Whole in place (``whole_in_place``): a step that needs several passes is computed in
       one, straight from the host store, nothing installed. For kernels whose arithmetic
       spans a step's rows (fp8 with one activation scale per step, Note [fp8 experts]),
       passes would round otherwise than the resident layer; one pass over the host store is
       the resident call on host memory (what vLLM's UVA offloader runs).

    No slot is rewritten while a reader may run: the fetch and the MoE kernel share one stream,
    so a pass's install waits for the previous pass's (and step's) compute by stream order, and
    pass 0 writes only slots no token of this step reads. The state (which expert is in which
    slot, the stamps, the hit counters) lives in device tensors that a replay updates like an
    eager step; ``hit_rate`` reads them (one host sync, at report time). With ``trace`` set, each
    step's installs and reads are recorded for the proof of Note [Expert lane hazards]
    (orchestrator/expert_hazards.py).

Note [Small writes beside bulk copies]
    A large step through the expert arena writes small tables on the compute stream while its
    copy stream moves experts: each fill's expert map, and the slots it drops from or adopts
    into a cache (``device_ints``). Written by torch's pinned copy, each went through a copy
    engine, and on an H100 a copy engine served it after every bulk host-to-device copy
    issued before it on the copy stream: in the 8-layer lone step the tail's map (the next
    step's first fill), issued at 22.9 ms, ran at 119.7, when the last of 6.1 GB of queued
    experts landed, 19 ms after the last layer ended; the compute stream waited that long for
    copies it does not read, and in vLLM the logits and the sampler after the last layer with
    it (``tools/arena_timeline.py --gpu``: that lone step 117.8-118.0 ms against 97.2
    replayed, 98.8-99.0 since). ``device_ints`` stages the values in pinned memory and
    widens them with a kernel that reads them across the host link: the compute stream's
    order is its own again. Under CUDA graph capture it keeps torch's copy (a graph node).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Mapping

import torch

from ringflow import envs
from ringflow.errors import ConfigError, KernelError
from ringflow.graphs.slots import poison
from ringflow.kernels import expert_fetch, expert_plan
from ringflow.kernels.expert_fetch import PROGRAMS, check, fetch_experts
from ringflow.orchestrator.expert_hazards import ExpertOp

_LATEST = torch.iinfo(torch.int64).max


def device_ints(values: list, device: torch.device) -> torch.Tensor:
    """``values`` (a list of ints, or of tuples of them) as an int64 tensor on ``device``,
    without a host sync and without a copy engine (Note [Small writes beside bulk copies]):
    on a GPU, staged in pinned memory and widened by a kernel on the current stream that
    reads it across the host link."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing():  # a graph keeps torch's own copy node
        return t.pin_memory().to(device, non_blocking=True)
    if t.numel() and (int(t.min()) < -2**31 or int(t.max()) >= 2**31):
        raise KernelError(f"device_ints stages int32: {int(t.abs().max())} does not fit")
    staged = t.to(torch.int32).pin_memory()
    view = torch.as_tensor(_PinnedView(staged), device=device)  # the same pinned bytes
    out = view.to(torch.int64)  # an SM kernel: no copy engine, so no queue behind bulk copies
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))  # the stream the kernel ran on
    _STAGED.append((done, staged))  # kept until the kernel read it
    while _STAGED and _STAGED[0][0].query():
        _STAGED.popleft()
    return out


def device_ints_by_copy(values: list, device: torch.device) -> torch.Tensor:
    """``device_ints`` through a copy engine (torch's pinned copy), as it was until December
    2026: queued behind any bulk host-to-device copy issued before it on any stream."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class _PinnedView:
    """A pinned CPU tensor's bytes as CUDA sees them (unified addressing: the same address),
    for ``torch.as_tensor`` to wrap without copying."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i4",
                                         "data": (t.data_ptr(), False), "version": 2}


_STAGED: collections.deque = collections.deque()  # (event, pinned tensor) not yet read


class ExpertCache:
    """``slots`` GPU copies of one MoE layer's routed experts, whose host copies are ``host``
    (parameter name → tensor [experts, ...]: pinned on the CPU, or a CUDA view of pinned host
    memory such as vLLM's UVA offloader makes); see Note [Expert cache]."""

    def __init__(self, host: Mapping[str, torch.Tensor], slots: int,
                 device: torch.device | str, programs: int = PROGRAMS,
                 in_place_tokens: int = 0, whole_in_place: bool = False,
                 rows: Mapping[str, torch.Tensor] | None = None) -> None:
        counts = {name: t.shape[0] for name, t in host.items()}
        if not counts or len(set(counts.values())) != 1:
            raise ConfigError(f"expert parameters must share their first dimension (the "
                              f"expert), got {counts}")
        self.experts = next(iter(counts.values()))
        if not 1 <= slots <= self.experts:
            raise ConfigError(f"an expert cache needs 1 to {self.experts} slots (the layer's "
                              f"experts), got {slots}; at {self.experts} keep the layer resident")
        self.slots, self.programs = slots, programs
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
        if self.device.type == "cuda" and expert_fetch.triton is None:
            raise ConfigError("an expert cache on a GPU fetches with its Triton kernel from "
                              "pinned host memory (Note [Device-indexed expert fetch]): a torch "
                              "copy would sync every step; install Triton")
        self.host = dict(host)
        if in_place_tokens < 0:
            raise ConfigError(f"in_place_tokens must be >= 0 (0: never in place), got "
                              f"{in_place_tokens}")
        if ((in_place_tokens or whole_in_place)
                and any(t.device != self.device for t in self.host.values())):
            raise ConfigError(f"reading experts in place needs a host store the kernel reads "
                              f"on {self.device} (a CUDA view of pinned memory); this one is on "
                              f"{sorted({str(t.device) for t in self.host.values()})}: set "
                              f"in_place_tokens to 0")
        self.in_place_tokens, self.whole_in_place = in_place_tokens, whole_in_place
        if rows is not None:  # the caller's memory: an expert arena's rows (Note [Large
            rows = dict(rows)  # steps stream through the slots])
            want = {name: ((slots, *t.shape[1:]), t.dtype) for name, t in host.items()}
            got = {name: (tuple(t.shape), t.dtype) for name, t in rows.items()}
            if got != want or any(t.device != self.device for t in rows.values()):
                raise ConfigError(f"an expert cache's rows are [slots, ...] of each host "
                                  f"parameter on {self.device}: want {want}, got {got}")
        self.weights = rows or {name: torch.empty((slots, *t.shape[1:]), dtype=t.dtype,
                                                  device=self.device)
                                for name, t in host.items()}
        for name, w in self.weights.items():
            check(self.host[name], w)
            poison(w)
        e, s, dev = self.experts, slots, self.device
        # one spare entry each (index experts / slots) takes the writes of unused positions
        self.slot_of = torch.full((e + 1,), -1, dtype=torch.int64, device=dev)
        self.expert_in = torch.full((s + 1,), -1, dtype=torch.int64, device=dev)
        self.last_used = torch.full((s + 1,), -1, dtype=torch.int64, device=dev)
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        self.hits = torch.zeros((), dtype=torch.int64, device=dev)
        self.misses = torch.zeros((), dtype=torch.int64, device=dev)
        self.in_place_steps = torch.zeros((), dtype=torch.int64, device=dev)
        self.planned = torch.zeros((), dtype=torch.int64, device=dev)  # by the plan kernel
        # the experts a step hands to the host (Note [Host split]), one spare entry, and how
        # many were handed over all steps
        self.host_mine = torch.zeros(e + 1, dtype=torch.bool, device=dev)
        self.host_computed = torch.zeros((), dtype=torch.int64, device=dev)
        # lookahead (Note [Expert lookahead]): the experts predicted for the coming step, and
        # over all steps how many were predicted, how many of those the step chose, and how
        # many the prediction installed
        self.predicted = torch.zeros(e, dtype=torch.bool, device=dev)
        self.predictions = torch.zeros(3, dtype=torch.int64, device=dev)
        self.looked_ahead = False  # a Lookahead targets this cache: report its counters
        #: counts lend() and forget(): a -1 table entry means "written by nothing since the
        #: lend" only within one generation (Note [Ring lends the carried layers' slots])
        self.generation = 0
        self._positions = torch.arange(s, device=dev)
        self._experts = torch.arange(e, device=dev)
        #: a one-pass step's bookkeeping in one kernel on a GPU (Note [One kernel plans the
        #: step]; RINGFLOW_EXPERT_PLAN_KERNEL); its outputs allocated once, where a captured
        #: step finds them
        self.plan_kernel = (expert_plan.available(dev, e)
                            and envs.flag("RINGFLOW_EXPERT_PLAN_KERNEL"))
        self._plan = expert_plan.PlanBuffers(e, s, dev) if self.plan_kernel else None
        #: a list to append each step's operations to (ExpertOp, Note [Expert lane hazards]),
        #: or None; tracing reads the device state back (a host sync per operation)
        self.trace: list[ExpertOp] | None = None

    @property
    def bytes(self) -> int:
        """Device bytes of the expert slots (the state tensors are a few KiB)."""
        return sum(w.numel() * w.element_size() for w in self.weights.values())

    def passes(self, tokens: int, top_k: int) -> int:
        """Passes a step of ``tokens`` tokens routed to ``top_k`` experts each gets."""
        through_slots = self._through_slots(tokens, top_k)
        if through_slots > 1 and self.whole_in_place:
            return 1
        return 2 if through_slots > 1 and self.reads_in_place(tokens) else through_slots

    def _through_slots(self, tokens: int, top_k: int) -> int:
        """Passes a step of ``tokens`` x ``top_k`` choices needs through the slots alone."""
        return max(1, math.ceil(min(self.experts, tokens * top_k) / self.slots))

    def reads_in_place(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens that needs several passes ends with one over the
        host store (Note [Expert cache], step 5)."""
        return tokens <= self.in_place_tokens

    def serve(self, topk_ids: torch.Tensor, host_share: float = 0.0,
              on_split: Callable[[], None] | None = None
              ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Install the experts ``topk_ids`` [tokens, top_k] needs and yield, per pass, the
        weights to compute it with (``self.weights``, or ``self.host`` for a pass in place) and
        the expert→index map [experts] into them (int64, -1: not in this pass); compute each
        pass before taking the next (Note [Expert cache]).

        With ``host_share`` > 0 (a step whose experts fit the slots), that share of the step's
        misses, those with the fewest tokens, is neither installed nor read: ``host_mine``
        [experts] marks them, and ``on_split()`` is called then, before the other misses are
        installed, so the host's work overlaps the copies (Note [Host split] in
        orchestrator/host_split.py, Note [Host experts])."""
        if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point:
            raise KernelError(f"topk_ids must be [tokens, top_k] integers, got "
                              f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
        if topk_ids.device != self.device:
            raise KernelError(f"topk_ids are on {topk_ids.device}, the cache on {self.device}")
        e, s = self.experts, self.slots
        if host_share > 0 and self._through_slots(*topk_ids.shape) > 1:
            raise KernelError(f"a host share needs a step whose experts fit the slots; "
                              f"{tuple(topk_ids.shape)} choices need more than {s}")
        passes = self.passes(*topk_ids.shape)
        if (self.plan_kernel and not self.looked_ahead
                and self._through_slots(*topk_ids.shape) == 1):
            yield self.weights, self._planned(topk_ids, host_share, on_split)
            return
        needed = self._chosen(topk_ids)
        if self.whole_in_place and self._through_slots(*topk_ids.shape) > 1:  # step 6
            self.in_place_steps += 1  # one pass, all from the host: no slot serves it
            yield self.host, self._traced_read(torch.where(needed, self._experts, -1), "host")
            return
        cached = self.slot_of[:e] >= 0
        miss = needed & ~cached
        miss_count = miss.sum()
        self.hits += (needed & cached).sum()
        self.misses += miss_count
        if host_share > 0:
            miss, miss_count = self._hand_to_host(topk_ids, miss, miss_count, host_share)
            if on_split is not None:
                on_split()
        if self.looked_ahead:  # score the prediction made for this step, then drop it
            self.predictions[:2] += torch.stack([self.predicted.sum(),
                                                 (self.predicted & needed).sum()])
            self.predicted.zero_()
        self.clock += 1
        missed, first = self._install_missing(needed, miss, miss_count, stamp=True)
        yield self.weights, self._traced_read(torch.where(needed, self.slot_of[:e], -1))
        if passes > 1 and self.reads_in_place(topk_ids.shape[0]):  # step 5
            self.in_place_steps += 1
            rest = needed & (self.slot_of[:e] < 0)
            yield self.host, self._traced_read(torch.where(rest, self._experts, -1), "host")
            return
        for p in range(1, passes):
            start = first + (p - 1) * s
            ids = missed[(start + self._positions).clamp(max=e - 1)]
            count = (miss_count - start).clamp(0, s)
            self._install(ids, self._positions, count)
            installed = torch.zeros(e + 1, dtype=torch.bool, device=self.device)
            installed.index_fill_(0, torch.where(self._positions < count, ids, e), True)
            yield self.weights, self._traced_read(torch.where(installed[:e], self.slot_of[:e],
                                                              -1))

    def _planned(self, topk_ids: torch.Tensor, host_share: float = 0.0,
                 on_split: Callable[[], None] | None = None) -> torch.Tensor:
        """Pass 0 of a one-pass step by one kernel (Note [One kernel plans the step]): the
        same tables, host's experts, installs and map as the torch path; ``on_split`` after
        the plan, before the fetch; returns the map."""
        if self._plan is None:  # the CPU under Triton's interpreter (tests)
            self._plan = expert_plan.PlanBuffers(self.experts, self.slots, self.device)
        out = self._plan
        if host_share and not 0 < host_share <= 1:
            raise KernelError(f"a host share is in (0, 1], got {host_share}")
        expert_plan.plan_step(topk_ids, self.slot_of, self.expert_in, self.last_used,
                              self.clock, self.hits, self.misses, self.planned,
                              self.host_mine, self.host_computed, out,
                              share=round(host_share * 1024))
        if host_share and on_split is not None:
            on_split()
        if self.trace is not None:
            n = int(out.count)
            self.trace.append(ExpertOp("install", self.trace_stream(), tuple(
                zip(out.ids[:n].tolist(), out.slots[:n].tolist()))))
        for name, w in self.weights.items():
            fetch_experts(self.host[name], w, out.ids, out.slots, out.count, self.programs)
        return self._traced_read(out.map)

    def _hand_to_host(self, topk_ids: torch.Tensor, miss: torch.Tensor, miss_count: torch.Tensor,
                      share: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark ``round(share * misses)`` of the missed experts, fewest tokens first, as the
        host's (``host_mine``); return the misses left to install and their count."""
        e = self.experts
        if not 0 < share <= 1:
            raise KernelError(f"a host share is in (0, 1], got {share}")
        q = round(share * 1024)  # a constant of the step's shape: a replay repeats it
        take = torch.div(miss_count * q + 512, 1024, rounding_mode="floor")
        ids = topk_ids.reshape(-1).long()
        tokens = torch.zeros(e + 1, dtype=torch.int64, device=self.device)  # a -1 on the spare
        tokens.index_add_(0, torch.where(ids >= 0, ids, e), torch.ones_like(ids))
        order = torch.argsort(torch.where(miss, tokens[:e], _LATEST), stable=True)
        self.host_mine.zero_()
        self.host_mine.index_fill_(0, torch.where(self._experts < take, order, e), True)
        self.host_computed += take
        mine = self.host_mine[:e]
        return miss & ~mine, miss_count - take

    def prefetch(self, topk_ids: torch.Tensor) -> None:
        """Install the experts ``topk_ids`` [tokens, top_k] predicts for the coming step that are
        not cached, into the least recently used slots no predicted expert holds; no hit or
        miss is counted (Note [Expert lookahead]). Issue it on a stream ordered after this
        cache's previous reads, and the coming step's ``serve`` after it."""
        wanted = self._chosen(topk_ids)
        miss = wanted & (self.slot_of[:self.experts] < 0)
        _, count = self._install_missing(wanted, miss, miss.sum(), stamp=False)
        self.predicted.copy_(wanted)
        self.predictions[2:] += count

    def _chosen(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[experts] bool: the experts any token chose (a -1 choice lands on the spare entry)."""
        chosen = torch.zeros(self.experts + 1, dtype=torch.bool, device=self.device)
        chosen.index_fill_(0, topk_ids.reshape(-1).long(), True)
        return chosen[:self.experts]

    def _install_missing(self, wanted: torch.Tensor, miss: torch.Tensor,
                         miss_count: torch.Tensor, stamp: bool) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """Pass 0 (Note [Expert cache], steps 2 and 3): install the first missed experts into
        the least recently used slots no ``wanted`` expert holds, those slots stamped with the
        clock first when ``stamp``. Returns the missed experts first in order, and how many
        were installed."""
        s = self.slots
        holder = self.expert_in[:s]
        used = (holder >= 0) & wanted[holder.clamp(min=0)]
        if stamp:
            self.last_used[:s] = torch.where(used, self.clock, self.last_used[:s])
        victims = torch.argsort(torch.where(used, _LATEST, self.last_used[:s]), stable=True)
        missed = torch.argsort((~miss).to(torch.int8), stable=True)  # missed experts first
        count = torch.minimum(miss_count, s - used.sum())
        self._install(missed[:s], victims, count)  # s <= e: the first s missed, in order
        return missed, count

    def _install(self, ids: torch.Tensor, slots: torch.Tensor,
                 count: torch.Tensor) -> None:
        """Put expert ``ids[i]`` into slot ``slots[i]`` for ``i < count``: evict the slot's
        holder, update the maps, copy the weights."""
        e, s = self.experts, self.slots
        valid = self._positions < count
        old = self.expert_in[slots]
        self.slot_of.index_fill_(0, torch.where(valid & (old >= 0), old, e), -1)
        self.slot_of.index_copy_(0, torch.where(valid, ids, e), slots)
        self.expert_in.index_copy_(0, torch.where(valid, slots, s), ids)
        self.last_used.index_copy_(0, torch.where(valid, slots, s), self.clock.expand(s))
        if self.trace is not None:
            n = int(count)
            self.trace.append(ExpertOp("install", self.trace_stream(), tuple(
                zip(ids[:n].tolist(), slots[:n].tolist()))))
        for name, w in self.weights.items():
            fetch_experts(self.host[name], w, ids, slots, count.reshape(1), self.programs)

    def _traced_read(self, expert_map: torch.Tensor, kind: str = "read") -> torch.Tensor:
        if self.trace is not None:
            named = (expert_map >= 0).nonzero().flatten()
            self.trace.append(ExpertOp(kind, self.trace_stream(), tuple(
                zip(named.tolist(), expert_map[named].tolist()))))
        return expert_map

    def _traced_forget(self) -> None:
        if self.trace is not None:  # every slot empty (Note [Expert lane hazards])
            self.trace.append(ExpertOp("forget", self.trace_stream()))

    def traced_wait(self, on: object) -> None:
        """Record in the trace that the current stream now waits for stream ``on``."""
        if self.trace is not None:
            self.trace.append(ExpertOp("wait", self.trace_stream(), on=on))

    def trace_stream(self) -> object:
        """The current stream as the trace names it: its handle, or ``cpu``."""
        return (torch.cuda.current_stream(self.device).cuda_stream
                if self.device.type == "cuda" else "cpu")

    def holding(self) -> dict[int, int]:
        """slot → expert it holds (a host sync): where a step's trace starts."""
        return {s: e for s, e in enumerate(self.expert_in[:self.slots].tolist()) if e >= 0}

    def lend(self) -> None:
        """Empty every slot, its weights left as they are, stream-ordered like a step: the
        layer ring writes another layer's experts there (Note [Ring lends the carried layers'
        slots]), and the next steps install over them as over empty slots."""
        self._traced_forget()
        self.generation += 1
        self.slot_of.fill_(-1)
        self.expert_in.fill_(-1)
        self.last_used.fill_(-1)
        self.predicted.zero_()

    def drop(self, slots: list[int]) -> None:
        """Empty ``slots`` (their weights left as they are, least recently used from now),
        stream-ordered like a step: an expert arena writes another layer's experts there
        (Note [Large steps stream through the slots]). Not a new generation: the arena keeps
        its own record of what it wrote."""
        if not slots:
            return
        if self.trace is not None:
            self.trace.append(ExpertOp("drop", self.trace_stream(), tuple((-1, s) for s in slots)))
        at = device_ints(slots, self.device)
        self._evict(at)
        self.expert_in.index_fill_(0, at, -1)

    def adopt(self, pairs: list[tuple[int, int]]) -> None:
        """Enter expert ``e`` in slot ``s`` for each ``(s, e)`` (none held elsewhere here; the
        slot's holder, if any, evicted), least recently used: an expert arena copies them
        there (Note [Large steps stream through the slots]), and the small steps after it
        wait for that copy."""
        if not pairs:
            return
        at = device_ints(pairs, self.device)
        slots, experts = at[:, 0], at[:, 1]
        self._evict(slots)
        self.expert_in.index_copy_(0, slots, experts)
        self.slot_of.index_copy_(0, experts, slots)

    def _evict(self, slots: torch.Tensor) -> None:
        """The holders of ``slots`` leave the expert -> slot map; the slots become least
        recently used."""
        old = self.expert_in[slots]
        self.slot_of.index_fill_(0, torch.where(old >= 0, old, self.experts), -1)
        self.last_used.index_fill_(0, slots, -1)

    def forget(self) -> None:
        """Empty every slot (poisoned): the host copies changed, so nothing cached is current.
        Stream-ordered like a step; the next step fetches what it needs."""
        self.lend()  # every table entry empty, a new generation
        for w in self.weights.values():
            poison(w)

    def describe(self) -> dict:
        """The layout and the counters so far (one host sync): what a dump or a report shows."""
        hits, misses = int(self.hits), int(self.misses)
        return {"experts": self.experts, "slots": self.slots,
                "slot_bytes": self.bytes // self.slots, "device": str(self.device),
                "host": {name: ("cuda view of pinned host memory" if t.is_cuda else
                                "pinned host copy" if t.is_pinned() else "host copy")
                         for name, t in self.host.items()},
                "hits": hits, "misses": misses, "in_place_tokens": self.in_place_tokens,
                "whole_in_place": self.whole_in_place,
                "in_place_steps": int(self.in_place_steps),
                "planned_steps": int(self.planned),  # Note [One kernel plans the step]
                "host_computed": int(self.host_computed),
                **({"lookahead": dict(zip(("predicted", "chosen", "installed"),
                                          self.predictions.tolist()))}
                   if self.looked_ahead else {}),
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}

    def hit_rate(self) -> float | None:
        """Share of the needed experts found in a slot since the cache was made (host sync)."""
        hits, misses = int(self.hits), int(self.misses)
        return hits / (hits + misses) if hits + misses else None


def simulate_hit_rate(experts: int, top_k: int, slots: int, tokens: int, steps: int, zipf: float,
             seed: int = 0) -> tuple[float, float]:
    """(hit rate, mean distinct experts per step) of the cache's own eviction over ``steps``
    steps of Zipf-routed tokens (Note [Expert lane model] in orchestrator/expert_model.py); the first ``4 * experts / top_k``
    steps warm the cache and are not counted."""
    if zipf < 0:
        raise ConfigError(f"zipf must be >= 0 (0: uniform routing), got {zipf}")
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -zipf
    weights = weights[torch.randperm(experts, generator=g)]  # popular experts anywhere
    cache = ExpertCache({"w": torch.zeros(experts, 1, dtype=torch.int32)}, slots, "cpu")
    warm = math.ceil(4 * experts / top_k)
    distinct = 0
    for step in range(warm + steps):
        if step == warm:
            cache.hits.zero_()
            cache.misses.zero_()
        ids = torch.stack([torch.multinomial(weights, top_k, generator=g)
                           for _ in range(tokens)])
        for _ in cache.serve(ids):
            pass
        if step >= warm:
            distinct += ids.unique().numel()
    return cache.hit_rate() or 0.0, distinct / steps
