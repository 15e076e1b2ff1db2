"""Run under ``TRITON_INTERPRET=1`` (tests/unit/test_expert_plan.py): the step-plan kernel (Note
[One kernel plans the step]) in Triton's interpreter on the CPU against the torch path, step
after step, for several layer shapes; prints one line per shape and exits non-zero on the first
difference."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me under TRITON_INTERPRET=1"

import torch  # noqa: E402

from ringflow.integrations.torch.expert_cache import ExpertCache  # noqa: E402
from ringflow.kernels.moe import moe_from_slots  # noqa: E402
from ringflow.kernels.reference import moe_ref  # noqa: E402

H, I = 8, 4


def tables(cache):
    e, s = cache.experts, cache.slots
    return {"slot_of": cache.slot_of[:e].tolist(), "expert_in": cache.expert_in[:s].tolist(),
            "last_used": cache.last_used[:s].tolist(), "clock": int(cache.clock),
            "hits": int(cache.hits), "misses": int(cache.misses),
            "host_mine": cache.host_mine[:e].tolist(), "host_computed": int(cache.host_computed)}


def check(experts: int, slots: int, top_k: int, steps: int, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    host = {"w13": torch.randn(experts, 2 * I, H, generator=g),
            "w2": torch.randn(experts, H, I, generator=g)}
    torch_path = ExpertCache(host, slots, "cpu")
    kernel = ExpertCache(host, slots, "cpu")
    kernel.plan_kernel = True  # what RINGFLOW_EXPERT_PLAN_KERNEL=1 turns on, on a GPU
    planned = 0
    for step in range(steps):
        tokens = int(torch.randint(1, max(2, slots // top_k) + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        if step % 5 == 4:  # a choice of -1 (an expert-parallel map's "elsewhere") names none
            ids[0, 0] = -1
        if step % 7 == 6:  # the same routing again: every expert a hit
            ids = last
        last = ids
        if step % 3 == 1:  # vLLM's router gives int32 ids
            ids = ids.int()
        one_pass = kernel.passes(*ids.shape) == 1
        share = (0.0, 0.5, 1.0, 0.3)[step % 4] if one_pass else 0.0  # Note [Host split]
        maps, split = {}, {}
        for cache in (torch_path, kernel):
            cache.trace = []
            split[cache] = []

            def on_split(cache=cache):  # the host's stage: after the marks, before installs
                split[cache].append(len(cache.trace))
            maps[cache] = [(m.clone(), {k: v.clone() for k, v in w.items()})
                           for w, m in cache.serve(ids, share, on_split)]
        if split[torch_path] != split[kernel] or len(split[kernel]) != (share > 0):
            sys.exit(f"{experts}/{slots}/{top_k} step {step}: the host's stage came at "
                     f"{split[torch_path]} in the torch path, {split[kernel]} in the kernel's")
        if tables(torch_path) != tables(kernel):
            sys.exit(f"{experts}/{slots}/{top_k} step {step}: tables differ\n"
                     f"{tables(torch_path)}\n{tables(kernel)}")
        if kernel.passes(*ids.shape) > 1:  # several passes: the torch path in both
            continue
        planned += 1
        [(want_map, want_w)], [(got_map, got_w)] = maps[torch_path], maps[kernel]
        if not torch.equal(want_map, got_map):
            sys.exit(f"{experts}/{slots}/{top_k} step {step}: maps differ\n{want_map}\n{got_map}")
        if torch_path.trace != kernel.trace:
            sys.exit(f"{experts}/{slots}/{top_k} step {step}: installs differ\n"
                     f"{torch_path.trace}\n{kernel.trace}")
        for name in want_w:  # the slots the map names hold the same experts' bytes
            named = want_map[want_map >= 0]
            if not torch.equal(want_w[name][named], got_w[name][named]):
                sys.exit(f"{experts}/{slots}/{top_k} step {step}: slot bytes differ ({name})")
        x = torch.randn(ids.shape[0], H, generator=g)
        w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
        got = moe_from_slots(x, got_w["w13"], got_w["w2"], w, ids, got_map)
        # the GPU's share: a -1 choice and the host's experts contribute nothing here
        mine = (kernel.host_mine[ids.clamp(min=0).long()] if share
                else torch.zeros_like(ids, dtype=torch.bool))
        keep = (ids >= 0) & ~mine
        want = moe_ref(x, host["w13"], host["w2"], torch.where(keep, w, 0), ids.clamp(min=0))
        if not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5):
            sys.exit(f"{experts}/{slots}/{top_k} step {step}: output differs from float64")
    if int(kernel.host_computed) == 0:
        sys.exit(f"{experts}/{slots}/{top_k}: no step handed an expert to the host")
    if int(kernel.planned) != planned or int(torch_path.planned) != 0:
        sys.exit(f"{experts}/{slots}/{top_k}: the kernel counted {int(kernel.planned)} planned "
                 f"steps, {planned} ran")
    return planned


if __name__ == "__main__":
    for experts, slots, top_k in [(16, 4, 2), (128, 64, 8), (128, 42, 8), (128, 120, 8),
                                  (128, 128, 8), (12, 5, 3), (256, 32, 8), (8, 1, 1),
                                  (10, 2, 1)]:
        planned = check(experts, slots, top_k, steps=24, seed=experts + slots)
        print(f"experts {experts} slots {slots} top_k {top_k}: {planned} one-pass steps planned "
              f"by the kernel, equal to the torch path")
