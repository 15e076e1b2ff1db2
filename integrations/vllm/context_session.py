"""One MLA layer's context attention as ringflow sees it: record, consume or pass through.

A session lives for one call of vLLM's context computation (``context_hooks.py`` opens and
closes it) and decides, from the model's state and the step's metadata, what that layer does
with each gather and exchange vLLM makes: the step's first layer records them
(``context_recording.py``), a later layer of a planned step reads the ring's slots instead
(``context_ring.py``), any other passes them through to vLLM. Its ``mode`` is a
:class:`SessionMode`, and a mismatch only ever moves it to ``PASS``: a wrong read is never the
fallback.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import math
from collections.abc import Callable

import torch

from ringflow.integrations.vllm.context_recording import (PER_LAYER, ExchangeCall, GatherCall,
                                                          Rows, context_tokens, signature)
from ringflow.integrations.vllm.context_ring import ContextModel

log = logging.getLogger("ringflow")

#: the session of the layer whose context attention is running (None: none; the gather and
#: exchange hooks are inert then)
SESSION: contextvars.ContextVar = contextvars.ContextVar("ringflow_context_session",
                                                         default=None)


class SessionMode(enum.Enum):
    """What a layer's session does with vLLM's gathers and exchanges."""

    #: the step's first layer: vLLM gathers, each call is recorded for the later layers' fills
    RECORD = "record"
    #: a later layer of a planned step: each call is checked against the recording and read
    #: from the ring's slot
    CONSUME = "consume"
    #: nothing planned for this layer (or given up): vLLM gathers for itself
    PASS = "pass"


class Session:
    """One layer's ``_compute_prefill_context`` call (``dcp``: its
    ``_context_parallel_compute_prefill_context``): records (the step's first layer), consumes
    slots (the others) or passes through (no step planned): its ``mode``. Each gather call
    names its cache and scale (``src_cache``, ``scale``): those are checked against the
    fill's."""

    def __init__(self, model: ContextModel, index: int, attn_metadata, dcp: bool = False) -> None:
        self.model, self.index = model, index
        self.chunked = attn_metadata.prefill.chunked_context
        self.workspace = self.chunked.workspace
        self.saved = None  # the workspace's own storage, kept where it may be re-pointed
        self.calls = 0
        #: why the step is given up once this layer is done (its reads still use the slot)
        self.give_up: str | None = None
        self.mode: SessionMode
        ring = model.ring
        if not model.enabled:
            self.mode = SessionMode.PASS
        elif dcp != (model.dcp_size > 1):
            self.mode = SessionMode.PASS
            model.state.log_once("ctx-dcp-path", "vLLM ran its %s context path for a model "
                                 "ringflow planned %s DCP; context prefetch stays off for it",
                                 "DCP" if dcp else "non-DCP", "with" if not dcp else "without")
        elif index == 0:
            if ring.in_step:
                ring.abandon("a step began before the last one's layers had all run")
            model.step, model.calls, model.filled = attn_metadata, [], {}
            self.mode = SessionMode.RECORD
        elif ring.in_step and model.step is attn_metadata:
            self.mode = SessionMode.CONSUME
            ws = self.workspace
            self.saved = (ws.untyped_storage(), ws.storage_offset(), tuple(ws.shape),
                          ws.stride())
        else:
            self.mode = SessionMode.PASS

    def gather(self, name: str, op, args: dict) -> None:
        """vLLM's gather call ``name`` with ``args``."""
        if self.mode is SessionMode.RECORD:
            op(**args)
            self._record(name, op, args)
        elif self.mode is SessionMode.CONSUME:
            self._consume(name, op, args)
        else:
            op(**args)
        self.calls += 1

    def _record(self, name: str, op, args: dict) -> None:
        where = self._where(args["dst"])
        if where is None:
            self._stop_recording("ctx-dst", "vLLM's context gather writes outside its workspace")
            return
        self.model.calls.append(GatherCall(name, op, {k: v for k, v in args.items()
                                                      if k not in PER_LAYER}, *where,
                                           scaled="scale" in args))

    def _stop_recording(self, key: str, why: str) -> None:
        """The step's first layer did something the recording cannot replay: no plan."""
        self.mode = SessionMode.PASS
        self.model.calls = []
        self.model.state.log_once(key, "%s; context prefetch stays off", why)

    def _where(self, dst: torch.Tensor) -> Rows | None:
        """Row offset and rows of ``dst`` inside the workspace (None: not a row range of it)."""
        ws = self.workspace
        if (dst.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr()
                or dst.dtype != ws.dtype or dst.shape[1:] != ws.shape[1:]
                or dst.stride() != ws.stride()):
            return None
        offset, rem = divmod(dst.storage_offset() - ws.storage_offset(), ws.stride(0))
        if rem or offset < 0 or offset + dst.shape[0] > ws.shape[0]:
            return None
        return offset, dst.shape[0]

    def _consume(self, name: str, op, args: dict) -> None:
        model, ring, chunk = self.model, self.model.ring, self.calls
        where = self._where(args["dst"])  # vLLM sliced dst from the workspace as it is now
        why = self._mismatch(name, args, chunk, where)
        if why is not None:
            self._restore()
            ring.abandon(why)
            self.mode = SessionMode.PASS
            op(**self._into_workspace(args, where))
            return
        slot = ring.begin(self.index - 1, chunk)
        if model.verify:
            self._restore()
            op(**self._into_workspace(args, where))  # vLLM's own gather, to compare with
            self._check(model.calls[chunk], slot, args)
        ws = self.workspace
        ws.set_(slot.untyped_storage(), slot.storage_offset(), ws.shape, ws.stride())

    # -- the DCP exchange (Note [DCP context exchange]) ---------------------------------------

    def exchange(self, kind: str, run: Callable, local: torch.Tensor,
                 gathered: torch.Tensor | None):
        """vLLM's DCP exchange of ``local`` (``kind``: 0.26's ``all_gather``, whose result is
        returned; 0.32's ``kv_gather`` into ``gathered``); ``run(out)`` runs vLLM's own (into
        ``out`` for ``kv_gather``). Returns what vLLM's call returns."""
        if self.mode is SessionMode.PASS or self._where(local) is None:  # not the chunk's exchange
            return run(gathered)
        if self.mode is SessionMode.RECORD:
            result = run(gathered)
            self._record_exchange(kind, local, gathered)
            return result
        return self._consume_exchange(kind, run, local, gathered)

    def _target(self, kind: str, source: Rows, gathered: torch.Tensor | None) -> Rows | None:
        """The workspace rows the exchange fills: 0.32 names them; 0.26 copies its result
        into the rows after the first ``1 / (size + 1)`` of the workspace (vLLM's layout)."""
        if kind == "kv_gather":
            return self._where(gathered)
        return self.workspace.shape[0] // (self.model.dcp_size + 1), source[1] * self.model.dcp_size

    def _record_exchange(self, kind: str, local: torch.Tensor,
                         gathered: torch.Tensor | None) -> None:
        calls, source = self.model.calls, self._where(local)
        target = self._target(kind, source, gathered)
        last = calls[-1] if calls else None
        if (last is None or last.exchange is not None or source[0] < last.offset
                or source[0] + source[1] > last.offset + last.rows or target is None
                or target[1] != source[1] * self.model.dcp_size
                or target[0] + target[1] > self.workspace.shape[0]
                or source[0] < target[0] + target[1] and target[0] < source[0] + source[1]):
            self._stop_recording("ctx-dcp-layout", f"vLLM's DCP context exchange ({kind}, rows "
                                 f"{source} into {target}) is not laid out as ringflow expects")
            return
        last.exchange = ExchangeCall(kind, source, target)

    def _consume_exchange(self, kind: str, run: Callable, local: torch.Tensor,
                          gathered: torch.Tensor | None):
        model, chunk = self.model, self.calls - 1
        want = model.calls[chunk].exchange if 0 <= chunk < len(model.calls) else None
        source = self._where(local)
        if (want is None or kind != want.kind or source != want.source
                or self._target(kind, source, gathered) != want.target):
            # the chunk's local rows are in the slot (its gather matched the recording), so
            # vLLM's own exchange of them is right, and its views of this chunk read the slot:
            # the step is given up when the layer is done, its later chunks are vLLM's
            result = run(gathered)
            self._restore()
            self.give_up = (f"layer {self.index}'s DCP exchange {chunk} differs from the step's "
                            f"first layer's")
            self.mode = SessionMode.PASS
            return result
        offset, rows = want.target
        ours = self.workspace[offset: offset + rows]  # the slot's gathered rows
        if model.verify:
            if kind == "kv_gather":
                theirs = torch.empty_like(ours)
                run(theirs)
            else:
                theirs = run(None)
            self._compare(f"layer {self.index} chunk {chunk} (DCP exchange)", ours, theirs)
        return ours if kind == "all_gather" else None  # 0.26 copies it onto itself: no copy

    def _into_workspace(self, args: dict, where: tuple[int, int] | None) -> dict:
        """``args`` with ``dst`` re-sliced from the restored workspace (vLLM sliced it while
        the workspace pointed at the previous chunk's slot)."""
        if where is None:
            return args
        offset, rows = where
        return dict(args, dst=self.workspace[offset: offset + rows])

    def _mismatch(self, name: str, args: dict, chunk: int,
                  where: tuple[int, int] | None) -> str | None:
        """Why this call is not the recorded one its slot was filled by (None: it is). The
        workspace itself was checked against the slot when the step was recorded
        (:meth:`_fits`): a consuming layer has the same step's metadata, so the same one."""
        model = self.model
        if chunk >= len(model.calls):
            return f"layer {self.index} gathers more context chunks than the step's first layer"
        call = model.calls[chunk]
        if not call.matches(name, args) or where != (call.offset, call.rows):
            return (f"layer {self.index}'s context gather {chunk} differs from the step's first "
                    f"layer's (another chunking or metadata)")
        if self.index not in model.filled:
            return f"layer {self.index} was not prefetched in this step"
        cache, scale = model.filled[self.index]
        if cache != signature(args["src_cache"]):
            return f"layer {self.index} reads another KV cache than its prefetch did"
        if "scale" in args and scale != (None if args["scale"] is None
                                         else signature(args["scale"])):
            return f"layer {self.index}'s KV scale is not the one its prefetch used"
        return None

    def _check(self, call: GatherCall, slot: torch.Tensor, args: dict) -> None:
        """Verification: the slot against vLLM's own gather of the same chunk (host sync)."""
        rows = int(args["cu_seq_lens"][-1]) if "cu_seq_lens" in args else call.rows
        start = call.offset
        self._compare(f"layer {self.index} chunk {self.calls}", slot[start: start + rows],
                      self.workspace[start: start + rows])

    def _compare(self, what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        model = self.model
        model.checked += 1
        if not torch.equal(ours, theirs):
            bad = (ours != theirs).any(dim=-1).nonzero().flatten()
            model.mismatches.append(f"{what}: {bad.numel()} of {ours.shape[0]} rows differ "
                                    f"(first {bad[:4].tolist()})")
            log.error("verify: %s", model.mismatches[-1])
        if math.log10(model.checked).is_integer():  # 1, 10, 100, ... checks: a summary
            log.info("verify: %d consumed context slot(s) checked against vLLM's own gather, "
                     "%d differed", model.checked, len(model.mismatches))

    def _restore(self) -> None:
        if self.saved is not None:  # only a consuming layer re-points the workspace
            self.workspace.set_(*self.saved)

    def close(self, failed: bool) -> None:
        """The layer's context attention returned (or raised): the workspace is vLLM's again;
        a recording layer starts the step's plan, a consuming one ends its last unit."""
        self._restore()
        model, ring = self.model, self.model.ring
        if failed or self.give_up:
            if ring.in_step:
                ring.abandon(self.give_up or "a layer's context attention raised")
            return
        if self.mode is SessionMode.RECORD:
            layers = len(model.layers) - 1
            if model.dcp_size > 1 and any(c.exchange is None for c in model.calls):
                self._stop_recording("ctx-dcp-none", "vLLM's DCP context path gathered a chunk "
                                     "without the exchange ringflow hooks (another vLLM?)")
            if model.calls and layers > 0:
                if not self._fits() or self._short():
                    return
                ring.start(layers, len(model.calls), model.fill)
        elif self.mode is SessionMode.CONSUME:
            if self.calls != len(model.calls):
                ring.abandon(f"layer {self.index} read {self.calls} of the step's "
                             f"{len(model.calls)} context chunks")
            else:
                ring.end()

    def _short(self) -> bool:
        """Whether the step's context is below ``min_context_tokens``: then nothing is planned
        and the later layers gather for themselves (Note [Short context])."""
        model = self.model
        if not model.min_context:
            return False
        tokens, source = context_tokens(self.chunked, model.dcp_size), "vLLM's chunk metadata"
        if tokens is None:  # another vLLM: the rows its gathers wrote (a bound from above)
            tokens = sum(call.rows for call in model.calls) * model.dcp_size
            source = "the rows vLLM's gathers wrote"
        if tokens >= model.min_context:
            return False
        model.short_steps += 1
        model.state.log_once("ctx-short", "a step of %d context token(s) (counted from %s) runs "
                             "vLLM's own context gathers: kv_prefetch.min_context_tokens is %d "
                             "(set it to 0 to prefetch every step; logged once)", tokens, source,
                             model.min_context)
        model.calls = []
        return True

    def _fits(self) -> bool:
        ws, ring = self.workspace, self.model.ring
        if ws.shape[0] <= ring.shape[0] and tuple(ws.shape[1:]) == ring.shape[1:] \
                and ws.dtype == ring.dtype:
            return True
        self.model.state.log_once("ctx-shape", "vLLM's context workspace %s %s does not fit "
                                  "the slot ringflow reserved %s %s; context prefetch stays "
                                  "off", tuple(ws.shape), ws.dtype, ring.shape, ring.dtype)
        self.model.calls = []
        return False
