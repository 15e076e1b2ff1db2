"""What vLLM's CUDA graph mode means for ringflow's layer ops, decided once per engine.

vLLM cuts its forward for CUDA graphs in one of three ways, and ringflow's layer ops (the
stepper calls around the streamed layers, ``integrations/torch/layer_ops.py``) follow each:

* compiled pieces (PIECEWISE, FULL_AND_PIECEWISE under torch.compile): the ops join vLLM's
  ``splitting_ops`` and run eagerly between the captured pieces (:func:`split_pieces_at_layer_ops`);
* one whole graph (FULL): the ops run inside vLLM's capture, the plan's side streams forked
  and joined inside it (Note [Running inside a capture] in graphs/eager.py);
* breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, compilation mode NONE; 0.33's default
  for the newest MLA/MoE models): the capture is broken at run time at vLLM's attention ops,
  and the ops break it too (Note [Capture breaks] in layer_ops.py), through vLLM's own
  ``eager_break_during_capture``. Where this vLLM lacks that, the copies run on vLLM's stream
  inside the segments (capture policy ``sync``), said once.

The MLA context consumer needs nothing here under breakable graphs: it runs inside vLLM's
attention op, which vLLM runs eagerly between the segments at every replay.
"""

from __future__ import annotations

import logging

from ringflow.integrations.torch import layer_ops
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.state import PluginState

log = logging.getLogger("ringflow")

ENABLED = "vllm.compilation.breakable_cudagraph.is_breakable_cudagraph_enabled"
BREAK = "vllm.compilation.breakable_cudagraph.eager_break_during_capture"


def breakable(state: PluginState, vllm_config) -> bool:
    """Whether vLLM captures breakable CUDA graphs for this engine (0.34 reads its
    compilation config; earlier versions ``VLLM_USE_BREAKABLE_CUDAGRAPH``)."""
    enabled = compat.get(state, ENABLED)
    if enabled is None:
        return False
    compilation = getattr(vllm_config, "compilation_config", None)
    if compat.params_of(enabled) and compilation is not None:
        return bool(enabled(compilation))
    return bool(enabled())


def _call(call, layer: int) -> None:
    call(layer)


def capture_breaker(state: PluginState, vllm_config, capture: str):
    """``(breaker, capture)`` for a streamer in this engine: under breakable graphs, vLLM's
    break around each stepper call (Note [Capture breaks]) and the profile's ``capture``
    policy; where vLLM has no break to offer, no breaker and ``join`` turned ``sync`` (a
    side stream forked in one segment and joined in another is a capture error), said once.
    Elsewhere ``(None, capture)``."""
    if not breakable(state, vllm_config):
        return None, capture
    brk = compat.get(state, BREAK)
    if brk is not None:
        return brk(_call), capture
    if capture == "join":
        state.log_once("breakable-sync", "vLLM captures breakable CUDA graphs but has no "
                       "eager_break_during_capture: ringflow's weight copies run on vLLM's "
                       "stream inside the captured segments (capture policy sync: exact, not "
                       "overlapped)")
        return None, "sync"
    return None, capture


def split_pieces_at_layer_ops(vllm_config) -> None:
    """Where vLLM splits its compiled graph into pieces (piecewise CUDA graphs), ringflow's
    layer ops split it too, so they run eagerly between pieces and no piece captures a side
    stream it does not join. Where vLLM does not split (full graphs only, or no compilation),
    the ops stay inside its graph: the partition is vLLM's own."""
    compilation = getattr(vllm_config, "compilation_config", None)
    ops_list = getattr(compilation, "splitting_ops", None)
    if isinstance(ops_list, list) and ops_list:
        for name in layer_ops.OP_NAMES:
            if name not in ops_list:
                ops_list.append(name)
        log.info("ringflow layer ops added to vLLM's splitting_ops (it splits its graph into "
                 "pieces at %d ops)", len(ops_list))


def log_graph_mode(state: PluginState, vllm_config, *, layer_ops_in: bool,
                   context: bool) -> None:
    """One line: the CUDA graph mode vLLM settled on (it may downgrade the one asked for when
    the attention backend cannot capture it) and where ringflow's work runs in it."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    name = getattr(mode, "name", str(mode))
    split = [op for op in layer_ops.OP_NAMES
             if op in (getattr(compilation, "splitting_ops", None) or [])]
    level = getattr(getattr(compilation, "mode", None), "name", "?")
    graphs = name not in ("NONE", "None")
    parts = []
    if breakable(state, vllm_config) and graphs:
        head = (f"vLLM runs breakable CUDA graphs (cudagraph_mode={name}, compilation mode "
                f"{level}: each forward captured in segments broken at its attention ops; "
                f"FULL steps are one unbroken graph)")
        if layer_ops_in:
            parts.append("ringflow's layer ops break the capture too and run eagerly at every "
                         "replay, so the weight copies overlap the captured segments"
                         if compat.get(state, BREAK) is not None else "ringflow's weight copies run on vLLM's stream inside "
                         "the segments (not overlapped)")
        if context:
            parts.append("the MLA context consumer runs inside vLLM's attention op, which vLLM "
                         "runs eagerly between the segments at every replay")
    else:
        head = f"vLLM runs cudagraph_mode={name}, compilation mode {level}"
        if layer_ops_in:
            parts.append("nothing is compiled; ringflow's layer ops run between the layers, "
                         "eagerly or inside vLLM's whole-forward graphs" if level == "NONE"
                         else "ringflow's layer ops split its graph into pieces" if split
                         else "ringflow's layer ops stay inside its compiled graph")
    log.info("%s%s", head, "".join(f"; {p}" for p in parts))
