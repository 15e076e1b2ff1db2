"""Lookahead for the expert lane (Note [Expert lookahead]): a guess installs into the next
layer's cache without changing what that layer computes, the guesses are scored, the
fork/join is proven by the lane's hazard check (and an unordered one caught), and on a GPU a
captured pair of layers with a side stream replays any routing exactly."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import ConfigError, HazardError, KernelError
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lookahead import Lookahead
from ringflow.kernels.moe import moe_from_slots
from ringflow.kernels.reference import moe_ref
from ringflow.orchestrator.expert_hazards import check_expert_step
from tests.unit.test_expert_cache import E, H, K, experts, routing


def layer(slots, device="cpu", seed=0):
    w13, w2 = experts(seed)
    host = {"w13": w13, "w2": w2}
    if device != "cpu":
        host = {k: v.pin_memory() for k, v in host.items()}
    return ExpertCache(host, slots, device), w13, w2


def compute(cache, hidden, ids, weights):
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for source, expert_map in cache.serve(ids):
        out += moe_from_slots(hidden, source["w13"], source["w2"], weights, ids, expert_map)
    return out


def test_a_guess_installs_ahead_and_the_next_layer_still_computes_its_own_choice():
    """The router of layer j applied to layer i's input: the guessed experts are in j's slots
    before j's step, j's output is the float64 MoE of its real routing (a wrong guess costs
    misses, never the answer), and the cache scores each guess."""
    target, w13, w2 = layer(4, seed=1)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(3))
    ahead = Lookahead(lambda x: x @ router.T, target, K)
    g = torch.Generator().manual_seed(5)
    guessed_hits = 0
    for s in range(12):
        x = torch.randn(1, H, generator=g)
        assert ahead.launch(x)
        guess = (x @ router.T).topk(K).indices
        assert (target.slot_of[guess.flatten()] >= 0).all()
        ahead.join()
        ids, weights = (guess, torch.softmax(torch.randn(1, K, generator=g), -1)) if s % 2 \
            else routing(40 + s, 1)  # right and wrong guesses
        hits = int(target.hits)
        out = compute(target, x, ids, weights)
        torch.testing.assert_close(out.double(), moe_ref(x, w13, w2, weights, ids),
                                   rtol=1e-5, atol=1e-5)
        if s % 2:
            assert int(target.hits) == hits + K  # a right guess: every choice hits
            guessed_hits += K
    scored = target.describe()["lookahead"]
    assert scored["predicted"] == 12 * K and scored["chosen"] >= guessed_hits
    assert 0 < scored["installed"] <= 12 * K


def test_steps_of_several_passes_and_steps_that_may_not_fork_are_not_guessed():
    target, _, _ = layer(2)
    router = torch.randn(E, H)
    ahead = Lookahead(lambda x: x @ router.T, target, K)
    assert not ahead.launch(torch.randn(1, H), may_fork=False)
    assert not ahead.launch(torch.randn(2, H))  # 6 choices over 2 slots: passes
    ahead.join()  # nothing pending: nothing to wait for
    assert int(target.predictions[0]) == 0 and target.holding() == {}


def test_bad_lookaheads_are_typed_errors():
    target, _, _ = layer(4)
    wide = torch.randn(E + 1, H)
    with pytest.raises(KernelError, match=r"logits \(1, 13\) for 1 tokens; the cache has 12"):
        Lookahead(lambda x: x @ wide.T, target, K).launch(torch.randn(1, H))
    with pytest.raises(ConfigError, match="top_k must be"):
        Lookahead(lambda x: x, target, 0)
    with pytest.raises(ConfigError, match="side stream"):
        Lookahead(lambda x: x, target, K, stream=object())


def traced_step(target, guess, ids, side_waits=True, lane_waits=True):
    """One lookahead step's operations as the lane issues them on two streams (Note [Expert
    lookahead]), traced: the side stream's install, then the lane's serve."""
    target.trace = []
    target.trace_stream = lambda: "side"
    if side_waits:
        target.traced_wait("lane")
    target.prefetch(guess)
    target.trace_stream = lambda: "lane"
    if lane_waits:
        target.traced_wait("side")
    for _ in target.serve(ids):
        pass
    return target.trace


@pytest.mark.parametrize("slots", [E, 5, K])
def test_the_fork_and_join_prove_over_random_guesses_and_routings(slots):
    target, _, _ = layer(slots)
    for s in range(60):
        guess = routing(200 + s, 1)[0]
        ids = guess if s % 3 == 0 else routing(300 + s, 1, pool=6)[0]
        held = target.holding()
        trace = traced_step(target, guess, ids)
        assert check_expert_step(held, set(ids.flatten().tolist()), trace, slots) == \
            target.holding()


@pytest.mark.parametrize("side_waits, lane_waits", [(False, True), (True, False)])
def test_a_fork_or_join_without_its_event_is_caught(side_waits, lane_waits):
    """Without the side stream's wait, its install may overwrite a slot the previous step
    still reads; without the lane's, the step reads a slot before the install lands."""
    target, _, _ = layer(K)
    for _ in target.serve(routing(1, 1)[0]):  # the slots hold a previous step's experts
        pass
    guess, ids = routing(2, 1)[0], routing(2, 1)[0]
    held = target.holding()
    trace = traced_step(target, guess, ids, side_waits, lane_waits)
    with pytest.raises(HazardError, match="^cross-stream:"):
        check_expert_step(held, set(ids.flatten().tolist()), trace, K)


@pytest.mark.cuda
def test_a_captured_pair_of_layers_with_a_side_stream_replays_exactly():
    """Layer i computes from its cache and guesses layer j's experts on a side stream; j joins
    and computes. Captured once (poisoned slots), replayed with new routings and inputs: both
    outputs equal the float64 MoE each time, half the guesses are right by construction, and
    an eager step's trace with real streams proves."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    first, a13, a2 = layer(4, dev, seed=0)
    target, b13, b2 = layer(4, dev, seed=1)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(3)).to(dev)
    ahead = Lookahead(lambda x: x @ router.T, target, K, torch.cuda.Stream(dev))
    x_in = torch.zeros(1, H, device=dev)
    ids_in = [torch.zeros(1, K, dtype=torch.int64, device=dev) for _ in range(2)]
    w_in = [torch.zeros(1, K, device=dev) for _ in range(2)]
    outs = [torch.empty(1, H, device=dev) for _ in range(2)]

    def forward():
        maps = first.serve(ids_in[0])
        source, expert_map = next(maps)
        ahead.launch(x_in)
        outs[0].copy_(moe_from_slots(x_in, source["w13"], source["w2"], w_in[0], ids_in[0],
                                     expert_map))
        ahead.join()
        outs[1].copy_(compute(target, x_in, ids_in[1], w_in[1]))

    g = torch.Generator().manual_seed(7)

    def feed(s):
        x = torch.randn(1, H, generator=g)
        ids0, w0 = routing(500 + s, 1)
        guess = (x @ router.cpu().T).topk(K).indices
        ids1, w1 = (guess, w0) if s % 2 else routing(600 + s, 1)
        for dst, src in zip([x_in, ids_in[0], w_in[0], ids_in[1], w_in[1]],
                            [x, ids0, w0, ids1, w1]):
            dst.copy_(src)
        return x, (ids0, w0), (ids1, w1)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        feed(0)
        held = target.holding()
        target.trace = []
        forward()  # eager, traced with real streams (Triton compiles here)
        assert check_expert_step(held, set(ids_in[1].flatten().tolist()), target.trace, 4)
        target.trace = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for s in range(1, 9):
        x, (ids0, w0), (ids1, w1) = feed(s)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(outs[0].cpu().double(), moe_ref(x, a13, a2, w0, ids0),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1].cpu().double(), moe_ref(x, b13, b2, w1, ids1),
                                   rtol=1e-4, atol=1e-4)
    scored = target.describe()["lookahead"]
    assert scored["chosen"] >= 4 * K and scored["installed"] > 0
