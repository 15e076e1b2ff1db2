"""The step-plan kernel (Note [One kernel plans the step]): a one-pass step's expert-cache
bookkeeping in one Triton program, the same tables, installs and map as the torch path, run in
Triton's interpreter on the CPU and (marked cuda) compiled on a GPU against a CPU cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.kernels import expert_plan
from ringflow.kernels.reference import moe_ref

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "expert_plan_interpreted.py"


def test_the_kernel_in_tritons_interpreter_plans_every_step_as_the_torch_path():
    """Nine layer shapes (8 to 256 experts, 1 to 128 slots), 24 steps each of one to
    several tokens, a -1 choice every fifth step, a repeated routing every seventh, int32 ids
    every third, host shares of 0, 0.5, 1 and 0.3 in turn (the host's stage called between
    the plan and the installs, as in the torch path): after
    each step the tables, stamps, clock, counters, installs, map and slot bytes of a cache
    planned by the kernel equal those of the torch path, and its output the float64 MoE; the
    kernel counts the steps it planned."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HELPER)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if "planned by the kernel" in line]
    assert len(lines) == 9 and all(" 0 one-pass" not in line for line in lines), done.stdout


def test_the_kernel_serves_gpus_only_and_layers_it_can_hold(monkeypatch):
    assert not expert_plan.available(torch.device("cpu"), 128)
    monkeypatch.setenv("RINGFLOW_EXPERT_PLAN_KERNEL", "1")
    assert ExpertCache({"w": torch.zeros(8, 4)}, 2, "cpu").plan_kernel is False
    if expert_plan.triton is not None:
        assert expert_plan.available(torch.device("cuda", 0), expert_plan.MAX_EXPERTS)
        assert not expert_plan.available(torch.device("cuda", 0), expert_plan.MAX_EXPERTS + 1)


@pytest.mark.cuda
@pytest.mark.parametrize("experts, slots, top_k", [(128, 64, 8), (128, 42, 8), (256, 32, 8)])
def test_the_compiled_kernel_plans_as_the_torch_path_on_the_cpu(experts, slots, top_k,
                                                                monkeypatch):
    """On a GPU: a cache planned by the compiled kernel (RINGFLOW_EXPERT_PLAN_KERNEL=1)
    against a CPU cache on the torch path, the same routings (int32 and int64 ids, -1
    choices, host shares of 0, 0.5 and 1), slots poisoned: after every step the same tables
    and host's experts, the same map, and the float64 MoE's output over the GPU's share from
    the GPU's slots."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run `pytest -m cuda` on one")
    monkeypatch.setenv("RINGFLOW_EXPERT_PLAN_KERNEL", "1")
    from ringflow.kernels.moe import moe_from_slots
    g = torch.Generator().manual_seed(experts + slots)
    host = {"w13": torch.randn(experts, 16, 8, generator=g),
            "w2": torch.randn(experts, 8, 8, generator=g)}
    gpu = ExpertCache({k: v.pin_memory() for k, v in host.items()}, slots, "cuda")
    cpu = ExpertCache(host, slots, "cpu")
    assert gpu.plan_kernel and not cpu.plan_kernel
    planned = 0
    for step in range(40):
        tokens = int(torch.randint(1, slots // top_k + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        if step % 5 == 4:  # a choice of -1 names none
            ids[0, 0] = -1
        routed = ids.int() if step % 2 else ids  # vLLM's router gives int32
        share = (0.0, 0.5, 0.0, 1.0)[step % 4]  # the host's share of the misses
        (want_w, want_map), = [(w, m.clone()) for w, m in cpu.serve(ids, share)]
        (got_w, got_map), = [(w, m.clone()) for w, m in gpu.serve(routed.cuda(), share)]
        torch.cuda.synchronize()
        planned += 1
        assert torch.equal(got_map.cpu(), want_map), step
        for name in ("slot_of", "expert_in", "last_used", "clock", "hits", "misses",
                     "host_mine", "host_computed"):
            n = {"slot_of": experts, "expert_in": slots, "last_used": slots,
                 "host_mine": experts}.get(name)
            a, b = getattr(gpu, name), getattr(cpu, name)
            assert torch.equal(a[:n].cpu() if n else a.cpu(), b[:n] if n else b), (step, name)
        x = torch.randn(tokens, 8, generator=g)
        w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
        got = moe_from_slots(x.cuda(), got_w["w13"], got_w["w2"], w.cuda(), ids.cuda(), got_map)
        mine = cpu.host_mine[ids.clamp(min=0)] if share else torch.zeros_like(ids).bool()
        keep = (ids >= 0) & ~mine  # the GPU's share: not a -1 choice, not the host's
        want = moe_ref(x, host["w13"], host["w2"], torch.where(keep, w, 0), ids.clamp(min=0))
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)
    assert planned == 40 == int(gpu.planned) and int(cpu.planned) == 0
    assert int(gpu.host_computed) > 0
