"""The expert lane's hazard proof (Note [Expert lane hazards]): every step of the cache over
random routings proves, and each way a cache schedule can go wrong is caught by name."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import HazardError
from ringflow.integrations.torch import expert_cache
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.orchestrator.expert_hazards import ExpertOp, check_expert_step

E, K = 12, 3


def run_steps(slots: int, steps: int, seed: int, in_place_tokens: int = 0) -> int:
    """Random routings (a few tokens up to prefill-sized steps, popular and fresh experts, -1
    choices), each step traced and proven; the number of operations proven."""
    g = torch.Generator().manual_seed(seed)
    cache = ExpertCache({"w": torch.arange(E, dtype=torch.int32).reshape(E, 1)}, slots, "cpu",
                        in_place_tokens=in_place_tokens)
    cache.trace, proven = [], 0
    for _ in range(steps):
        tokens = int(torch.randint(1, 9, (1,), generator=g))
        pool = int(torch.randint(K, E + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(tokens)])
        ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
        held = cache.holding()
        cache.trace.clear()
        for source, expert_map in cache.serve(ids):  # it holds what the trace says it holds
            named = (expert_map >= 0).nonzero().flatten()
            assert source["w"][expert_map[named], 0].tolist() == named.tolist()
        after = check_expert_step(held, set(ids[ids >= 0].tolist()), cache.trace, slots)
        assert after == cache.holding()
        proven += len(cache.trace)
    return proven


@pytest.mark.parametrize("in_place_tokens", [0, 4])
@pytest.mark.parametrize("slots", [E, 7, K, 2, 1])
def test_every_step_of_random_routings_proves(slots, in_place_tokens):
    assert run_steps(slots, steps=150, seed=slots, in_place_tokens=in_place_tokens) > 150


def test_evicting_an_expert_the_step_needs_is_caught(monkeypatch):
    """Pass 0 choosing victims among the slots this step reads (the LRU stamp ignored)."""
    original = torch.argsort

    def victims_first(t, *args, **kwargs):
        if t.dtype == torch.int64 and t.numel() <= E and (t == torch.iinfo(torch.int64).max).any():
            return torch.arange(t.numel())  # slot order: needed slots evicted too
        return original(t, *args, **kwargs)

    monkeypatch.setattr(expert_cache.torch, "argsort", victims_first)
    with pytest.raises(HazardError, match="incomplete|read-before-write"):
        run_steps(3, steps=60, seed=1)


def test_a_pass_reading_before_its_install_is_caught():
    ops = [ExpertOp("read", 0, ((4, 0),)), ExpertOp("install", 0, ((4, 0),))]
    with pytest.raises(HazardError, match="read-before-write: pass 0 reads expert 4"):
        check_expert_step({}, {4}, ops, 2)


@pytest.mark.parametrize("ops, kind", [
    ([ExpertOp("install", 1, ((4, 0),)), ExpertOp("read", 0, ((4, 0),))], "cross-stream"),
    ([ExpertOp("install", 0, ((4, 2),))], "slot-range"),
    ([ExpertOp("install", 0, ((4, 0), (5, 0)))], "double-write"),
    ([ExpertOp("install", 0, ((4, 0),)), ExpertOp("read", 0, ((4, 0),)),
      ExpertOp("read", 0, ((4, 0),))], "incomplete"),
    ([ExpertOp("install", 0, ((4, 0),)), ExpertOp("read", 0, ((4, 0),))], "incomplete"),
])
def test_each_hazard_is_named(ops, kind):
    needed = {4, 5} if kind == "incomplete" and len(ops) == 2 else {4}
    with pytest.raises(HazardError, match=f"^{kind}:"):
        check_expert_step({}, needed, ops, 2)
