"""Replay check run in a fresh process per allocator setting (PYTORCH_CUDA_ALLOC_CONF is read
once, at CUDA init): for every profile, captured replays with fresh random inputs, a sleep kernel
on the gather lane and poisoned slots must be bit-identical to the SyncExecutor.

Usage: python tests/helpers/cuda_replay_check.py REPLAYS
Prints one line per profile and exits non-zero on the first mismatch.
"""

import sys
from pathlib import Path

import torch

from ringflow import Planner, Profile, SlotPool, SyncExecutor
from ringflow.graphs.captured import CapturedExecutor
from ringflow.bench.workload import SyntheticWorkload

# every profile that plans on its own (offload-only profiles are planned from a vLLM model)
PROFILES = [p for p in sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.yaml"))
            if Profile.load(p).layers is not None]
MAX_LAYERS = 4  # the 61-layer 400k-token profile keeps its slot shape, with fewer layers
SLEEP_CYCLES = 200_000


def check(path: Path, replays: int) -> str:
    profile = Profile.load(path)
    if profile.layers > MAX_LAYERS:
        profile = profile.replace(layers=MAX_LAYERS, ineligible=[l for l in profile.ineligible
                                                                 if l < MAX_LAYERS])
    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    work = SyntheticWorkload(profile, "cuda")

    def sleepy_gather(layer, lane, out):
        torch.cuda._sleep(SLEEP_CYCLES)
        work.gather(layer, lane, out)

    sync = SyncExecutor(dag, pools, work.gather, work.compute, poison=True)
    captured = CapturedExecutor(dag, pools, sleepy_gather, work.compute, poison=True,
                                capture=profile.capture, gather_priority=profile.gather_priority)
    assert captured.capture() is not None, "capture failed"
    small = profile.slot.nbytes * profile.workload.store_layers < (64 << 20)
    for i in range(replays):
        # fresh inputs every replay; fresh sources too where they are small enough to refill
        work.refresh(1000 + i, sources=small or i % 50 == 0)
        sync.run()
        want = work.outputs()
        captured.run()
        got = work.outputs()
        for lane in profile.lanes:
            if torch.isnan(got[lane]).any() or not torch.equal(got[lane], want[lane]):
                raise SystemExit(f"{path.stem}: replay {i} lane {lane} differs from SyncExecutor")
    torch.cuda.synchronize()
    for p in pools:
        p.close()
    return f"{path.stem}: {replays} replays bit-identical ({profile.layers} layers)"


if __name__ == "__main__":
    replays = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    for path in PROFILES:
        print(check(path, replays), flush=True)
    print("allocator:", torch.cuda.get_allocator_backend())
