"""What the step's first MLA layer recorded of vLLM's context gathers, for the others to replay.

The recording is the contract between the layer that gathered for itself and the fills that
gather ahead for the later layers (``context_ring.py``) and the sessions that check each later
call against it (``context_session.py``): kept apart so that both read one definition of a
"same call".

Note [Why replay vLLM's own gather]
    The chunk loop differs between vLLM releases (0.26 indexes per-chunk arrays, 0.32 iterates
    chunk objects with request slices). Its gather calls and its reads of ``workspace[:toks]``
    do not. Replaying the call vLLM made, with the next layer's cache, gives the slot exactly
    the rows, order and padding vLLM's read expects, whatever the release computes them from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: vLLM's MLA context gathers (whichever exist in the installed release)
GATHER_OPS = ("gather_and_maybe_dequant_cache", "cp_gather_cache",
              "gather_mla_context_cache_cpu", "cp_gather_and_upconvert_fp8_kv_cache")
#: arguments a replay replaces: the layer's cache, the slot, the layer's scale
PER_LAYER = ("src_cache", "dst", "scale")


def signature(t: torch.Tensor) -> tuple:
    """What identifies a tensor argument: its memory, shape, stride, dtype and device."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def same(a, b) -> bool:
    """The same argument: one tensor object (vLLM passes a step's metadata tensors to every
    layer), or tensors over the same memory with one shape, stride and dtype; else equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and signature(a) == signature(b))
    return a == b


#: an exchange's rows in the workspace: (first row, rows)
Rows = tuple[int, int]
#: exchange(gathered, local): every DCP rank's ``local`` rows into ``gathered``, rank after rank
Exchange = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class ExchangeCall:
    """The DCP all-gather that followed a chunk's local gather (Note [DCP context exchange]):
    vLLM's kind of call, the workspace rows it read (``source``) and those it filled
    (``target``)."""

    kind: str
    source: Rows
    target: Rows


@dataclass
class GatherCall:
    """One gather the step's first layer made: the op, its per-step arguments, and where in
    the workspace it wrote (``rows`` rows from row ``offset``); under DCP, the exchange that
    followed it."""

    name: str
    op: object
    args: dict
    offset: int
    rows: int
    scaled: bool  # the call passes the layer's KV scale
    exchange: ExchangeCall | None = None

    def matches(self, name: str, args: dict) -> bool:
        return (name == self.name and set(args) - set(PER_LAYER) == set(self.args)
                and all(same(args[k], v) for k, v in self.args.items()))


def context_tokens(chunked, dcp_size: int = 1) -> int | None:
    """The context tokens of a step's prefills, all ranks together, from the host-side counts
    in vLLM's chunked-context metadata (0.26: ``seq_tot`` per chunk, the rank's padded share
    under DCP; 0.32: each chunk's ``num_context_tokens``), the same on every rank. Not from the
    gathers' ``dst``: vLLM's CUDA gathers are handed the whole workspace. None: neither is
    there."""
    per_chunk = getattr(chunked, "seq_tot", None)
    if per_chunk is not None:
        return int(sum(per_chunk)) * dcp_size
    chunks = getattr(chunked, "chunks", None)
    if chunks is not None and all(hasattr(c, "num_context_tokens") for c in chunks):
        return int(sum(c.num_context_tokens for c in chunks))
    return None
