"""Decode context parallelism: ringflow's own communicator over vLLM's DCP group, and the
transport of the context ring's exchange.

Both consumers of prefetched KV run under DCP (the full-KV lanes of ``attention.py``, the
context ring of ``context_ring.py``) and both need a communicator that is not the one vLLM's
compute stream uses: it is made here, once for either, so that neither reaches into the other.

Under decode context parallelism each rank holds part of every request's context, and
vLLM's context path (``_context_parallel_compute_prefill_context``) follows each chunk's local
gather with an all-gather across the DCP group into the rest of the workspace, then reorders
the rows on the compute stream. That all-gather is the seed's full-CKV DCP gather; ringflow
takes it off the critical path as well (Note [DCP context exchange]).

Note [DCP context exchange]
    The step's first layer records, after each chunk's local gather, vLLM's exchange of it:
    which call (0.26: ``GroupCoordinator.all_gather(local, dim=0)``, whose result vLLM copies
    into the workspace; 0.32: ``MLADCPManager.kv_gather(gathered, local)``, into it) and which
    workspace rows it reads and fills. A unit's fill then replays the local gather into the
    slot and all-gathers those rows into the slot's gathered rows, rank after rank as vLLM's
    all-gather lays them out: over a communicator of ringflow's own (:func:`dcp_group`:
    NCCL, never the one vLLM's compute stream uses, so the two streams never share one), or,
    with ``dcp_transport`` peer or auto, by copy engines: the ring lies in symmetric memory,
    every rank's local rows of a unit sit at the same place in its own slot, and each fill
    copies them from every rank's slot into its own, between two barriers
    (``PeerExchange.gather_parts``, Note [Peer exchange]). A
    consuming layer's exchange is checked against the recording and skipped: 0.32's call
    returns at once, 0.26's returns the slot's gathered rows, which vLLM then "copies" onto
    themselves (``Tensor.copy_`` of a view onto the same view moves nothing). vLLM's reorder
    still runs, on the compute stream, from the slot.

    The fills are collectives: every rank must issue them in the same order. The plan is the
    same on every rank, and every reason to give a step up (another chunking, another cache,
    a recording vLLM's calls did not match) comes from metadata and configuration that are the
    same on every rank of the group (vLLM's all-gather needs equal ``toks`` everywhere too).
    The exchange is hooked by instance attributes on vLLM's DCP coordinator and manager only
    while a layer's context session runs (eager code): a class hook on
    ``GroupCoordinator.all_gather`` would be traced by ``torch.compile`` wherever vLLM
    all-gathers. NCCL does not promise progress to two communicators whose kernels run
    concurrently in different orders on different ranks (ringflow's on the gather stream,
    vLLM's on the compute stream); the full-KV lane has run that way on two H200s, and the
    consumer's fills are issued at the same plan points on every rank.
"""

from __future__ import annotations

import logging

import torch

from ringflow.errors import BudgetError, EngineError, ProfileError
from ringflow.integrations.torch.kv_prefetch import DcpGroup, peer_ring
from ringflow.integrations.vllm import compat
from ringflow.integrations.vllm.context_recording import Exchange
from ringflow.integrations.vllm.state import STATE
from ringflow.kernels.kv_gathers import all_gather_parts
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB

log = logging.getLogger("ringflow")


def dcp_size(config) -> int:
    """The DCP group's size in vLLM ``config`` (1: no DCP)."""
    return getattr(config.parallel_config, "decode_context_parallel_size", 1) or 1


def dcp_group(config, transport: str, who: str = "full-KV prefetch") -> DcpGroup | None:
    """The gather lane's own communicator for the DCP all-gather: a new NCCL group over the
    ranks of this worker's DCP group (a collective of every worker: each learns every DCP
    group's ranks and creates them all, in one order). ``who`` names the user in errors."""
    if dcp_size(config) == 1:
        return None
    import torch.distributed as dist
    compat.require(STATE, {"dcp_context"}, f"{who} under DCP")  # vLLM's DCP group, by name
    dcp = compat.get(STATE, "vllm.distributed.parallel_state.get_dcp_group")()
    world = compat.get(STATE, "vllm.distributed.parallel_state.get_world_group")()
    try:
        everyone: list = [None] * world.world_size
        dist.all_gather_object(everyone, list(dcp.ranks), group=world.cpu_group)
        groups = sorted({tuple(ranks) for ranks in everyone})
        group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="nccl")
    except Exception as exc:
        raise EngineError(f"{who} under DCP needs a communicator of its own for "
                          f"the gather lane, made over the DCP group's ranks ({exc}); this "
                          f"needs NCCL. Remove kv_prefetch or run without DCP") from exc
    if dist.get_rank(group) != dcp.rank_in_group:  # the token owner rule needs vLLM's order
        raise EngineError(f"the gather lane's DCP communicator numbers this worker "
                          f"{dist.get_rank(group)}, vLLM's DCP group {dcp.rank_in_group} "
                          f"(ranks {list(dcp.ranks)} are not ascending); run {who} without "
                          f"DCP or without kv_prefetch")
    interleave = getattr(config.parallel_config, "cp_kv_cache_interleave_size", 1) or 1
    return DcpGroup(group, dcp.world_size, dcp.rank_in_group, interleave, transport)


def dcp_exchange(profile: Profile, config, shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> tuple[Exchange, str, torch.Tensor | None]:
    """The DCP exchange of the context ring's fills, its transport, and the ring's storage
    when the transport needs its own (collective: every worker calls it at its model's first
    MLA layer, in the same order). ``peer`` and ``auto``: copy engines pulling the peers' rows
    from a ring in symmetric memory, or NCCL where that is unavailable (logged); ``nccl``: an
    all-gather over a communicator of ringflow's own. ``auto`` is ``peer`` without timing the
    two: an exchange timed alone does not show that the copy engines leave the SMs to the
    attention it hides behind (Note [Peer exchange])."""
    transport = profile.kv_prefetch.dcp_transport
    group = dcp_group(config, transport, who="MLA context prefetch")
    if transport in ("peer", "auto"):
        spec = profile.kv_prefetch
        try:  # the pool's own fit: the same on every rank, nothing collective yet
            peer, why = peer_ring("ctx", shape, dtype, spec.depth,
                                  int(spec.workspace_mib * MIB), device, group.group)
        except BudgetError as exc:
            raise ProfileError("kv_prefetch.workspace_mib", str(exc), profile.source) from exc
        if peer is not None:
            log.info("MLA context prefetch under DCP (%d ranks): each chunk's exchange is "
                     "prefetched with the local gather, by copy engines pulling the peers' rows "
                     "from a ring in symmetric memory (dcp_transport: %s)", group.size,
                     transport)
            return peer.gather_parts, "peer", peer.storage
        log.warning("MLA context prefetch: DCP transport '%s' unavailable (%s); the exchange "
                    "is an NCCL all-gather", transport, why)
    if torch.cuda.is_available():  # NCCL's own buffers now, before vLLM sizes the KV cache
        probe = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
        all_gather_parts(torch.empty(group.size, device=probe.device), probe, group.group)
        torch.cuda.synchronize(probe.device)
    log.info("MLA context prefetch under DCP (%d ranks): each chunk's exchange is prefetched "
             "with the local gather, as an NCCL all-gather over ringflow's own communicator",
             group.size)
    return (lambda gathered, local: all_gather_parts(gathered, local, group.group)), "nccl", None
