"""A decode step's expert-cache bookkeeping in one kernel: the ~45 small torch ops of pass 0.

Note [One kernel plans the step]
    Pass 0 of an expert cache's step (Note [Expert cache], steps 1 to 3) decides on the device
    which experts the step needs, which are cached, which slots are least recently used, what
    to install where, and the expert->slot map its MoE reads. In torch that is about 45 small
    kernels per layer per step (77 torch calls with the views, counted with torch's profiler
    on the CPU for 128 experts, 64 slots, one token), each a few microseconds under a CUDA
    graph: at batch 1 with two cached layers (held layers, 4
    layers of Qwen3-30B-A3B's shape), a few tenths of a millisecond of a 2.3 ms step, about
    the gap to vLLM's UVA offloader, which does no bookkeeping (measured 0.91x on an H100).
    This kernel does the same in one program:

    * ``needed``: every choice compared with every expert, in chunks of the step's choices;
    * ``used``: a slot whose holder is needed; stamped with the step's clock;
    * victims: the slots by (used last, then least recently used, then index): a sort of one
      key per slot, ``(stamp + 1) * BS + slot``, which is the torch path's stable argsort;
    * the i-th missed expert (by index) goes to the i-th victim, for ``i < count = min(misses,
      slots - used)``: each missed expert's rank is its exclusive prefix count;
    * the tables' new values (``slot_of``, ``expert_in``, ``last_used``), the map and the
      scalars (the clock, the counters, the steps planned) are computed in registers from the
      old ones and stored once each, after every load and a barrier: each warp loads what it
      needs itself, so a store before another warp's load of the same word (the clock, read by
      every warp) would be read back;
    * the installs for the fetch (Note [Device-indexed expert fetch]): ``ids[i]``,
      ``slots[i]`` for ``i < count`` and ``count``, where the torch path passes the same.

    * with a host share (Note [Host split]): each expert's tokens counted with ``needed``;
      of the misses, the ``(misses x share + 512) // 1024`` with the fewest tokens (ties by
      index: each miss's rank by comparison with every other) are the host's
      (``host_mine``), and only the others are installed. The cache calls the host's stage
      after this kernel and before the fetch, so the host's work still overlaps the copies.

    Same results as the torch path to the element (the tables, the stamps, the clock, the
    counters, the host's experts, the installs and the map; a CPU test runs this kernel in
    Triton's interpreter against it, step after step). It serves the common decode step
    only: one pass, no lookahead scoring; other steps take the torch path. Sizes: up to
    ``MAX_EXPERTS`` experts (its matrices are experts x slots in registers). Off unless
    ``RINGFLOW_EXPERT_PLAN_KERNEL=1``. On an H100 (``logs/pytest-cuda-units-plan-early-nvtx-
    h100-3f10879.log``, ``logs/pytest-cuda-experts-host-arena-plan-h100-3f10879.log``) the
    compiled kernel plans as the torch path and the engine cases with it give all-resident's
    bits; batch-1 decode with held layers ran 1.02x the torch path's (329.3 [329.1-332.3]
    against 323.7 [317.3-328.1] tok/s, ``experts-bench-4l-held-plan-uva-h100.json``): less
    than the kernel count suggested.
"""

from __future__ import annotations

import torch

from ringflow.errors import KernelError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

MAX_EXPERTS = 256  # DeepSeek-V3's routed experts; an experts x slots matrix per program
CHUNK = 32  # choices compared with every expert at a time
#: a used slot's key: after every stamp a clock reaches (2**40 steps)
USED = 1 << 40

if triton is not None:
    @triton.jit(do_not_specialize=["choices", "share"])  # one compile for every step size
    def _plan_kernel(topk, choices, share, slot_of, expert_in, last_used, clock, hits, misses,
                     planned, host_mine, host_computed, ids_out, slots_out, count_out, map_out,
                     E: tl.constexpr, S: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr,
                     CHUNK: tl.constexpr, USED: tl.constexpr):
        e = tl.arange(0, BE)
        s = tl.arange(0, BS)
        in_e = e < E
        in_s = s < S
        # 1. the experts any choice names (a -1 choice names none)
        tokens = tl.zeros([BE], dtype=tl.int32)  # the choices naming each expert
        for start in range(0, choices, CHUNK):
            c = start + tl.arange(0, CHUNK)
            ids = tl.load(topk + c, mask=c < choices, other=-1)
            tokens += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
        need = (tokens > 0) & in_e
        # every load before any store: each warp loads for itself, and a store another warp
        # made first would be read back (the stores all come last, after a barrier)
        old_slot = tl.load(slot_of + e, mask=in_e, other=-1)
        holder = tl.load(expert_in + s, mask=in_s, other=-1)
        stamp = tl.load(last_used + s, mask=in_s, other=0)
        clk = tl.load(clock) + 1
        hit_total = tl.load(hits)
        miss_total = tl.load(misses)
        steps = tl.load(planned)
        handed = tl.load(host_computed)
        cached = old_slot >= 0
        miss = need & (old_slot < 0)
        miss_count = tl.sum(miss.to(tl.int64), axis=0)
        hit_total += tl.sum((need & cached).to(tl.int64), axis=0)
        miss_total += miss_count
        # 1b. the host's share (Note [Host split]): of the misses, the round(share/1024 x
        # misses) with the fewest tokens (ties by index) are the host's, not installed
        take = (miss_count * share + 512) // 1024
        fewest = tokens.to(tl.int64) * BE + e  # a miss's key: its tokens, then its index
        before = (miss[None, :] & (fewest[None, :] < fewest[:, None])).to(tl.int64)  # [BE, BE]
        mine = miss & (tl.sum(before, axis=1) < take)
        miss = miss & ~mine
        miss_count -= take
        handed += take
        # 2. slots whose holder is needed, stamped; the others are victims, oldest first
        held_needed = (holder[None, :] == e[:, None]) & need[:, None]  # [BE, BS]
        used = (tl.max(held_needed.to(tl.int32), axis=0) > 0) & in_s
        stamp = tl.where(used, clk, stamp)
        key = tl.where(used, USED, stamp + 1)
        key = tl.where(in_s, key, USED + 1)
        order = tl.sort(key * BS + s)  # stable: ties by slot index
        victim = (order % BS).to(tl.int64)  # position j -> its slot
        count = tl.minimum(miss_count, S - tl.sum(used.to(tl.int64), axis=0))
        # 3. the i-th missed expert (by index) into the i-th victim, i < count
        rank = tl.cumsum(miss.to(tl.int64), axis=0) - miss.to(tl.int64)  # [BE]
        installed = miss & (rank < count)
        j = tl.arange(0, BS)
        at = (rank[:, None] == j[None, :]) & installed[:, None]  # [BE, BS]: e at position j
        new_slot = tl.sum(tl.where(at, victim[None, :], 0), axis=1)  # [BE]
        pos_expert = tl.sum(tl.where(at, e[:, None].to(tl.int64), 0), axis=0)  # [BS]
        pos_valid = j < count
        # per slot: its position among the victims, and whom it gets
        slot_pos = tl.sum(tl.where(victim[:, None] == s[None, :], j[:, None], 0), axis=0)
        taken = (slot_pos < count) & in_s  # [BS] by slot
        gets = tl.sum(tl.where((victim[:, None] == s[None, :]) & pos_valid[:, None],
                               pos_expert[:, None], 0), axis=0)  # [BS] by slot
        evicted = tl.max(((holder[None, :] == e[:, None]) & taken[None, :]
                          & (holder[None, :] >= 0)).to(tl.int32), axis=1) > 0  # [BE]
        # 4. the tables, the map and the scalars, each stored once, after every load
        slot_now = tl.where(installed, new_slot, tl.where(evicted, -1, old_slot))
        tl.debug_barrier()
        tl.store(slot_of + e, slot_now, mask=in_e)
        tl.store(expert_in + s, tl.where(taken, gets, holder), mask=in_s)
        tl.store(last_used + s, tl.where(taken, clk, stamp), mask=in_s)
        tl.store(map_out + e, tl.where(need, slot_now, -1), mask=in_e)
        tl.store(ids_out + j, pos_expert, mask=j < S)
        tl.store(slots_out + j, victim, mask=j < S)
        tl.store(count_out, count)
        tl.store(clock, clk)
        tl.store(hits, hit_total)
        tl.store(misses, miss_total)
        tl.store(planned, steps + 1)
        marks = in_e & ((tl.zeros([BE], dtype=tl.int32) + share) > 0)  # as the torch path:
        tl.store(host_mine + e, mine, mask=marks)  # only a step with a share marks
        tl.store(host_computed, handed)


def available(device: torch.device, experts: int) -> bool:
    """Whether the kernel serves a cache of ``experts`` experts on ``device``: a GPU with
    Triton (on the CPU the torch path runs, except under Triton's interpreter in tests)."""
    return why_not(device, experts) is None


def why_not(device: torch.device, experts: int) -> str | None:
    """Why the kernel cannot serve a cache of ``experts`` experts on ``device``, or None."""
    if device.type != "cuda":
        return f"the experts compute on {device.type}; the kernel plans GPU caches"
    if triton is None:
        return "Triton is not installed"
    if experts > MAX_EXPERTS:
        return f"a layer of {experts} experts is more than its {MAX_EXPERTS}"
    return None


class PlanBuffers:
    """The kernel's outputs for one cache, allocated once (a captured step holds their
    addresses): the installs (``ids``, ``slots``, ``count``) and the map."""

    def __init__(self, experts: int, slots: int, device: torch.device) -> None:
        if experts > MAX_EXPERTS:
            raise KernelError(f"the step-plan kernel serves up to {MAX_EXPERTS} experts, not "
                              f"{experts}")
        self.ids = torch.zeros(slots, dtype=torch.int64, device=device)
        self.slots = torch.zeros(slots, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.map = torch.full((experts,), -1, dtype=torch.int64, device=device)


def plan_step(topk_ids: torch.Tensor, slot_of: torch.Tensor, expert_in: torch.Tensor,
              last_used: torch.Tensor, clock: torch.Tensor, hits: torch.Tensor,
              misses: torch.Tensor, planned: torch.Tensor, host_mine: torch.Tensor,
              host_computed: torch.Tensor, out: PlanBuffers, share: int = 0) -> None:
    """Pass 0 of a one-pass step (Note [One kernel plans the step]) over a cache's tables
    (``slot_of`` [experts + 1], ``expert_in`` and ``last_used`` [slots + 1], the 0-dim
    ``clock``, ``hits``, ``misses`` and ``planned``, the steps it planned), updated in place;
    with ``share`` (of 1024) the host's experts marked in ``host_mine`` and counted in
    ``host_computed`` (Note [Host split]); the installs and the map in ``out``. One program,
    on the current stream, no host sync."""
    if not 0 <= share <= 1024:
        raise KernelError(f"a host share is 0..1024 of 1024, got {share}")
    experts, slots = slot_of.shape[0] - 1, expert_in.shape[0] - 1
    if topk_ids.dtype.is_floating_point:
        raise KernelError(f"topk_ids must be integers, got {topk_ids.dtype}")
    flat = topk_ids.reshape(-1)  # int32 (vLLM's) or int64, read as they are: no conversion
    if flat.stride(0) != 1:  # a view of strided ids: the kernel reads them one after another
        flat = flat.contiguous()
    block_e = triton.next_power_of_2(experts)
    block_s = triton.next_power_of_2(slots)
    _plan_kernel[(1,)](flat, flat.shape[0], share, slot_of, expert_in, last_used, clock, hits,
                       misses, planned, host_mine, host_computed, out.ids, out.slots,
                       out.count, out.map,
                       E=experts, S=slots, BE=block_e, BS=block_s, CHUNK=CHUNK, USED=USED,
                       num_warps=4 if block_e * block_s <= 8192 else 8)
