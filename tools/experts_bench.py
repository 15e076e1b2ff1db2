#!/usr/bin/env python3
"""Routed experts from host memory in vLLM's real engine: ringflow's expert lane vs its peers.

    python3 tools/experts_bench.py [--layers 4] [--rounds 5] [--only a,b] [--routings hard,easy]
                                   [--prefills 8192,32768] [--chunk 8192] [--batches 1,8,64]
                                   [--window 1] [--deadline S] [--fp8 block|tensor]
                                   [--deep-gemm-warmup skip] [--json FILE]

A Qwen3-30B-A3B-shaped MoE (hidden 2048, 128 experts of intermediate 768, top-8, bf16, dummy
weights: speed does not depend on values; ``--layers`` of its 48 layers; ``--fp8``: its experts
as an fp8 checkpoint, in 128x128 blocks or per tensor, and every peer's memory in fp8 bytes)
in vLLM 0.26's engine, vLLM's default graphs (FULL_AND_PIECEWISE, captured sizes 1, 8, 64),
the V1 model runner (vLLM's offloaders need it there). Every configuration but ``resident``
gets the same device memory for the experts: the lane's, 32 of 128 slots per layer plus a
ring of two layers (``DEVICE_LAYERS``, in layers' worth of experts):

* ``resident``: every expert in device memory (the ceiling);
* ``ringflow``: every layer's experts in pinned host memory (ringflow puts them there as vLLM
  builds the layers: no offload flags), the expert lane as shipped: steps under ``layer_tokens`` (1024) through the slot
  cache, larger ones through the layer ring (Note [Expert lane modes]);
* ``ringflow-lend``: the lane whose large steps' tails lend the carried layers' slots to the
  next layer (``lend_slots: true``, Note [Ring lends the carried layers' slots]);
* ``ringflow-held``: the lane whose ring holds its first two layers for decode steps too
  (``decode_from_ring: true``, Note [Small steps read the held layers]): those layers have no
  slots, the others ``held_slots(layers)`` each, the same device memory;
* ``ringflow-arena``: all but two layers' experts in pinned host memory, layers 0 and
  ``layers // 2`` resident (at 4 layers the prefetch offloader's layout: 1 and 3 offloaded),
  the lane over the others with ``held_slots(layers)`` slots each and no ring: large steps stream each layer through
  the slots' own memory (``layer_buffers: slots``, Note [Large steps stream through the
  slots]), the same device memory;
* ``ringflow-arena-early``: ``ringflow-arena`` whose large steps start at vLLM's
  ``execute_model`` (``early_start: true``, Note [Large steps start early]);
* ``ringflow-whole``: every layer's experts in pinned host memory, ``ringflow-arena``'s
  resident layers keeping all 128 in their slots (decoding as resident layers), the others
  ``held_slots(layers)`` (the rows it rounds off, one each, to those right after a whole
  layer: ``whole_layers``), one arena of all their rows: a large step copies each other
  layer's missing experts into rows of a whole layer that already ran and its tail copies
  them back (Note [Large steps stream through the slots]), the same device memory;
  ``ringflow-whole-plan`` the same with ``RINGFLOW_EXPERT_PLAN_KERNEL=1``,
  ``ringflow-whole-host-plan`` with ``host_share: auto`` too (the half layers' misses split
  with the CPU at decode); ``ringflow-front-plan``: the same memory with the whole layers
  first (layers 0 and 1); ``ringflow-front-late``: that without ``early_start`` (a large
  step starts at its first layer's MoE);
* ``ringflow-arena-first``: the same with the first ``layers - 2`` layers (where vLLM's UVA
  offloader put the arena's layers until December 2026), the last two resident: whether
  interleaving the resident layers hides the arena's fills;
* ``ringflow-host-fills``: the lane whose ring copies every expert of a layer from host
  memory (``ring_from_slots: false``), not those its slots hold (Note [Ring fills from the
  slots]);
* ``ringflow-host``: the lane with ``host_share: auto`` and ``host_tokens: 8`` (every host
  peer's ``HOST_AUTO``): decode steps of up to 8 tokens hand part of each layer's misses to
  the host's CPU, the share the host's rates (measured at the engine's start) predict makes
  the copy and the CPU finish together (Note [Host split]);
* ``ringflow-held-plan``: ``ringflow-held`` with ``RINGFLOW_EXPERT_PLAN_KERNEL=1`` (set while
  the engine loads): each one-pass decode step's cache bookkeeping in one kernel (Note [One
  kernel plans the step]);
* ``ringflow-held-host-plan``: both: held layers, the host's share, each decode step planned
  by one kernel;
* ``ringflow-held-host``: ``ringflow-held`` with ``host_share: auto`` on the layers it does
  not hold: at batch 1 the fastest copy-only layout, its remaining misses split with the CPU;
* ``NAME@SHARE`` (in ``--only``, NAME a peer with ``host_share``, e.g. ``ringflow-host@0.33``):
  that peer with its host share forced to SHARE of each decode step's misses, to see what the
  share is worth in the engine. One peer with a host share per run: its worker polls a CPU
  for as long as its engine lives, so a second one would take a core from the first;
* ``ringflow-slots``: the lane without its ring (``layer_buffers: 0``): every step through
  the slot cache, long prefills in passes (the lane before the ring);
* ``vllm-uva``: vLLM's UVA offloader on the experts the device cannot hold (its MoE kernel
  reads them across the host link every step), the rest resident;
* ``vllm-prefetch``: vLLM's prefetch offloader in the layout that fills the same device memory
  and gives each layer its own weights (``prefetch_layout``): every layer's experts, as many
  layers ahead as the memory holds, where the layer count is a multiple of that (8 layers: 4
  ahead); else every other layer, one ahead (4 layers: 2 resident, 1 buffer). vLLM gives
  offloaded layer ``i`` the buffer ``i % step`` and refills it for layer ``(i + step) % n``,
  so with ``n`` not a multiple of ``step`` (4 layers, 3 ahead, what this bench ran before)
  a copy lands in the buffer of a layer still to run (``tools/vllm_prefetch_slots.py``). It
  makes its dummy weights on the CPU (minutes for 8 layers);
* ``ringflow-layers``: ringflow's whole-layer weight streaming (``offload``), every layer
  through a ring of two.

Measured per engine and round, rounds interleaved across engines (ratios from one run):

* prefill: one prompt of each ``--prefills`` size, generating one token, in steps of at most
  ``--chunk`` tokens (``max_num_batched_tokens``; 8192, what ``vllm serve`` takes on an H200,
  vLLM 0.26's engine arguments: a 32k prompt is four steps, back to back; ``--chunk 32768``:
  one step each): tokens/s of the prompt; then the same prompt generating two tokens, the
  time between its first and second token reaching vLLM's front end
  (``next_token_after_*_ms``, what a user waits for the second token: ``token_times``; until
  December 2026 the difference of that request's time and the one-token request's, which a
  32k prompt's spread between rounds made negative). Each of these prompts follows a request
  decoding ``--decode-before`` tokens (default 16, sampled at batch 1, ``prefill_calls``), so every
  engine's prompts follow the same work whichever cells the run measures: the lane's lone
  prompt costs what the steps before it left in its slots (until December 2026 a prompt
  followed the cell measured before it: with ``--batches ""`` another prompt and its one
  token, else the previous round's decode windows);
* decode: steady-state step time at each batch size, the batch's prefill outside the window:
  the same batch generating ``short`` and ``long`` new tokens, ``long`` grown (once per
  engine, routing and batch) until the difference takes at least ``--window`` seconds; tok/s = batch x (long - short) / (t_long -
  t_short). Two routings, stated per row: ``hard``, sampled at temperature 1 with a seed per
  request over dummy weights (new experts at every token), and ``easy``, greedy (the same
  token, so the same experts, every step).

``--trace DIR``: after the rounds, each engine decodes a few sampled tokens and then runs one
lone prompt of the first ``--prefills`` size under vLLM's torch profiler (``profiler_config``,
traces in ``DIR``), then one request of 16 prompt tokens and 34 new ones at batch 1 (its
kernels per token: the lane's bookkeeping beside vLLM's MoE);
``ringflow/bench/gpu_trace.py`` reads each trace into where the GPU time went (kernels,
host-to-device copies and their rate, copies with no kernel beside them, idle stretches and
the host calls across them, and where the copy engine waited inside the step with the kernels
running across each wait: ``copy_gaps``; with ``RINGFLOW_TORCH_RANGES=1`` in the
environment, ringflow's own ranges too, the lane's prepare and per-layer host time:
``ringflow_ranges``), in the JSON under ``traces`` and printed.

The JSON keeps every round and min/median/max per cell; a cell whose rounds spread wider
than the difference it would show says nothing. A lane's hard decode cells carry
``routing_repeated`` where its cached layers hit at least 0.99 of their experts over the
run: the sampled decode chose the same experts step after step (the fp8 dummy checkpoints'
does), so the cell is not the hard case. ``copy bound`` rows: the time every expert of
every layer takes at the pinned copy rate (``PINNED_GBPS``, orchestrator/expert_model.py) next
to the resident step, for prefills where every expert is copied (the lane copies fewer: the
ones its slots hold come from device memory, so it can pass that bound).
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ringflow.errors import MeasurementError
from ringflow.orchestrator.expert_model import PINNED_GBPS

QWEN3_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}
EXPERT_BYTES = 3 * 2048 * 768 * 2  # gate, up and down of one expert, bf16: 9.4 MB
#: ``--fp8``: the checkpoint's quantization config (Qwen3-30B-A3B-FP8's and DeepSeek-V3's
#: 128x128 blocks, or one scale per tensor), each expert's weights one byte an element
FP8 = {"block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128]},
       "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
SLOTS = 32  # a quarter of 128
RING = 2  # the lane's layer buffers
#: the host-share peers: auto, on decode steps of up to 8 tokens (host_tokens' default is 1,
#: since the share never gained at batch 8 where measured), so batch 8 keeps being measured
HOST_AUTO = {"host_share": "auto", "host_tokens": 8}
#: the expert lane's variants (worker_report rows)
LANES = ("ringflow", "ringflow-slots", "ringflow-lend", "ringflow-held", "ringflow-arena",
         "ringflow-arena-early", "ringflow-whole", "ringflow-whole-plan",
         "ringflow-front-plan", "ringflow-front-late", "ringflow-whole-host-plan",
         "ringflow-arena-first", "ringflow-host-fills", "ringflow-host", "ringflow-held-host",
         "ringflow-held-plan", "ringflow-held-host-plan")
ROUTINGS = {"hard": 1.0, "easy": 0.0}  # temperature: sampled (new experts) or greedy


def device_layers(layers: int) -> float:
    """Layers' worth of experts every peer keeps on the device: the lane's slots and ring."""
    return layers * SLOTS / 128 + RING


def held_slots(layers: int) -> int:
    """Slots per cached layer of ``ringflow-held``: the slots the held layers would have had,
    spread over the others (rounded down: never more memory than the peers)."""
    return layers * SLOTS // (layers - RING)


def prefetch_layout(layers: int, memory: float) -> tuple[int, int, int]:
    """vLLM's prefetch offloader's ``(offload_group_size, offload_num_in_group,
    offload_prefetch_step)`` that keeps at most ``memory`` layers of experts on the device
    (resident layers and buffers) with every offloaded layer's buffer its own until it ran
    (offloaded count a multiple of the step): the most memory, then the most layers offloaded."""
    best = None
    for group in range(1, layers + 1):
        for num in range(1, group + 1):
            offloaded = sum(1 for i in range(layers) if i % group >= group - num)
            for step in range(1, offloaded + 1):
                used = layers - offloaded + step
                if offloaded % step or used > memory:
                    continue
                key = (used, offloaded, -group)
                if best is None or key > best[0]:
                    best = (key, (group, num, step))
    if best is None:
        raise SystemExit(f"experts_bench: no prefetch layout of {layers} layers fits "
                         f"{memory} layers of device memory")
    return best[1]


def expert_bytes(fp8: str | None = None) -> int:
    """One expert's weights (scales aside: 0.02% of them in 128x128 blocks)."""
    return EXPERT_BYTES // 2 if fp8 else EXPERT_BYTES


def arena_layers(layers: int) -> list[int]:
    """``ringflow-arena``'s layers: all but ``RING`` resident ones spread evenly (0 and
    ``layers // 2``): at 4 layers 1 and 3, the prefetch offloader's layout, so each window's
    fill has a resident layer's compute to hide behind."""
    resident = {k * layers // RING for k in range(RING)}
    return [i for i in range(layers) if i not in resident]


def whole_layers(layers: int, front: bool = False) -> dict:
    """``ringflow-whole``'s experts section: every layer chosen, ``ringflow-arena``'s resident
    layers with all 128 experts in their slots (``front``: the first ``RING`` layers
    instead), the others ``held_slots(layers)``, all one arena (Note [Large steps stream
    through the slots]): the arena's device memory. The rows ``held_slots`` rounds off go
    one each to the others nearest after a whole layer (at 8 layers ``128,43,43,42,128,43,43,
    42``, ``128,128,43,43,43,43,42,42``), so that the arena holds the peers' memory exactly: 4
    rows were left unused until December 2026; the replay gives the two layouts 96.6 and 93.7
    ms a lone step against 97.2 and 94.3 without them (Note [Arena timeline])."""
    chosen = list(range(RING, layers)) if front else arena_layers(layers)
    whole = [i for i in range(layers) if i not in chosen]
    after = sorted(chosen, key=lambda i: (i - max(w for w in whole if w < i), i))
    spare = layers * SLOTS - held_slots(layers) * len(chosen)
    slots = {i: held_slots(layers) + (i in after[:spare]) for i in chosen}
    return {"layers": "all", "layer_buffers": "slots", "early_start": True,
            "slots": {str(i): slots.get(i, 128) for i in range(layers)}}


def configs(layers: int, fp8: str | None = None) -> dict[str, dict]:
    """Engine keyword arguments per configuration (module docstring)."""
    layer_gib = 128 * expert_bytes(fp8) / 2**30
    layer_mib = math.ceil((128 * expert_bytes(fp8) + 60 * 2**20) / 2**20)  # experts + attention
    # no offload flags: ringflow puts the chosen layers' experts in pinned host memory as vLLM
    # builds them (Note [Ringflow places the chosen experts])
    lane = {"moe_backend": "triton"}

    def experts(name, **more):
        return {"ringflow": {"name": name, "experts": {"layers": "all", "slots": SLOTS,
                                                       "layer_buffers": RING, **more}}}

    group, num, ahead = prefetch_layout(layers, device_layers(layers))
    return {
        "resident": {"moe_backend": "triton"},
        "ringflow": {**lane, "additional_config": experts("experts-bench")},
        "ringflow-slots": {**lane, "additional_config": experts("experts-bench-slots",
                                                                 layer_buffers=0)},
        "ringflow-lend": {**lane, "additional_config": experts("experts-bench-lend",
                                                                lend_slots=True)},
        "ringflow-held": {**lane, "additional_config": experts(
            "experts-bench-held", decode_from_ring=True, slots=held_slots(layers))},
        "ringflow-arena": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-arena", "experts": {
                "layers": arena_layers(layers), "slots": held_slots(layers),
                "layer_buffers": "slots"}}}},
        "ringflow-arena-early": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-arena-early", "experts": {
                "layers": arena_layers(layers), "slots": held_slots(layers),
                "layer_buffers": "slots", "early_start": True}}}},
        # every layer's experts in host memory; the arena's resident layers keep every
        # expert in their slots instead, and lend those rows to large steps once they ran
        "ringflow-whole": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-whole", "experts": whole_layers(layers)}}},
        "ringflow-whole-plan": {**lane, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
                                "additional_config": {"ringflow": {
            "name": "experts-bench-whole-plan", "experts": whole_layers(layers)}}},
        # the whole layers first: at 8 layers the arena's timeline replays its lone step
        # 0.99x the prefetch offloader where layers 0 and 4 whole give 0.97x (4 layers: a
        # lone step 1.07x, chunks 1.04x against 1.0x and 1.19x; Note [Arena timeline]); an
        # H100 measured 0.78x against 0.80x at 8 layers (one round, tree 0b7744e, before
        # the arena's small writes left the copy engines; not measured since)
        **{f"ringflow-front-{name}": {**lane, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
                                      "additional_config": {"ringflow": {
            "name": f"experts-bench-front-{name}",
            "experts": {**whole_layers(layers, front=True), "early_start": early}}}}
           # late: without the early start, whose prepare copies nothing in this layout and
           # ran 0.95 ms of host time before vLLM prepared the step (H100, tree d78e563);
           # a start at layer 0 from tables read ahead measured 0.997x plan, level (tree
           # 6196e9f, reverted; experts-bench-8l-front-readahead-h100.json)
           for name, early in (("plan", True), ("late", False))},
        "ringflow-whole-host-plan": {**lane, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
                                     "additional_config": {"ringflow": {
            "name": "experts-bench-whole-host-plan",
            "experts": {**whole_layers(layers), **HOST_AUTO}}}},
        "ringflow-arena-first": {**lane, "additional_config": {"ringflow": {
            "name": "experts-bench-arena-first", "experts": {
                "layers": list(range(layers - RING)), "slots": held_slots(layers),
                "layer_buffers": "slots"}}}},
        "ringflow-host-fills": {**lane, "additional_config": experts(
            "experts-bench-host-fills", ring_from_slots=False)},
        "ringflow-host": {**lane, "additional_config": experts("experts-bench-host", **HOST_AUTO)},
        # held layers with each one-pass decode step planned by one kernel (Note [One
        # kernel plans the step]): the bookkeeping's share of the batch-1 step
        "ringflow-held-plan": {**lane, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
                               "additional_config": experts(
            "experts-bench-held-plan", decode_from_ring=True, slots=held_slots(layers))},
        "ringflow-held-host-plan": {**lane, "env": {"RINGFLOW_EXPERT_PLAN_KERNEL": "1"},
                                    "additional_config": experts(
            "experts-bench-held-host-plan", decode_from_ring=True, slots=held_slots(layers),
            **HOST_AUTO)},
        # held layers for decode (the fastest copy-only layout at batch 1) with the host
        # computing its share of the other layers' misses (Note [Host split])
        "ringflow-held-host": {**lane, "additional_config": experts(
            "experts-bench-held-host", decode_from_ring=True, slots=held_slots(layers),
            **HOST_AUTO)},
        # vLLM offloads whole parameters until its count reaches cpu_offload_gb: the exact
        # layers' worth (a float), where a whole GiB rounded up (2 at 4 layers, as this bench
        # gave it until December 2026) took 2 of the 4 layers off the device, not 1
        "vllm-uva": {"moe_backend": "triton", "cpu_offload_params": {"experts"},
                     "cpu_offload_gb": (layers - device_layers(layers)) * layer_gib},
        "vllm-prefetch": {"moe_backend": "triton", "offload_backend": "prefetch",
                          "offload_group_size": group, "offload_num_in_group": num,
                          "offload_prefetch_step": ahead, "offload_params": {"experts"}},
        "ringflow-layers": {"moe_backend": "triton", "additional_config": {"ringflow": {
            "name": "experts-bench-layers", "offload": {
                "layers": "all", "depth": 1, "workspace_mib": 2 * layer_mib}}}},
    }


def host_share_of(config: dict):
    """The ``host_share`` of a peer's profile, or None (no host share, or off)."""
    share = config.get("additional_config", {}).get("ringflow", {}).get("experts", {}).get(
        "host_share")
    return None if share in (None, "off") else share


def forced_share(table: dict, name: str) -> dict:
    """``table[name]``, or for ``PEER@SHARE`` the host-share peer PEER with its share forced
    to SHARE (0..1)."""
    if "@" not in name:
        return table[name]
    peer, _, share = name.partition("@")
    base = table.get(peer, {})
    if host_share_of(base) is None:
        raise SystemExit(f"experts_bench: {name}: {peer} is not a peer with a host share")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise SystemExit(f"experts_bench: {name}: the share after @ is 0..1, got {share!r}")
    out = json.loads(json.dumps(base))  # (host peers hold no sets)
    out["additional_config"]["ringflow"]["experts"]["host_share"] = value
    return out


def utilization(torch) -> float:
    """``gpu_memory_utilization`` for engines living side by side: vLLM refuses to start an
    engine while less than that share of the card is free. The KV cache is fixed
    (``kv_cache_memory_bytes``), so the share only has to let the last engine start: on an
    H100 a fixed 0.5 stopped the fifth (35.7 of 79.2 GiB free); 24 GiB lets five start
    there."""
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return round(min(0.5, 24.0 / total), 2)  # an engine here takes about 12 GiB


#: each host-share peer and the copy-only peer it differs from by that share alone
HOST_SIBLINGS = {"ringflow-host": "ringflow", "ringflow-held-host": "ringflow-held",
                 "ringflow-held-host-plan": "ringflow-held-plan",
                 "ringflow-whole-host-plan": "ringflow-whole-plan"}


def cached_layers(results: dict, name: str) -> list[dict]:
    """``name``'s worker_report rows of the layers that can miss: fewer slots than experts (a
    whole layer of slots per layer misses only rows a large step lent)."""
    return [layer for layer in results.get(name, {}).get("report") or []
            if layer.get("slots", 0) < layer.get("experts", 0)]


def predict_host_share(table: dict, results: dict, name: str, sibling: str, batches,
                       routings) -> None:
    """What the host split's model (Note [Host split]) predicts for ``name``'s decode from its
    copy-only ``sibling``'s measured step: that step less, per layer with a host share, the
    model's copy time of a step's misses less its split time (the worker's report, from the
    rates measured at the engine's start), under the hard routing (the model's misses are
    uniform routing's). Written beside the measured cell as ``predicted_tok_s`` and
    ``measured_vs_predicted`` (#47: within 1.2x either way). Only layers that keep fewer
    slots than experts count: a whole layer (slots per layer) has no misses in the model.
    Where the model's saving is not less than the sibling's whole step (its uniform misses
    outnumber what the step copied: the routing repeats more than uniform routing), there is
    no prediction: ``predicted_tok_s`` is None and ``unpredicted`` says why."""
    row, other = table.get(name, {}), table.get(sibling, {})
    layers = [layer["host_share"] for layer in cached_layers(results, name)
              if "host_share" in layer]
    if "error" in row or "error" in other or not layers:
        return
    for routing in routings:
        if not ROUTINGS[routing]:  # the model's misses are uniform routing's: the hard case
            continue
        for b in batches:
            key = f"decode_{routing}_b{b}_tok_s"
            splits = [layer["predicted"].get(b, layer["predicted"].get(str(b)))
                      for layer in layers]
            if key not in row or key not in other or None in splits:
                continue
            saved_ms = sum(s["copy_ms"] - s["layer_ms"] for s in splits)
            step_ms = 1000 * b / other[key]["median"]
            if saved_ms >= step_ms:
                for stale in ("predicted_vs_" + sibling, "measured_vs_predicted"):
                    row[key].pop(stale, None)
                row[key]["predicted_tok_s"] = None
                row[key]["unpredicted"] = (
                    f"the model saves {saved_ms:.2f} ms of a {step_ms:.2f} ms step: its "
                    f"uniform routing's misses outnumber the step's copies")
                continue
            predicted = 1000 * b / (step_ms - saved_ms)
            row[key]["predicted_tok_s"] = round(predicted, 1)
            row[key]["predicted_vs_" + sibling] = round(predicted / other[key]["median"], 3)
            row[key]["measured_vs_predicted"] = round(row[key]["median"] / predicted, 3)


def flag_repeated_routing(table: dict, results: dict) -> None:
    """Mark a lane's hard-routing decode cells where its caches barely missed over the whole
    run (every cached layer's hit rate at least 0.99, counted by the lane): the sampled
    decode chose the same experts step after step (the fp8 dummy checkpoints do), so the cell
    is not the hard case, whatever the routing asked. The hit rates span every step the
    engine ran, so a lower one proves nothing either way; this one does."""
    for name, row in table.items():
        rates = [layer["hit_rate"] for layer in cached_layers(results, name)
                 if "hit_rate" in layer]
        if "error" in row or not rates or min(rates) < 0.99:
            continue
        for key, cell in row.items():
            if key.startswith("decode_hard_"):
                cell["routing_repeated"] = round(min(rates), 4)


def prefill_calls(prefills: list[int], decode_before: int) -> list[tuple[str, int]]:
    """One round's prompt requests in order, (kind, tokens): each prompt, alone (``first``:
    one new token) and then again (``second``: two), right after a ``settle`` request of
    ``decode_before`` new tokens (none where 0)."""
    calls: list[tuple[str, int]] = []
    for p in prefills:
        for kind in ("first", "second"):
            if decode_before:
                calls.append(("settle", decode_before))
            calls.append((kind, p))
    return calls


def token_times(engine, request_id: str, prompt, params) -> list[float]:
    """``time.perf_counter()`` at which each new token of one request reaches ``engine``'s
    front end (a vLLM ``LLMEngine``, the request alone in it). The second minus the first is
    the decode step after the prompt measured inside one request: the difference of a
    two-token and a one-token request's times holds both prefills' spread, larger than the
    step after a 32k prompt (medians of -21.5 ms on the H100). Asks for each token's output
    (``CUMULATIVE``); a step that brings two tokens at once (speculative decoding) has no
    time between them, so it stops the bench (``MeasurementError``) rather than give a gap
    of zero."""
    from vllm.sampling_params import RequestOutputKind

    if engine.has_unfinished_requests():
        raise MeasurementError("token_times: the engine has requests in flight, so the timed "
                               "one would share their steps; let them finish first")
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    engine.add_request(request_id, prompt, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            now, got = time.perf_counter(), len(out.outputs[0].token_ids)
            if got - len(times) > 1:
                raise MeasurementError(
                    f"token_times: {got - len(times)} tokens of {request_id} arrived in one "
                    "step, so there is no time between them; run the bench without "
                    "speculative decoding")
            if got > len(times):
                times.append(now)
    return times


def round_fits(elapsed: float, round_s: float, deadline: float | None) -> bool:
    """Whether another interleaved round, as long as the last, ends within ``deadline``
    seconds of the bench's start (None: no deadline). Checked before each round, so that a
    deadline just under a lent GPU's limit costs no round that would have fit; until
    December 2026 a round started only while the elapsed time was under the deadline, and a
    deadline set well below the limit to leave room for one (420 s of a 565 s call) ended
    an 8-layer run after its first round with two minutes unused."""
    return deadline is None or elapsed + round_s <= deadline


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1),
            "max": round(max(values), 1), "rounds": [round(v, 1) for v in values]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default 4 of 48)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--only", default=None, help="comma-separated configurations")
    parser.add_argument("--routings", default="hard,easy", help="decode routings measured")
    parser.add_argument("--prefills", default="8192,32768", help="prompt sizes, each in steps of --chunk tokens "
                             "(\"\": decode only)")
    parser.add_argument("--chunk", type=int, default=8192,
                        help="max_num_batched_tokens: longer prompts prefill in chunks")
    parser.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    parser.add_argument("--window", type=float, default=1.0, help="decode window, seconds")
    parser.add_argument("--decode-before", type=int, default=16,
                        help="new tokens of one sampled request before each timed prompt, so "
                             "every prompt follows the same work (0: none)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from the start by which every round must end: a round "
                             "starts only if one as long as the last fits (a lent GPU's "
                             "limit, less the JSON's writing)")
    parser.add_argument("--fp8", choices=sorted(FP8), default=None,
                        help="fp8 experts: a checkpoint in 128x128 blocks or per tensor")
    parser.add_argument("--deep-gemm-warmup", choices=("skip", "relax", "full"), default=None,
                        help="vLLM's VLLM_DEEP_GEMM_WARMUP for every engine (block fp8 on "
                             "Hopper; vLLM's default relax spends minutes at the first start)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--trace", default=None,
                        help="after the rounds, profile one lone prompt and one batch-1 decode "
                             "request per engine; traces here")
    args = parser.parse_args()
    begun = time.perf_counter()
    prefills = [int(p) for p in args.prefills.split(",") if p]
    batches = [int(b) for b in args.batches.split(",") if b]
    routings = [r for r in args.routings.split(",") if r]
    if (args.rounds < 1 or args.layers < 4 or args.chunk < 1 or args.decode_before < 0
            or not set(routings) <= set(ROUTINGS)):
        parser.error("--rounds >= 1, --layers >= 4, --chunk >= 1, --decode-before >= 0, "
                     "--routings among hard,easy")
    if args.trace and not prefills:
        parser.error("--trace profiles a prompt of the first --prefills size: give one")
    chosen = configs(args.layers, args.fp8)
    if args.only:
        chosen = {name: forced_share(chosen, name) for name in args.only.split(",")
                  if name in chosen or "@" in name}
    spinning = [name for name, config in chosen.items() if host_share_of(config) is not None]
    if len(spinning) > 1:
        parser.error(f"{', '.join(spinning)}: one peer with a host share per run. Each "
                     f"engine's host worker polls a CPU while its engine lives, and the engines "
                     f"of a run live side by side, so a second one takes a core from the first "
                     f"one's threads (Note [Host node]); run them one at a time, each beside "
                     f"its copy-only sibling")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # vLLM's offloaders need V1 (0.26)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(function)
    if args.deep_gemm_warmup:
        # vLLM compiles DeepGEMM's kernels (block fp8's linear layers on Hopper) for every
        # shape it might meet when the first engine starts: 193-217 s on an H100, most of a
        # lent GPU's call. With skip, each engine's warm-up requests compile the shapes the
        # rounds use, before any is timed; every peer runs under the same setting
        os.environ["VLLM_DEEP_GEMM_WARMUP"] = args.deep_gemm_warmup

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ringflow.bench import records
    from ringflow.bench.exit import exit_now

    model = Path(tempfile.mkdtemp()) / "qwen3-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        **QWEN3_A3B, "num_hidden_layers": args.layers,
        **({"quantization_config": FP8[args.fp8]} if args.fp8 else {})}))
    vocab = QWEN3_A3B["vocab_size"]
    longest = max(prefills, default=args.chunk)  # --prefills "": decode only, the same engines
    step_tokens = min(longest, args.chunk)  # max_num_batched_tokens
    prompts = {p: [TokensPrompt(prompt_token_ids=[(j * 7919 + p) % (vocab - 3) + 3
                                                  for j in range(p)])] for p in prefills}
    short = [TokensPrompt(prompt_token_ids=[(i * 31 + j * 17) % (vocab - 3) + 3
                                            for j in range(16)]) for i in range(max(batches,
                                                                                    default=1))]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    second = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False)

    def params(routing: str, new: int) -> SamplingParams:
        t = ROUTINGS[routing]
        return SamplingParams(temperature=t, max_tokens=new, ignore_eos=True, detokenize=False,
                              **({"seed": 11} if t else {}))

    def timed(llm, batch, p) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(batch, p, use_tqdm=False)
        return time.perf_counter() - t0

    windows: dict[tuple, int] = {}  # (engine, routing, batch) -> long's new tokens
    request_ids = itertools.count()  # token_times' requests: each needs an id of its own

    def measure(name: str, llm) -> None:
        r = results[name]
        for kind, n in prefill_calls(prefills, args.decode_before):
            if kind == "settle":
                timed(llm, short[:1], params("hard", n))
            elif kind == "first":
                r.setdefault(f"prefill_{n}_tok_s", []).append(n / timed(llm, prompts[n], first))
            else:  # the same prompt and one decode step more: what a user waits for the
                # second token (held layers are carried again after a large step, Note [Small
                # steps read the held layers]), timed inside the request (token_times)
                first_at, second_at = token_times(llm.llm_engine,
                                                  f"next-token-{next(request_ids)}",
                                                  prompts[n][0], second)
                r.setdefault(f"next_token_after_{n}_ms", []).append(
                    1000 * (second_at - first_at))
        for routing in routings:
            for b in batches:
                key = (name, routing, b)
                if key not in windows:  # size the window once: grow it until it lasts
                    # warm the batch first: a cold first call (new batch size, empty caches)
                    # made an 18-token window look like a second on the H100, and the rounds
                    # then measured 0.1 s windows, some negative
                    timed(llm, short[:b], params(routing, 18))
                    n = 16
                    while n < 4096:  # the smaller of two differences: one slow call
                        took = min(   # must not stop the growth
                            timed(llm, short[:b], params(routing, n + 2))
                            - timed(llm, short[:b], params(routing, 2)) for _ in range(2))
                        if took >= args.window:
                            break
                        # at most 8x a try: a noisy (even negative) first difference must
                        # not send the window to thousands of steps
                        n = min(4096, 8 * n, max(2 * n, math.ceil(1.3 * n * args.window
                                                                  / max(took, 1e-3))))
                    windows[key] = n + 2
                t_short = timed(llm, short[:b], params(routing, 2))
                t_long = timed(llm, short[:b], params(routing, windows[key]))
                r.setdefault(f"decode_{routing}_b{b}_tok_s", []).append(
                    b * (windows[key] - 2) / (t_long - t_short))
                r.setdefault(f"decode_{routing}_b{b}_window_s", []).append(
                    round(t_long - t_short, 2))
        if name.partition("@")[0] in LANES:
            from ringflow.integrations.vllm.experts import worker_report
            r["report"] = llm.collective_rpc(worker_report)[0]

    def summary(rounds: int) -> dict:
        """Per cell min/median/max and ratios of medians (written after every round, so a run
        cut short keeps what it measured)."""
        table = {}
        for name, r in results.items():
            if "error" in r:
                table[name] = {"error": r["error"]}
                continue
            table[name] = {k: spread(v) for k, v in r.items()
                           if isinstance(v, list) and v and k.endswith(("tok_s", "_ms"))}
            for key, cell in table[name].items():  # a round shorter than --window: noise
                spans = r.get(key.replace("tok_s", "window_s"), []) if key.endswith("tok_s") \
                    else []
                if spans and min(spans) < args.window:
                    cell["short_window"] = True
        base = table.get("resident", {})
        for name, row in table.items():
            if "error" in row:
                continue
            for key, cell in row.items():
                if not key.endswith("tok_s"):  # times (ms) carry no ratios: lower is better,
                    continue                   # and a difference of two calls can be ~0
                if key in base and "error" not in base:
                    cell["vs_resident"] = round(cell["median"] / base[key]["median"], 3)
                for peer in ("vllm-prefetch", "vllm-uva", "ringflow-slots"):
                    other = table.get(peer, {})
                    if name.startswith("ringflow") and peer != name and key in other:
                        cell[f"vs_{peer}"] = round(cell["median"] / other[key]["median"], 2)
        for name, sibling in HOST_SIBLINGS.items():  # Note [Host split]'s model, per step
            predict_host_share(table, results, name, sibling, batches, routings)
        flag_repeated_routing(table, results)
        bounds = {}
        if "error" not in base:
            for p in prefills:
                key = f"prefill_{p}_tok_s"
                if key in base:
                    steps = math.ceil(p / step_tokens)  # each copies them all
                    copy_s = (steps * args.layers * 128 * expert_bytes(args.fp8)
                              / (PINNED_GBPS * 1e9))
                    bounds[key] = round(p / max(p / base[key]["median"], copy_s), 1)
        doc = records.record("python3 tools/experts_bench.py",
                             vllm=vllm.__version__, runner="V1 (VLLM_USE_V2_MODEL_RUNNER=0)",
                             layers=args.layers, rounds=rounds, slots_per_layer=SLOTS,
                             max_num_batched_tokens=step_tokens,
                             ring_layers=RING, device_layers_of_experts=device_layers(args.layers),
                             prefetch_layout=dict(zip(
                                 ("offload_group_size", "offload_num_in_group",
                                  "offload_prefetch_step"),
                                 prefetch_layout(args.layers, device_layers(args.layers)))),
                             model=f"Qwen3-30B-A3B shapes, {args.layers} layers, dummy weights",
                             experts_format=(f"fp8, {args.fp8}" if args.fp8 else "bfloat16"),
                             deep_gemm_warmup=os.environ.get("VLLM_DEEP_GEMM_WARMUP"),
                             routings={k: ("sampled, temperature 1, seeded: new experts every "
                                           "token" if ROUTINGS[k] else "greedy: the same "
                                           "experts every step") for k in routings},
                             decode_before_prompt=args.decode_before if prefills else None,
                             pinned_gbps=PINNED_GBPS, decode_windows={
                                 f"{n}/{rt}/b{b}": w for (n, rt, b), w in windows.items()},
                             copy_bound_tok_s=bounds, table=table, raw=results)
        if args.json:
            records.write(args.json, doc)
        return doc

    traces: dict[str, dict] = {}
    profiler = {}
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        profiler = {"profiler_config": {
            "profiler": "torch", "torch_profiler_dir": str(Path(args.trace).resolve()),
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}}
    engines, results = {}, {}
    round_s = 0.0  # one interleaved round's measuring, every engine's (round 0: theirs summed)
    for name, extra in chosen.items():
        t0 = time.perf_counter()
        extra = dict(extra)
        env = extra.pop("env", {})  # read while the engine loads (its caches are built then)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            engines[name] = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                                dtype="bfloat16", max_model_len=longest + 512, max_num_seqs=64,
                                max_num_batched_tokens=step_tokens, seed=0,
                                enable_prefix_caching=False, kv_cache_memory_bytes=4 << 30,
                                gpu_memory_utilization=utilization(torch),
                                compilation_config={"cudagraph_capture_sizes": [1, 8, 64]},
                                **profiler, **extra)
        except Exception as exc:  # a peer that cannot start is a row that says why
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            print(f"[experts-bench] {name}: did not start: {results[name]['error']}", flush=True)
            continue
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results[name] = {"startup_s": round(time.perf_counter() - t0, 1)}
        print(f"[experts-bench] {name}: started in {results[name]['startup_s']} s", flush=True)
        llm = engines[name]  # warm-up: first replays, kernels compiled for every size
        for p in prefills:
            llm.generate(prompts[p], first, use_tqdm=False)
        for b in batches:
            llm.generate(short[:b], params(routings[0], 4), use_tqdm=False)
        t0 = time.perf_counter()
        measure(name, llm)  # round 0 now: a run cut short keeps every engine measured so far
        round_s += time.perf_counter() - t0
        summary(1)

    done = 1
    for round_ in range(1, args.rounds):
        if not round_fits(time.perf_counter() - begun, round_s, args.deadline):
            print(f"[experts-bench] --deadline: stopping after {done} rounds (a round takes "
                  f"{round_s:.0f} s)", flush=True)
            break
        t0 = time.perf_counter()
        for name, llm in engines.items():  # interleaved: every configuration once per round
            measure(name, llm)
        round_s = time.perf_counter() - t0
        done = round_ + 1
        summary(done)
        print(f"[experts-bench] round {done} done in {round_s:.0f} s", flush=True)
    if args.trace:
        from ringflow.bench import gpu_trace

        lone, burst = prefills[0], 34  # a short prompt's prefill and 33 decode steps

        def traced(name: str, llm, label: str, batch, p) -> dict:
            before = set(Path(args.trace).rglob("*.json"))
            llm.start_profile(f"{name}-{label}")
            took = timed(llm, batch, p)
            llm.stop_profile()
            written = sorted(set(Path(args.trace).rglob("*.json")) - before)
            if not written:
                return {"error": f"vLLM's profiler wrote no trace under {args.trace}"}
            return {"wall_ms": round(1000 * took, 2), "file": str(written[-1]),
                    **gpu_trace.summarize(gpu_trace.load(written[-1]))}

        for name, llm in engines.items():
            llm.generate(short[:1], params(routings[0], 16), use_tqdm=False)  # decode first
            traces[name] = {"prompt": lone, **traced(name, llm, str(lone), prompts[lone], first)}
            # batch-1 decode under the first routing: its kernels per token (the lane's
            # bookkeeping beside vLLM's MoE) and its copies
            row = traced(name, llm, "decode", short[:1], params(routings[0], burst))
            if "kernels" in row:
                row["kernels_per_token"] = round(row["kernels"] / burst, 1)
                row["wall_ms_per_token"] = round(row["wall_ms"] / burst, 3)
            traces[f"{name}/decode-b1"] = {"tokens": burst, "routing": routings[0], **row}
    doc = summary(done)
    if traces:
        doc["traces"] = traces
        if args.json:
            records.write(args.json, doc)
        print("| trace | wall ms | GPU window | kernel ms (count) | h2d (GB/s) | copies alone | "
              "idle | longest gaps (ms: host calls across) |")
        print("| --- " * 8 + "|")
        for name, t in traces.items():
            if "error" in t:
                print(f"| {name} | {t['error']} |")
                continue
            gaps = "; ".join(f"{g['ms']} at {g['at_ms']}: {', '.join(g['host'][:2])}"
                             for g in t["gaps"][:3])
            print(f"| {name} | {t['wall_ms']} | {t['window_ms']} | {t['kernel_ms']} "
                  f"({t['kernels']}) | "
                  f"{t['h2d_ms']} ({t['h2d_gbps']}) | {t['copy_only_ms']} | {t['idle_ms']} | "
                  f"{gaps} |")
        print("| trace | first bulk copy ms | copy engine waiting ms | its longest waits (ms: "
              "kernels across) |")
        print("| --- " * 4 + "|")
        for name, t in traces.items():
            c = t.get("copy_gaps")
            if not c:
                continue
            waits = "; ".join(f"{g['ms']} at {g['at_ms']}"
                              f"{' (next copy issued late)' if g.get('issued_late') else ''}: "
                              f"{', '.join(g['kernels'][:2])}" for g in c["gaps"][:4])
            print(f"| {name} | {c['first_copy_ms']} | {c['idle_ms']} | {waits} |")
        for name, t in traces.items():  # RINGFLOW_TORCH_RANGES: the lane's host time
            ranges = t.get("ringflow_ranges")
            if ranges:
                print(f"[experts-bench] {name} ringflow ranges (name: count, host ms, first at "
                      f"ms of the GPU window): " + "; ".join(
                          f"{n.removeprefix('ringflow/')}: {r['count']}, {r['ms']}, "
                          f"{r['first_at_ms']}" for n, r in ranges.items()))
    cells = [f"prefill_{p}_tok_s" for p in prefills] + [
        f"next_token_after_{p}_ms" for p in prefills] + [
        f"decode_{rt}_b{b}_tok_s" for rt in routings for b in batches]
    print("| config | " + " | ".join(c.replace("_tok_s", "") for c in cells) + " |")
    print("| --- " * (1 + len(cells)) + "|")
    for name, row in doc["table"].items():
        if "error" in row:
            print(f"| {name} | did not start: {row['error'][:120]} |")
            continue
        print(f"| {name} | " + " | ".join(
            (f"{row[c]['median']:,} [{row[c]['min']:,}-{row[c]['max']:,}]"
             + (" (short window)" if row[c].get("short_window") else "") if c in row else "-")
            for c in cells) + " |")
    if doc["copy_bound_tok_s"]:
        print("| copy bound | " + " | ".join(str(doc["copy_bound_tok_s"].get(c, ""))
                                            for c in cells) + " |")
    for name in LANES:
        for key, cell in doc["table"].get(name, {}).items():
            if isinstance(cell, dict) and "vs_vllm-prefetch" in cell:
                print(f"[experts-bench] {name} {key}: x{cell['vs_vllm-prefetch']} vLLM's prefetch "
                      f"offloader, x{cell.get('vs_vllm-uva', '-')} its UVA offloader")
    for name, row in doc["table"].items():
        hard = [key for key, cell in row.items()
                if isinstance(cell, dict) and "routing_repeated" in cell]
        if hard:
            print(f"[experts-bench] {name}: every cached layer hit at least "
                  f"{row[hard[0]]['routing_repeated']} of its experts over the run: "
                  f"{', '.join(hard)} did not route anew at every token (not the hard case)")
    for name, sibling in HOST_SIBLINGS.items():
        for key, cell in doc["table"].get(name, {}).items():
            if isinstance(cell, dict) and cell.get("unpredicted"):
                print(f"[experts-bench] {name} {key}: {cell['median']:,} tok/s, no prediction: "
                      f"{cell['unpredicted']}")
            elif isinstance(cell, dict) and "predicted_tok_s" in cell:
                print(f"[experts-bench] {name} {key}: {cell['median']:,} tok/s, the host "
                      f"split's model predicted {cell['predicted_tok_s']:,} "
                      f"(x{cell['predicted_vs_' + sibling]} {sibling}; measured "
                      f"x{cell['measured_vs_predicted']} of it)")
    sys.stdout.flush()
    exit_now()  # engine shutdown can hang; the results are written


if __name__ == "__main__":
    main()
