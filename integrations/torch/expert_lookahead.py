"""Lookahead for the expert lane: the next MoE layer's experts, guessed and fetched a layer early.

Note [Expert lookahead]
    A step's router decides a layer's experts inside the layer, so the cache's misses are
    fetched on the step's critical path (Note [Expert cache]). The residual stream changes
    little from one layer to the next, so the next chosen MoE layer's router applied to this
    layer's MoE input is a guess at the next layer's choice. At layer ``i``, once its own
    fetch is issued, the lane:

    1. computes the guess on its stream: ``top_k`` of ``router_j(x)``'s logits (one small GEMM);
    2. records an event; a side stream waits for it and installs the guessed experts that
       layer ``j``'s cache lacks (``ExpertCache.prefetch``). The wait orders the installs after
       every read of ``j``'s slots so far, which the lane's stream issued before the event;
       the installs then overlap layer ``i``'s MoE and layer ``j``'s attention;
    3. at layer ``j``, the lane's stream waits for the side stream's event before ``serve``:
       the step then misses only what the guess did not bring.

    A wrong guess costs host-link bytes and may evict an expert the step would have hit; the
    target cache counts the guessed experts, those of them the step chose, and the installs
    (``ExpertCache.describe``), so a run says whether it paid.

    A fork and its join must land in one CUDA graph or in none: eager steps and whole-step
    (FULL) graphs qualify. A piecewise graph ends between layer ``i``'s MoE and layer ``j``'s
    attention, so a capture would end with the side stream unjoined: the caller passes
    whether the step may fork (vLLM's forward context says which graph, if any, the step is
    captured into). A step whose layer ``j`` needs several passes is not guessed either: its
    guess alone would refill the cache. Both choices depend only on the step's shape and
    graph, so a replay repeats them. On the CPU there is no side stream: the install runs in
    line, which keeps the bookkeeping under test.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringflow.errors import ConfigError, KernelError
from ringflow.integrations.torch.expert_cache import ExpertCache


class Lookahead:
    """Layer ``i``'s guess of the experts ``target`` (layer ``j``'s cache) will need, from
    ``router`` (layer ``j``'s router: hidden states [tokens, hidden] to logits [tokens,
    experts]); see Note [Expert lookahead]."""

    def __init__(self, router: Callable[[torch.Tensor], torch.Tensor], target: ExpertCache,
                 top_k: int, stream: torch.cuda.Stream | None = None) -> None:
        if not 1 <= top_k <= target.experts:
            raise ConfigError(f"top_k must be 1..{target.experts}, got {top_k}")
        if (stream is not None) != (target.device.type == "cuda"):
            raise ConfigError("a lookahead on a GPU needs a side stream, and on the CPU none")
        self.router, self.target, self.top_k, self.stream = router, target, top_k, stream
        target.looked_ahead = True
        self.pending = False
        self._guess: torch.Tensor | None = None  # kept until the join: the side stream reads it
        if stream is not None:
            self._forked, self._joined = torch.cuda.Event(), torch.cuda.Event()

    def launch(self, x: torch.Tensor, may_fork: bool = True) -> bool:
        """Guess from ``x`` [tokens, hidden] and start installing the guess (steps 1 and 2);
        False where the step is not guessed (no fork allowed, or several passes at ``j``)."""
        if not may_fork or self.target.passes(x.shape[0], self.top_k) > 1:
            return False
        logits = self.router(x)
        if logits.shape != (x.shape[0], self.target.experts):
            raise KernelError(f"a lookahead router gave logits {tuple(logits.shape)} for "
                              f"{x.shape[0]} tokens; the cache has {self.target.experts} experts")
        self._guess = logits.topk(self.top_k, dim=-1).indices
        if self.stream is None:
            self.target.prefetch(self._guess)
        else:
            lane = torch.cuda.current_stream(x.device)
            self._forked.record(lane)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self._forked)
                self.target.traced_wait(lane.cuda_stream)
                self.target.prefetch(self._guess)
                self._joined.record(self.stream)
        self.pending = True
        return True

    def join(self) -> None:
        """At layer ``j``, before its ``serve``: order the lane's stream after the installs
        (step 3); nothing when this step was not guessed."""
        if not self.pending:
            return
        if self.stream is not None:
            torch.cuda.current_stream(self.target.device).wait_event(self._joined)
            self.target.traced_wait(self.stream.cuda_stream)
        self.pending, self._guess = False, None
