#!/usr/bin/env python3
"""A large step's time through the expert arena, from the arena's own trace, on the CPU: where a
layout's copies wait for compute, before a GPU is lent to measure it.

    python3 tools/arena_timeline.py [--slots 128,42,42,42,128,42,42,42] [--layer-ms 1.8]
                                    [--expert-ms 0.172] [--ahead 4] [--host-ms 0] [--engine]
                                    [--gpu [--gpu-trace FILE] [--ints-by-copy]] [--json FILE]

``--gpu`` runs the same lane on a GPU, real experts and a stand-in layer, beside the replay.

Note [Arena timeline]
    ExpertArena's trace (Note [Large steps stream through the slots]) holds every ordering a
    large step has: ``place`` on the copy stream, ``read`` on the compute stream, the ready and
    retire events each records and the other waits for. Replayed on two streams, a place
    taking ``expert_ms`` per expert and a layer's first read ``layer_ms``, it gives the step's
    time where copies and kernels run at those rates and nothing else waits. This tool runs
    the lane on the CPU (real expert counts, tiny experts: the arena copies every expert a
    position lacks whatever the routing), after two warm steps and a few decode steps, traces a
    lone large step and four back to back, and replays both. vLLM's prefetch offloader with
    the same device memory is the same replay over its own rule: ``ahead`` buffers over the
    offloaded layers in order, the first ``ahead`` of them copied before a lone step (while
    the GPU idles), each later copy starting once the previous copy is done and the layer
    that last used its buffer retired.

    Checked against the H100's bench (trees ``2f0bb92`` and ``7cc1b8b``, whose fills copied
    every row after all its readers retired; the defaults: an expert of Qwen3-30B-A3B, 9.4 MB
    at the pinned rate, an 8k-token layer's compute a guess, 1.8 ms), with that order
    replayed: at 8 layers (``128,42,42,42,128,42,42,42`` against every layer offloaded, four
    ahead) the model gives a lone step 0.90x the prefetch offloader (measured 0.89x) and
    chunks 1.38x (measured 1.34x); at 4 layers (``128,64,128,64`` against every other layer
    offloaded, one ahead) 0.89x and 1.10x, where the bench measured 1.01x and 1.32x: right
    at 8 layers, pessimistic at 4 (what the offloader's own steps cost beside its copies is
    not modeled). Use it to compare the arena's layouts and orders with each other, not to
    promise a ratio. What it showed at 8 layers: every half layer's fill went into rows the
    layer before it reads, so the lone step's copies and computes alternated (the copy
    engine idled for each layer's compute), where the offloader's four buffers keep its
    copy engine busy. Copying a fill's rows that no read holds before waiting (the order
    since) gives 27.4 ms against 30.9 for the 4-layer lone step and 35.1 against 38.7 per
    chunk, and at 8 layers nothing (every row such a fill took was read by the layer
    before). Since a fill also takes the whole first layer's rows that the layer before
    does not read before those it reads (Note [Large steps stream through the slots], step
    2), the 8-layer lone step takes 93.9 ms where it took 101.1 (0.97x the offloader's
    91.5; whole layers 0 and 1, ``128,128,43,43,43,43,42,42``: 91.5, 1.0x), chunks 109.1
    against 112.2; the 4-layer layouts' traces are the same.

    The lone step is also replayed after prompts that each ended at their first token
    (``lone_trace(slots, "prompt")``; the H100 bench's cells without decode windows ran so,
    a prompt after the previous one and its token): the arena's rank that took the rows of
    the layer that ran last left layer 2 of ``128,64,128,64`` to copy its lent rows back
    between layers 1 and 3, 34.0 ms against 27.4 after decode; taking the earliest layer's
    rows, which the tail gives back (the rank since), gives 27.4 both ways, and 35.6 ms per
    chunk against 35.1. With it (tree ``1e011cf``) the model gives 4 layers 1.0x / 1.19x the
    offloader where the H100 measured 1.03x / 1.32x, each prompt after a 16-token decode:
    pessimistic at 4 layers still. At 8 layers it was not right after all: the H100
    measured that lone step at ``0b7744e`` (one round) 125 ms against the replay's 94 (the
    offloader: 100 against 92), 0.80x where the replay gave 0.97x. vLLM's own engine
    (vLLM-CPU, ``--engine``: its ``execute_model`` early start, the forward's layers, after
    real prompts and sampled decode) drives the arena into a trace that replays to the same
    93.9 ms and 644 copies as ``lone_trace``'s (tested), so the miss was in how the GPU runs
    that order. ``--gpu`` (``gpu_times``) runs the same lane on a GPU without vLLM, real
    experts in pinned memory and a stand-in layer of ``--layer-ms``: on an H100 at 2.9 ms a
    layer, its lone step took 117.8-118.0 ms against 97.2 replayed, its profile the copy
    engine busy to the end and the compute stream held 19 ms past the last layer by a small
    map write that a copy engine served after the queued experts (Note [Small writes beside
    bulk copies]); with those writes done by a kernel 98.8-99.0 ms (chunks 112.3 against
    117.7), and the replay right again. The 8-layer bench then measured 0.96x (five rounds,
    tree ``dbb748f``), what the replay gives at ``--layer-ms 2.9`` (0.963x). At that rate
    the 8-layer layouts of the bench's memory with two whole layers first (``128,128`` then
    ``43,43,43,43,42,42``, ``64,64,32,32,32,32``, ``80,60,40,30,24,22`` or
    ``128,26,26,26,25,25``) replay 93.7 ms, the offloader's own time (1.0x; chunks 1.44x;
    ``86,86,40,40,2,2`` 96.2 ms): both copy the 512 experts the device does not hold inside
    the step, so 1.0x is the lone step's ceiling at this memory. The bench's front layout as
    it ran at ``05e7abc`` (``128,128`` then six of 42: four rows fewer than the peers') replays
    94.3 ms (0.993x); on the H100 the lane alone took 95.5-96.3 ms and vLLM's engine 0.97x
    the offloader (five rounds): of the 3% left, the replay holds 0.6%, the lane on the GPU
    1.4% and vLLM around it about 1.3%. The bench gives its whole layouts those four rows since (``whole_layers``).

    Until December 2026 ``lone_trace`` warmed the lane with one large step, from empty
    slots: that step may leave a whole layer's experts in other layers' empty rows, which
    the small steps after it copy back a miss at a time, so the lone step measured a
    transient (``128,43,43,43,128,43,42,42``: 102.7 ms, 96.6 from a steady state). It warms
    with two since; every layout named above replays as before, but the 4-layer lone step's
    27.4 against 30.9 for copying the rows no read holds first was that transient's: from a
    steady state both orders replay 27.4 ms at 4 layers; at 8 layers the order gives 94.2 ms
    against 101.4 (``128,42,42,42,128,42,42,42``).

    With those four rows (``128,128,43,43,43,43,42,42``, tree ``7623a46``) vLLM's engine on
    an H100 still gave 0.96x (78,034 [76,266-80,323] tok/s against 81,442 [80,649-82,615],
    five rounds, ``experts-trace-8l-front-h100.json``), the replay 1.0x. Its torch.profiler
    trace of one lone prompt showed where the rest went: not on the GPU's streams but on the
    host. The lane's ``prepare`` and vLLM's input preparation left the GPU idle 7.2 ms before
    the embedding (the offloader's engine: 3.1); the host then issued the first layers slower
    than the GPU ran them (the lane's MoE call 3.3 and 6.3 ms of host time where the
    offloader's takes 1.2-1.4, both under the profiler), and layer 2's fill, issued after
    layer 1's read, started the copy engine 18.3 ms into the step where the offloader's
    first copy started at 7.3; from there both are copy-bound (512 experts, 88 ms at the
    pinned rate). The replay took the host to be never behind; ``--host-ms`` (``replay``'s
    and ``offloader``'s ``host_ms``) has it issue one layer per that many ms, and nothing
    starts before it is issued. At 5 ms a layer the front layout replays 100.8 ms against the
    offloader's 98.7 where layer 2's fill waited for layer 1's read, and 98.7 (1.0x) since it
    follows layer 0's (Note [Large steps stream through the slots], step 2b); at 3 ms, 96.8
    and 96.7. The lane's own host time per layer and before the step is not modeled (the
    model gives both engines the same ``host_ms``).

    Measured on an H100 (tree ``bd1fef9``, five rounds, ``experts-trace-8l-front-hostcut-h100
    .json``) with that order and two host cuts the trace had shown (the start no longer writes
    the whole layers' unchanged maps, 0.9 ms each there; a fill left for later is not tried
    again until a read moved, a scan of every row per ``begin``): the lone 8k prompt 82,109
    [79,548-82,324] tok/s, **0.99x** the offloader's 82,946 [82,574-82,993]; block fp8 1.00x
    (ranges overlap, ``experts-bench-8l-front-fp8block-h100.json``). Its profiled prompt, with
    ringflow's ranges in the trace (``RINGFLOW_TORCH_RANGES``): the embedding 3.4 ms after
    vLLM's ``execute_model`` began (the offloader's 2.8; at ``7623a46`` 10.3 against 3.9), the
    lane's prepare 1.0 ms, its MoE calls 0.8-1.1 ms of host time a layer, and the first copy
    7.2 ms into the GPU's window against 5.6 (18.3 against 7.3). What is left of the gap is
    that 1.6 ms, about the step's 1%: layer 0 retires later (the embedding later, and its
    MoE call a little slower over the arena's map), and copying earlier cannot help at this
    memory (every row is held at the step's start; a row taken from a later layer costs that
    layer one more copy, what the earlier start gains).

    Then (tree ``d78e563``, H100, five rounds, ``experts-trace-8l-front-kernelcut-h100.json``)
    the start read the slot tables with one copy, a fill found the rows it keeps from its
    tables and records, and the kernel's select over [tokens, top_k, hidden] left a step's
    only pass (Note [Same bits as resident], rule 5: 8 kernels of 0.36 ms in that trace): the
    lone 8k prompt 79,614 [74,711-80,689] tok/s, **0.99x** the offloader's 80,104
    [51,669-82,123] in a noisier run (ranges overlap). The traced prompt, aligned at vLLM's
    first input copy, has the lane's GPU work level with the offloader's (layer 0's first MoE
    kernel 4.35 ms after it against 4.84, the first bulk copy 5.93 against 6.42, the last
    kernel ending 97.97 against 98.15); wall 106.05 ms against 104.41. The difference is the
    prepare (Note [Large steps start early]) before vLLM prepares the step: 0.95 ms of host
    time, its table read's kernel 1.25 ms before vLLM's first input copy, in a layout that
    has nothing to copy before layer 0 retires.

    That prepare costs the step nothing measurable. Tried (tree ``6196e9f``, reverted after
    the run): without ``early_start`` vLLM's ``execute_model`` only issued the tables' copy
    to the host, and the step started at layer 0's MoE from it, with no sync there. One H100,
    five interleaved rounds, 8 layers, this layout, a lone 8k prompt after a 16-token decode
    (``experts-bench-8l-front-readahead-h100.json``): with ``early_start`` 83,353
    [83,151-83,583] tok/s, the start at layer 0 with the tables read ahead 83,120
    [80,289-83,304] (0.997x; per round 0.997, 1.000, 1.000, 0.999, 0.961), every read ahead
    used (11 of 11), the same 120 fills and 8,227 experts copied; the arena's units and its
    12 engine cases passed with it (the bits of ``bd1fef9``). The 0.95 ms of host time before
    vLLM prepares the inputs overlaps nothing that ends the step sooner: the step's end is
    set by the copies from layer 0's retire on. The code went back out (it gained nothing and
    added a third way to start a step); what is left of the 0.99x is a few hundred tok/s
    (ranges overlapping at ``d78e563``, 251 tok/s apart at ``bd1fef9``), at the 1.0x
    ceiling this memory allows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from experts_bench import EXPERT_BYTES, QWEN3_A3B, prefetch_layout  # noqa: E402

from ringflow.bench import records  # noqa: E402
from ringflow.errors import ConfigError  # noqa: E402
from ringflow.graphs.streams import dedicated_streams  # noqa: E402
from ringflow.integrations.torch.expert_arena import ExpertArena, arena_rows  # noqa: E402
from ringflow.integrations.torch.expert_cache import ExpertCache  # noqa: E402
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute  # noqa: E402
from ringflow.orchestrator.expert_model import PINNED_GBPS  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 8, 4
LARGE = 16  # the lane's layer_tokens: a step of this many tokens is large


def replay(ops, expert_ms: float, layer_ms: float, host_ms: float = 0.0) -> float:
    """The time at which the traced ops' last read ends: places cost ``expert_ms`` per expert
    on their stream, a position's first read ``layer_ms`` (its later reads are the same
    kernel over other rows), records stamp events, waits take the latest of their stream and
    the event (or the other stream, where the wait names one). ``host_ms``: the host takes
    that long to issue each layer (its first read and what follows it until the next
    layer's are issued that much later than the layer before's), and nothing runs before
    it is issued."""
    clock = {"copy": 0.0, "compute": 0.0}
    events: dict[object, float] = {}
    end, read, host = 0.0, None, 0.0
    for op in ops:
        if op.kind == "read" and read != op.on:
            host += host_ms
        clock[op.stream] = max(clock[op.stream], host)
        if op.kind == "wait":
            clock[op.stream] = max(clock[op.stream], clock[op.on] if op.on in clock
                                   else events.get(op.on, 0.0))
        elif op.kind == "record":
            events[op.on] = clock[op.stream]
            if op.stream == "compute" and op.on[0] == "retired":
                read = None  # the next read of any position is a new layer
        elif op.kind == "place":
            clock[op.stream] += expert_ms * len(op.pairs)
        elif op.kind == "read":
            if read != op.on:
                clock[op.stream] += layer_ms
                read = op.on
            end = max(end, clock[op.stream])
    return end


def offloader(layers: int, offloaded: list[int], ahead: int, expert_ms: float,
              layer_ms: float, steps: int, host_ms: float = 0.0) -> float:
    """vLLM's prefetch offloader over ``steps`` back to back steps (Note [Arena timeline]):
    when the last step's last layer ends. Its ``k``-th copy (offloaded layers in order, step
    after step) starts once copy ``k - 1`` is done and copy ``k - ahead``'s layer, the last
    user of its buffer, retired and was issued (the copy is issued after it); the first
    ``ahead`` are done before the first step. ``host_ms`` as ``replay``'s: the host issues
    each layer that much after the one before."""
    order = [(s, i) for s in range(steps) for i in offloaded]
    index = {key: k for k, key in enumerate(order)}
    ready = dict.fromkeys(order[:ahead], 0.0)
    retired, issued, copy_end, clock = {}, {}, 0.0, 0.0
    for s in range(steps):
        for i in range(layers):
            issued[(s, i)] = (s * layers + i + 1) * host_ms
            k = index.get((s, i))
            if k is not None and k >= ahead:  # its buffer's last user ran before it
                last = order[k - ahead]
                copy_end = max(copy_end, retired[last], issued[last]) + EXPERTS * expert_ms
                ready[(s, i)] = copy_end
            clock = max(clock, ready.get((s, i), 0.0), issued[(s, i)]) + layer_ms
            retired[(s, i)] = clock
    return clock


def arena_lane(slots: list[int], device: str = "cpu", hidden: int = HIDDEN, inter: int = INTER,
               compute=None) -> ExpertLane:
    """The arena over ``slots`` per layer, experts of real count: on the CPU tiny ones (random),
    on a GPU ``hidden`` x ``inter`` ones in pinned host memory (left unset: ``gpu_times``
    times copies and waits, not values), computed by ``compute()`` per layer."""
    cuda = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(0)
    if cuda:  # one pinned block per parameter, a layer's store a slice of it
        w13 = torch.empty(len(slots), EXPERTS, 2 * inter, hidden, dtype=torch.bfloat16,
                          pin_memory=True)
        w2 = torch.empty(len(slots), EXPERTS, hidden, inter, dtype=torch.bfloat16,
                         pin_memory=True)
        hosts = [{"w13": w13[i], "w2": w2[i]} for i in range(len(slots))]
    else:
        hosts = [{"w13": torch.randn(EXPERTS, 2 * inter, hidden, generator=g),
                  "w2": torch.randn(EXPERTS, hidden, inter, generator=g)} for _ in slots]
    rows, views = arena_rows(hosts[0], slots, device)
    caches = {i: ExpertCache(h, n, device, rows=v)
              for i, (h, n, v) in enumerate(zip(hosts, slots, views))}
    stream = (dedicated_streams(caches[0], caches[0].device, ["arena-timeline-copy"],
                                priority=0)["arena-timeline-copy"] if cuda else None)
    arena = ExpertArena(list(caches.values()), rows, stream)
    make = compute or TorchCompute
    return ExpertLane(caches, {i: make() for i in caches}, arena, layer_tokens=LARGE,
                      early_start=True)


def inputs(lane: ExpertLane, tokens: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """One step's (tokens, routing weights, expert ids) per layer, on the lane's device."""
    g = torch.Generator().manual_seed(seed)
    cache = next(iter(lane.caches.values()))
    hidden, device = cache.weights["w13"].shape[2], cache.device
    dtype = cache.weights["w13"].dtype
    out = []
    for _ in sorted(lane.caches):
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
        out.append((torch.randn(tokens, hidden, generator=g).to(device, dtype),
                    weights.to(device), ids.to(device)))
    return out


def step(lane: ExpertLane, tokens: int, seed: int, made: list | None = None) -> None:
    """One step of every layer; ``made``: its ``inputs``, already on the device (a GPU's
    timing then holds no host-to-device copy of them, as vLLM's steps do not)."""
    for i, args in zip(sorted(lane.caches), made or inputs(lane, tokens, seed)):
        lane.forward(i, *args)


def lone_trace(slots: list[int], after: str = "decode") -> tuple[ExpertLane, list]:
    """The lane over ``slots`` after two warm large steps and then ``after``: ``decode``
    (eight small steps) or ``prompt`` (three lone large steps, each followed by one small
    step: prompts that end at their first token), and the trace of one lone large step after
    them. Two: the first, from empty slots, is a transient (Note [Arena timeline]); in
    vLLM its profile run is that step, before any request."""
    if after not in ("decode", "prompt"):
        raise ConfigError(f"lone_trace: after is decode or prompt, not {after!r}")
    lane = arena_lane(slots)
    step(lane, LARGE, 0)  # the whole layers' slots fill
    step(lane, LARGE, 1)
    for s in range(1, 9 if after == "decode" else 4):
        if after == "prompt":
            step(lane, LARGE, 40 + s)
        step(lane, 1 + s % 2, s)
    lane.ring.trace = ops = []
    step(lane, LARGE, 20)
    return lane, ops


def engine_trace(slots: list[int], prompt: int = 512, layer_tokens: int = 256) -> list:
    """The trace of one lone large step as vLLM's own engine drives the lane, in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a model of ``len(slots)`` layers of 128 tiny
    experts (top-8, dummy weights), the arena over ``slots`` with ``early_start``, two rounds
    of a ``prompt``-token prompt and a 16-token sampled decode, then the prompt traced.
    ``lone_trace`` builds its trace by calling the lane itself; this checks that vLLM calls
    it in that order (its hooks: ``execute_model``'s early start, the forward's layers)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise ConfigError("engine_trace reads the lane in this process: set "
                          "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported")
    import tempfile

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.integrations.vllm.state import STATE
    from ringflow.testing.tiny_models import MODELS

    root = Path(tempfile.mkdtemp()) / "moe128"
    root.mkdir()
    cfg = {**MODELS["qwen3_moe128"], "num_hidden_layers": len(slots),
           "max_position_embeddings": prompt + 64}
    (root / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(root), load_format="dummy", skip_tokenizer_init=True, seed=0,
              dtype="float32" if not torch.cuda.is_available() else "bfloat16",
              max_model_len=prompt + 64, max_num_batched_tokens=prompt, max_num_seqs=4,
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
              additional_config={"ringflow": {"name": "arena-timeline", "experts": {
                  "layers": "all", "layer_buffers": "slots", "early_start": True,
                  "layer_tokens": layer_tokens,
                  "slots": {str(i): n for i, n in enumerate(slots)}}}})
    (lane,) = list(STATE.expert_lanes.values())
    vocab = cfg["vocab_size"] - 3
    long = [TokensPrompt(prompt_token_ids=[(j * 7919 + 3) % vocab + 3 for j in range(prompt)])]
    short = [TokensPrompt(prompt_token_ids=[(j * 17) % vocab + 3 for j in range(16)])]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    decode = SamplingParams(temperature=1, max_tokens=16, ignore_eos=True, detokenize=False,
                            seed=11)
    for _ in range(2):
        llm.generate(long, first, use_tqdm=False)
        llm.generate(short, decode, use_tqdm=False)
    lane.ring.trace = ops = []
    llm.generate(long, first, use_tqdm=False)
    lane.ring.trace = None
    return ops


def arena_times(slots: list[int], expert_ms: float, layer_ms: float,
                chunks: int = 4, host_ms: float = 0.0) -> dict[str, float]:
    """A lone large step after decode and one after prompts (``lone_trace``), and back to
    back ones: their copies and times."""
    _, after_prompt = lone_trace(slots, "prompt")
    lane, ops = lone_trace(slots)
    arena = lane.ring
    lone = {"lone_copies": sum(len(op.pairs) for op in ops if op.kind == "place"),
            "lone_ms": replay(ops, expert_ms, layer_ms, host_ms),
            "lone_after_prompt_ms": replay(after_prompt, expert_ms, layer_ms, host_ms)}
    arena.trace = ops = []
    before = arena.rows_from_host
    for s in range(chunks):
        step(lane, LARGE, 30 + s)
    return {**lone, "chunk_copies": (arena.rows_from_host - before) / chunks,
            "chunk_ms": replay(ops, expert_ms, layer_ms, host_ms) / chunks}


class LayerCompute:
    """A GPU stand-in for a large step's layer (attention and MoE at the prompt's tokens):
    matmuls over arena rows lasting about ``layer_ms`` (``calibrate``); small steps compute
    for real (``TorchCompute``), as their installs and reads are what they order."""

    reps = 0
    _x: torch.Tensor | None = None

    def __init__(self) -> None:
        self._small = TorchCompute()

    @classmethod
    def calibrate(cls, layer_ms: float, hidden: int, inter: int, device: torch.device) -> None:
        """Matmuls of an 8k-token prompt by one expert's gate and up, as many as ``layer_ms``
        takes on this GPU."""
        cls._x = torch.randn(8192, hidden, device=device, dtype=torch.bfloat16)
        w = torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        for _ in range(3):  # warm, then time 20
            cls._x @ w.T
        start.record()
        for _ in range(20):
            cls._x @ w.T
        end.record()
        end.synchronize()
        cls.reps = max(1, round(layer_ms / (start.elapsed_time(end) / 20)))

    def __call__(self, x, weights, topk_weights, topk_ids, expert_map, last=True,
                 host_rows=None):
        if x.shape[0] < LARGE:  # a small step
            return self._small(x, weights, topk_weights, topk_ids, expert_map, last, host_rows)
        w13 = weights["w13"]
        for k in range(self.reps):  # reads rows the fill wrote, as the layer's kernel does
            self._x @ w13[k % w13.shape[0]].T
        return torch.zeros_like(x)


def gpu_times(slots: list[int], layer_ms: float, rounds: int = 5, chunks: int = 4,
              trace: str | None = None, ints_by_copy: bool = False) -> dict:
    """The lane over ``slots`` on this GPU with Qwen3-30B-A3B's experts (9.4 MB, pinned) and a
    layer's compute of ``layer_ms`` (``LayerCompute``): each of ``rounds`` lone large steps
    after eight decode steps (as ``lone_trace``), timed on the compute stream from the step's
    first issue to the end of what it issued there, and ``chunks`` back to back; beside them,
    the replay of the same lane's trace at the pinned rate. Where the GPU's time exceeds the
    replay's, the GPU runs the lane's order slower than Note [Arena timeline] assumes;
    ``trace`` (a file) holds a torch.profiler trace of one lone step, its ``copy_gaps`` in the
    result. ``ints_by_copy``: the arena's small tables written through a copy engine, as
    until December 2026 (Note [Small writes beside bulk copies])."""
    from ringflow.bench.gpu_trace import copy_gaps, load
    from ringflow.integrations.torch import expert_arena, expert_cache

    device = torch.device("cuda")
    hidden, inter = QWEN3_A3B["hidden_size"], QWEN3_A3B["moe_intermediate_size"]
    LayerCompute.calibrate(layer_ms, hidden, inter, device)
    lane = arena_lane(slots, "cuda", hidden, inter, LayerCompute)
    compute = torch.cuda.current_stream()
    ints = expert_cache.device_ints_by_copy if ints_by_copy else expert_cache.device_ints
    saved = expert_cache.device_ints, expert_arena.device_ints
    expert_cache.device_ints = expert_arena.device_ints = ints

    def timed(made: list[list]) -> float:
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(compute)
        for m in made:
            step(lane, LARGE, 0, m)
        end.record(compute)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def decode(base: int) -> None:
        for s in range(1, 9):
            step(lane, 1 + s % 2, base + s)

    try:
        step(lane, LARGE, 0)  # the whole layers' slots fill
        lone, chunk, expert_ms = [], [], EXPERT_BYTES / PINNED_GBPS / 1e6
        for r in range(rounds):
            decode(100 * r)
            lone.append(timed([inputs(lane, LARGE, 20)]))
            decode(100 * r + 50)
            chunk.append(timed([inputs(lane, LARGE, 30 + c) for c in range(chunks)]) / chunks)
        decode(900)
        lane.ring.trace = ops = []  # traced apart: the trace reads each map to the host
        step(lane, LARGE, 20)
        lane.ring.trace = None
        out = {"gpu": torch.cuda.get_device_name(), "ints_by_copy": ints_by_copy,
               "layer_reps": LayerCompute.reps, "lone_ms": sorted(lone),
               "chunk_ms": sorted(chunk),
               "lone_replay_ms": round(replay(ops, expert_ms, layer_ms), 1),
               "lone_copies": sum(len(op.pairs) for op in ops if op.kind == "place")}
        if trace:
            decode(950)
            made = inputs(lane, LARGE, 20)
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                step(lane, LARGE, 20, made)
                torch.cuda.synchronize()
            prof.export_chrome_trace(trace)
            out["copy_gaps"] = copy_gaps(load(trace))
    finally:
        expert_cache.device_ints, expert_arena.device_ints = saved
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="128,42,42,42,128,42,42,42",
                        help="slots per chosen layer, in order (the arena's layout)")
    parser.add_argument("--expert-ms", type=float, default=EXPERT_BYTES / PINNED_GBPS / 1e6,
                        help="one expert's copy (default 9.4 MB at the pinned rate)")
    parser.add_argument("--layer-ms", type=float, default=1.8,
                        help="one layer's compute at the step's tokens (a guess for 8k)")
    parser.add_argument("--host-ms", type=float, default=0.0,
                        help="the host's time to issue one layer (0: the host is never behind; "
                             "vLLM's 8k prompt with the lane, on an H100 under torch.profiler: "
                             "4.7-7.7 ms a layer)")
    parser.add_argument("--ahead", type=int, default=None,
                        help="the prefetch offloader's buffers (default: the bench's "
                             "prefetch_layout for the same device memory)")
    parser.add_argument("--engine", action="store_true",
                        help="also trace the lone step as vLLM's engine drives the lane (in "
                             "this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) and replay it")
    parser.add_argument("--gpu", action="store_true",
                        help="also run the lane on this GPU with real experts and a stand-in "
                             "layer of --layer-ms, and time its lone steps and chunks beside "
                             "the replay of its own trace (gpu_times)")
    parser.add_argument("--gpu-trace", default=None,
                        help="with --gpu: a torch.profiler trace of one lone step, to this "
                             "file; its copy_gaps printed")
    parser.add_argument("--ints-by-copy", action="store_true",
                        help="with --gpu: also time the arena writing its small tables "
                             "through a copy engine (as until December 2026)")
    parser.add_argument("--json", default=None, help="write the result to this file")
    args = parser.parse_args(argv)
    slots = [int(s) for s in args.slots.split(",")]
    layers = len(slots)
    group, num, buffers = prefetch_layout(layers, math.ceil(sum(slots) / EXPERTS))  # its memory
    offloaded = [i for i in range(layers) if i % group >= group - num]
    ahead = args.ahead or buffers
    host = args.host_ms
    ours = arena_times(slots, args.expert_ms, args.layer_ms, host_ms=host)
    theirs = {"lone_ms": offloader(layers, offloaded, ahead, args.expert_ms, args.layer_ms, 1,
                                   host),
              "chunk_ms": offloader(layers, offloaded, ahead, args.expert_ms, args.layer_ms, 4,
                                    host) / 4}
    doc = {"slots": slots, "offloaded": offloaded, "ahead": ahead, "host_ms": host,
           "arena": ours,
           "offloader": theirs,
           "lone_vs_offloader": round(theirs["lone_ms"] / ours["lone_ms"], 3),
           "chunk_vs_offloader": round(theirs["chunk_ms"] / ours["chunk_ms"], 3)}
    if args.engine:
        ops = engine_trace(slots)
        doc["engine"] = {"lone_copies": sum(len(op.pairs) for op in ops if op.kind == "place"),
                         "lone_ms": replay(ops, args.expert_ms, args.layer_ms, host)}
    print(f"arena {slots}: lone step {ours['lone_ms']:.1f} ms ({ours['lone_copies']} experts "
          f"copied, its tail's too; after a prompt and its one token "
          f"{ours['lone_after_prompt_ms']:.1f} ms), chunk {ours['chunk_ms']:.1f} ms "
          f"({ours['chunk_copies']:.0f}); the prefetch offloader ({len(offloaded)} layers "
          f"offloaded, {ahead} ahead) {theirs['lone_ms']:.1f} / {theirs['chunk_ms']:.1f} ms: "
          f"x{doc['lone_vs_offloader']} lone, x{doc['chunk_vs_offloader']} chunks")
    if args.gpu:
        runs = [False, True] if args.ints_by_copy else [False]
        # not "gpu": the record (below) names the GPU there, and a list there overwrote it
        doc["on_gpu"] = [gpu_times(slots, args.layer_ms, trace=args.gpu_trace and (
            args.gpu_trace if not by_copy else args.gpu_trace.replace(".json", "-by-copy.json")),
            ints_by_copy=by_copy) for by_copy in runs]
        for g in doc["on_gpu"]:
            print(f"on {g['gpu']}{' (tables by copy engine)' if g['ints_by_copy'] else ''}: "
                  f"lone step {[round(t, 1) for t in g['lone_ms']]} ms (replayed "
                  f"{g['lone_replay_ms']}, {g['lone_copies']} experts copied), chunk "
                  f"{[round(t, 1) for t in g['chunk_ms']]} ms")
            for gap in (g.get("copy_gaps") or {}).get("gaps", []):
                print(f"  copy engine waits {gap}")
    if args.json:  # the record every benchmark writes: GPU, versions, commit, command
        records.write(args.json, records.record("python3 tools/arena_timeline.py", **doc))
    if "engine" in doc:
        print(f"vLLM's engine driving the same arena: lone step {doc['engine']['lone_ms']:.1f} ms "
              f"({doc['engine']['lone_copies']} experts copied)")
    return doc


if __name__ == "__main__":
    main()
