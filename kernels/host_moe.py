"""The host's share of a MoE layer: the chosen experts it was handed, computed on the CPU from the
host store where they lie (Note [Host split] in orchestrator/host_split.py).

Written in TorchScript's subset of Python: a host node's worker (graphs/host_node.py) runs it
without Python's interpreter, so no other thread's Python holds it up (Note [Host node]).
Each expert's rows are computed once for all the tokens that chose it (a decode step: one or a
few rows), rounded where vLLM's kernels round (Note [Host rows round as the kernel]), and each
(token, choice) row is written in the dtype at its own place: the lane sums the host's rows with
the GPU's in one sum, as the resident layer sums its rows (Note [Host experts]).

Note [Host rows round as the kernel]
    vLLM's bf16 MoE rounds a row three times: its first GEMM's float32 sums to bf16; the
    activation (``silu_and_mul``: the SiLU computed in float32 and rounded to bf16, then times
    the up half, rounded again); and its second GEMM's float32 sums times the router weight,
    rounded once (the Triton kernel's ``MUL_ROUTED_WEIGHT``). The host rounds at the same
    three places, so its rows differ from the GPU's only where the two GEMMs' float32 sums,
    added in another order, fall on either side of a rounding boundary (a few elements in ten
    thousand). Rounding the second GEMM's row to bf16 before the weight, as a bf16 GEMM
    does, changed about a quarter of a 2048-wide row's elements by one bf16 ulp, and the
    SiLU unrounded a few more: on the H200 test model, top-5 logprobs 0.29-0.54 away from
    all-resident. So the second GEMM runs in float32 over the expert's weights widened
    (exact). It costs: one token through an expert of Qwen3-30B-A3B's shape took 0.89-0.93
    ms on this project's 2-core CPU machine where rounding first took 0.72-0.73 (1.25x;
    the widening, 3 MiB a step, is most of it). The host's rates are measured through this
    worker (Note [Host split]), so the split counts it.

    fp8 experts in 128x128 blocks (DeepSeek-V3, Qwen3-*-FP8): vLLM's Triton kernel also
    quantizes each GEMM's input, every row in groups of a block's columns, to fp8 with a
    scale per group (``per_token_group_quant_fp8``), and sums each block's products times
    both scales in float32. The host does the same (``fp8_groups``: the input rounded to the
    fp8 grid of its group's scale; the weights dequantized to float32, not rounded to bf16;
    float32 GEMMs): without it, its rows differed from the kernel's by the activations' fp8
    rounding, a few percent per element. Between the GEMMs, with blocks of 128x128 and the
    SiLU, vLLM 0.26-0.34 runs one fused kernel (``silu_and_mul_per_block_quant``): the
    activation stays float32 from the first GEMM's bf16 row to its fp8 quantization, the
    SiLU's and the product's bf16 roundings of the unfused path never happen, and the
    smallest scale is 1 / (448 * 512). The host follows it: on the H100 its rows rounded
    as the unfused path put the block-fp8 test model's top-5 logprobs 0.58-0.83 away from
    all-resident, where bf16 rows sat within 0.06; following the fused kernel, 0.31-0.59
    (b9654fc): the likely cause is the GPU's fp8 sums, 5.9-7.0% of whose outputs round to
    another bf16 than the exact sums the host takes (Note [fp8 sums on Hopper] in
    tools/fp8_dot_accuracy.py, measured on an H100). With DeepGEMM's E8M0 scales (vLLM's
    choice where the deep_gemm package is installed) vLLM skips the fused kernel and rounds
    every activation scale to a power of two; the host does not model that, so the host
    share refuses block-fp8 experts there (``host_rows_unlike_vllms`` in
    integrations/vllm/expert_host.py). fp8 with one scale per tensor quantizes the second
    GEMM's input with one scale over every expert's rows of the step, which the host does not
    see: there it dequantizes the weights and quantizes nothing, and its rows differ by that.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def expert_weight(w: torch.Tensor, e: int, scale: Optional[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of ``w`` in ``dtype``; fp8 weights times their scale (``scale`` [experts]
    or [experts, 1] per tensor, or [experts, n/b, k/b] per block, Note [fp8 experts])."""
    if scale is None:
        return w[e].to(dtype)
    s = scale[e].float()
    if s.dim() == 2:  # one scale per block: spread it over the block's rows and columns
        n, k = w.shape[1], w.shape[2]
        s = s.repeat_interleave((n + s.shape[0] - 1) // s.shape[0], 0)[:n]
        s = s.repeat_interleave((k + s.shape[1] - 1) // s.shape[1], 1)[:, :k]
    return (w[e].float() * s).to(dtype)


def fp8_groups(x: torch.Tensor, group: int, fused: bool = False) -> torch.Tensor:
    """``x`` [rows, k] (float32) as vLLM's fp8 kernels see it with 128x128 block weights: each
    row's groups of ``group`` columns quantized to fp8 e4m3 with a scale of their largest
    magnitude over 448, times that scale again (Note [Host rows round as the kernel]). The
    smallest scale: the largest magnitude at least 1e-10 (``per_token_group_quant_fp8``), or,
    ``fused``, the scale at least 1 / (448 * 512) (``silu_and_mul_per_block_quant``)."""
    rows, k = x.shape[0], x.shape[1]
    if k % group:
        raise RuntimeError(f"fp8 activations are quantized in groups of {group} columns; a row "
                           f"of {k} is not a whole number of them")
    g = x.reshape(rows, k // group, group)
    largest = g.abs().amax(-1, keepdim=True)
    if fused:
        scale = (largest / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    else:
        scale = largest.clamp(min=1e-10) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(rows, k)


def moe_on_host(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, mine: torch.Tensor,
                out: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                w2_scale: Optional[torch.Tensor] = None) -> int:
    """Write into ``out`` [tokens, top_k, hidden] (the model's dtype) each token's choice
    ``weight * w2[e] @ (silu(gate) * up)(w13[e] @ x)`` where ``mine`` [experts] (bool) marks
    its expert, zeros at every other choice: the rows the GPU kernel would have summed, for
    the GPU's sum, rounded as vLLM's kernel rounds (Note [Host rows round as the kernel]).
    ``w13`` [experts, 2I, H] and ``w2`` [experts, H, I] as vLLM lays them out, fp8 ones with
    their scales (dequantized here; with block scales the activations quantized as the
    kernel quantizes them). All on the CPU.
    Returns how many experts it computed."""
    out.zero_()
    inter = w2.shape[2]
    dtype = hidden.dtype if w13_scale is not None else w13.dtype
    # 128x128 block fp8: the kernel quantizes each GEMM's input rows in groups of a block's
    # columns and sums in float32 (Note [Host rows round as the kernel])
    blocks = w13_scale is not None and w13_scale.dim() == 3 and w2_scale is not None
    group13, group2, fused = 0, 0, False
    if blocks and w13_scale is not None and w2_scale is not None:
        group13 = -(-w13.shape[2] // w13_scale.shape[2])
        group2 = -(-inter // w2_scale.shape[2])
        # vLLM's fused activation serves block_shape [128, 128] only
        fused = group13 == 128 and group2 == 128 and -(-w13.shape[1] // w13_scale.shape[1]) == 128
    mine_list: List[bool] = mine.tolist()
    ids: List[List[int]] = topk_ids.tolist()
    weights: List[List[float]] = topk_weights.float().tolist()
    rows: Dict[int, List[Tuple[int, int]]] = {}  # expert -> its (token, choice) pairs
    for t in range(len(ids)):
        for j in range(len(ids[t])):
            e = ids[t][j]
            if e >= 0 and mine_list[e]:
                if e not in rows:
                    empty: List[Tuple[int, int]] = []
                    rows[e] = empty
                rows[e].append((t, j))
    for e, pairs in rows.items():
        if len(pairs) == 1:  # a decode step's usual case: one token, a view of its row
            x = hidden[pairs[0][0]:pairs[0][0] + 1]
        else:
            x = hidden.index_select(0, torch.tensor([p[0] for p in pairs]))
        if blocks:
            h = torch.nn.functional.linear(fp8_groups(x.float(), group13),
                                           expert_weight(w13, e, w13_scale,
                                                         torch.float32)).to(dtype)
        else:
            h = torch.nn.functional.linear(x.to(dtype),
                                           expert_weight(w13, e, w13_scale, dtype))
        if fused:  # vLLM fuses the activation and its fp8
            gate = h[:, :inter].float()         # quantization: float32 throughout
            act = fp8_groups(gate * (1.0 / (1.0 + torch.exp(-gate))) * h[:, inter:].float(),
                             group2, True)
        else:
            act = (torch.nn.functional.silu(h[:, :inter].float()).to(dtype)
                   * h[:, inter:]).float()
            if blocks:
                act = fp8_groups(act, group2)
        y = torch.nn.functional.linear(act, expert_weight(w2, e, w2_scale, torch.float32))
        for i in range(len(pairs)):
            t, j = pairs[i]
            out[t, j] = y[i] * weights[t][j]  # float32, rounded once into ``out``'s dtype
    return len(rows)


def serve_experts(flags: torch.Tensor, meta: torch.Tensor, rows: torch.Tensor,
                  ids: torch.Tensor, weights: torch.Tensor, mine: torch.Tensor,
                  out: torch.Tensor, w13s: List[torch.Tensor], w2s: List[torch.Tensor],
                  w13_scales: List[Optional[torch.Tensor]],
                  w2_scales: List[Optional[torch.Tensor]], counts: torch.Tensor,
                  names: List[str], idle_polls: int = 0) -> int:
    """A host node's loop (Note [Host node]) for the expert lane's host share (Note [Host
    experts]): at each doorbell (``flags[0]`` set), the staged step (``meta``: its tokens and
    its layer's position) from that layer's store, into ``out``, inside a profiler range
    named ``names[position]`` (an NVTX range where the thread emits them: Note [Host work
    in NVTX]); ``counts[position]`` gains one run and the experts computed; then ``flags[1]``
    says done. A negative doorbell ends it; ``idle_polls`` polls in a row without one
    (0: never) park it (``flags[2]`` set: Note [An idle worker parks]). Returns the runs."""
    runs = 0
    idle = 0
    while True:
        go = int(flags[0])
        if go == 0:
            if idle_polls > 0:
                idle += 1
                if idle >= idle_polls:
                    flags[2] = 1
                    break
            continue
        idle = 0
        flags[0] = 0
        if go < 0:
            break
        t = min(max(int(meta[0]), 0), rows.shape[0])
        p = min(max(int(meta[1]), 0), len(w13s) - 1)
        span = torch.ops.profiler._record_function_enter_new(names[p], None)
        n = moe_on_host(rows[:t], w13s[p], w2s[p], weights[:t], ids[:t], mine, out[:t],
                        w13_scales[p], w2_scales[p])
        torch.ops.profiler._record_function_exit(span)  # a raise ends the loop and the thread
        counts[p, 0] += 1
        counts[p, 1] += n
        runs += 1
        flags[1] = 1
    return runs


_scripted: dict = {}


def scripted(name: str):
    """``moe_on_host`` or ``serve_experts`` compiled by TorchScript once (about a second).

    TorchScript is deprecated (torch 2.13 warns; ``torch.compile`` and ``torch.export`` do
    not replace it here: their code runs under the GIL, or has no data-dependent loops). It
    is what runs a loop of torch ops without Python in torch 2.11 to 2.13 (Note [Host node]);
    the warning is silenced here, where it is a choice."""
    if name not in _scripted:
        import warnings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=".*torch.jit.script.*")
            _scripted[name] = torch.jit.script({"moe_on_host": moe_on_host,
                                                "serve_experts": serve_experts}[name])
    return _scripted[name]
