#!/usr/bin/env python3
"""Does vLLM's prefetch offloader give each offloaded layer its own weights? A check of its buffer
slots, run on a GPU with vLLM installed (vLLM's own PrefetchOffloader, no engine).

    python3 tools/vllm_prefetch_slots.py [--layers 4] [--steps 1,2,3,4] [--json FILE]

vLLM 0.26's ``PrefetchOffloader`` gives offloaded layer ``i`` the buffer slot ``i % step``
(``offload_prefetch_step``) and, after layer ``i`` runs, copies layer ``(i + step) % n`` into
its slot. Where ``n`` is not a multiple of ``step``, the copy that wraps around lands in a slot
a layer still to run holds: with 4 layers and a step of 3, after layer 1 the copy of layer 0
goes into slot 0, which layer 3 reads after it. The experts bench gave the offloader
``step = 3`` over 4 layers (the device memory of 3 layers) until this check.

Each layer here is a matmul by its own random weight (64 MiB, so a copy takes a millisecond);
each spins about 2 ms first (a prefill layer's compute, longer than a copy), so a
copy queued behind the layer's own has landed by the time it reads; every layer's output is compared with the same matmul by the weight it should have, over
several passes (the first starts from the offloader's initial prefetches, the later ones from
the copies a pass leaves in flight, as consecutive engine steps do). Prints one line per step
and the largest relative error per layer; ``--json`` keeps them.
"""

import argparse
import json
import sys

import torch

SPIN = 4_000_000  # GPU clock cycles each layer spins before its matmul: about 2 ms on an H200


class Layer(torch.nn.Module):
    """One offloaded layer: ``experts.weight`` (the name vLLM's ``offload_params`` matches)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.experts = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.experts.weight.data = weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SPIN)  # a layer's compute: longer than a copy, as at prefill
        return self.experts(hidden_states)


def check(layers: int, step: int, passes: int = 4, width: int = 4096) -> dict:
    from vllm.model_executor.offloader import base
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader
    import vllm.model_executor.offloader.prefetch_ops  # noqa: F401 (registers vLLM's ops)

    g = torch.Generator(device="cuda").manual_seed(step)
    weights = [torch.randn(width, width, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(layers)]
    references = [w.clone() for w in weights]
    offloader = PrefetchOffloader(group_size=1, num_in_group=1, prefetch_step=step,
                                  offload_params={"experts"})
    base.set_offloader(offloader)
    try:
        modules = offloader.wrap_modules(Layer(w) for w in weights)
        offloader.post_init()
        x = torch.randn(64, width, device="cuda", generator=g, dtype=torch.bfloat16)
        worst = [0.0] * layers
        for _ in range(passes):
            for i, module in enumerate(modules):
                out = module(x)
                want = x @ references[i].t()
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                worst[i] = max(worst[i], err)
        torch.cuda.synchronize()
    finally:
        base.set_offloader(base.NoopOffloader())
    return {"layers": layers, "step": step, "passes": passes,
            "slots": [i % step for i in range(layers)], "worst_rel_err": worst,
            "wrong_layers": [i for i, e in enumerate(worst) if e > 1e-2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", default="1,2,3,4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("vllm_prefetch_slots: needs a GPU (vLLM's prefetch offloader is CUDA only)",
              file=sys.stderr)
        return 2
    import vllm
    rows = [check(args.layers, int(s)) for s in args.steps.split(",")]
    for r in rows:
        print(f"[prefetch-slots] {r['layers']} layers, offload_prefetch_step {r['step']}: "
              f"slots {r['slots']}, worst relative error per layer "
              f"{[f'{e:.1e}' for e in r['worst_rel_err']]}: "
              + (f"layers {r['wrong_layers']} computed with other weights"
                 if r["wrong_layers"] else "every layer its own weights"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "vllm": vllm.__version__, "command": " ".join(sys.argv),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
