"""The experts section's host share in vLLM's worker: the host's rates, the share per step size,
the lane's HostExperts over the chosen layers, and the start-up line that says what was decided
and why (Note [Host split], Note [Host experts])."""

from __future__ import annotations

import logging
import os

import torch

from ringflow import envs
from ringflow.errors import ConfigError, ProfileError
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.host_experts import (CopyLoad, HostExperts, fastest_threads,
                                                      measure_handoff_ms)
from ringflow.orchestrator.expert_model import fetch_ms
from ringflow.orchestrator.host_split import HostPolicy, HostRates, host_policy

log = logging.getLogger("ringflow")


def shared_slots(caches: dict[int, ExpertCache]) -> int | None:
    """The slot count the host split is sized from (Note [Host split]: one hit rate for every
    layer): that of the layers that do not keep every expert, as whole layers beside them
    (``experts.slots`` per layer) miss only rows a large step lent; None where every layer
    keeps all.

    Raises:
        ProfileError: those layers have different counts.
    """
    partial = sorted({c.slots for c in caches.values() if c.slots < c.experts})
    if len(partial) > 1:
        raise ProfileError("experts.host_share", f"sizes its split from one slot count, but "
                           f"the layers that do not keep every expert have {partial} slots "
                           f"(experts.slots per layer): give them one count, or host_share: "
                           f"off")
    return partial[0] if partial else None


def host_shares(spec, caches: dict[int, ExpertCache], modules: dict[int, object],
                vllm_config) -> tuple[HostExperts | None, HostPolicy | None]:
    """The lane's host share and policy for ``spec.host_share`` (None and None: off, with the
    reason logged once where the profile asked for it)."""
    if spec.host_share == "off":
        return None, None
    slots = shared_slots(caches)
    if slots is None:
        log.info("experts.host_share: %s asked, but every chosen layer keeps all its experts "
                 "on the device (experts.slots): no miss to share; the host share is off",
                 spec.host_share)
        return None, None
    first = caches[min(caches)]
    if first.device.type != "cuda":
        log.info("experts.host_share: %s asked, but the experts already compute on the CPU "
                 "(vLLM's CPU build): the host share is off", spec.host_share)
        return None, None
    unlike = host_rows_unlike_vllms(first.host)
    if unlike:
        if isinstance(spec.host_share, float):
            raise ProfileError("experts.host_share", f"{unlike}: set "
                               f"VLLM_USE_DEEP_GEMM_E8M0=0, or host_share: off")
        log.info("experts.host_share: auto: %s; every miss is copied", unlike)
        return None, None
    experts = modules[min(modules)]
    expert_bytes = first.bytes // first.slots
    cpu_bytes = None
    if spec.host_rates:
        rates = HostRates.load(spec.host_rates)
        threads = spec.host_threads or rates.threads or _share_of_cpus(vllm_config)
        if "w13_scale" in first.host:  # the CPU dequantizes fp8 (Note [Host rows round as
            # the kernel]): to float32 with block scales, to bf16 per tensor; its time is sized so
            wide = 4 if first.host["w13_scale"].dim() == 3 else 2
            cpu_bytes = wide * sum(first.host[n][0].numel() for n in ("w13", "w2"))
    else:  # on a worker thread with the share's threads, as the steps will run
        cap = _share_of_cpus(vllm_config)
        counts = [spec.host_threads] if spec.host_threads else [cap, max(1, cap // 2),
                                                                 max(1, cap // 4)]
        with CopyLoad(first.device, 16):  # the bus as a step has it: the copies run too
            threads, expert_ms = fastest_threads(first.host, counts)
        tried = sorted(set(counts))
        rates = HostRates(expert_ms, expert_bytes, measure_handoff_ms(first.host, first.device),
                          threads, source=f"measured at start-up beside host-to-device copies "
                                          f"on layer {min(caches)}'s experts with {threads} "
                                          f"threads" + (f" (the fastest of {tried})"
                                                        if len(tried) > 1 else ""))
    forced = spec.host_share if isinstance(spec.host_share, float) else None
    policy = host_policy(rates, experts=first.experts, top_k=experts.top_k, slots=slots,
                         expert_bytes=expert_bytes, max_tokens=spec.host_tokens, forced=forced,
                         cpu_bytes=cpu_bytes)
    if policy.max_tokens == 0:
        if forced is None:
            log.info("experts.host_share: auto: the host's rates predict no gain for steps of "
                     "up to %d tokens (%s; one expert for one token takes %.3f ms on the CPU "
                     "against %.3f ms to copy it, the handoff %.3f ms); every miss is copied",
                     spec.host_tokens, rates.source, rates.cpu_ms(1, expert_bytes),
                     fetch_ms(1, expert_bytes), rates.handoff_ms)
        return None, None
    model = getattr(vllm_config, "model_config", None)
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        w13 = first.host["w13"]
        dtype = w13.dtype if w13.element_size() >= 2 else torch.bfloat16
    hidden = first.host["w2"].shape[1]
    idle_ms = idle_ms_switch()
    host = HostExperts({i: cache.host for i, cache in caches.items()}, hidden, experts.top_k,
                       policy.max_tokens, first.device, dtype, threads, idle_ms=idle_ms)
    log.info("experts.host_share: steps of up to %d tokens hand part of each layer's misses "
             "to the host's CPU (one worker, %d threads, %s), which computes them inside the "
             "step: %s", policy.max_tokens, threads,
             f"parked after about {idle_ms:g} ms without work (RINGFLOW_HOST_IDLE_MS)"
             if idle_ms else "polling a CPU core while the engine lives", policy.why)
    return host, policy


def idle_ms_switch() -> float:
    """``RINGFLOW_HOST_IDLE_MS`` as milliseconds (0: unset, the worker never parks; Note [An
    idle worker parks])."""
    raw = envs.text("RINGFLOW_HOST_IDLE_MS")
    if raw is None:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 < ms < float("inf"):  # (NaN too)
        raise ConfigError(f"RINGFLOW_HOST_IDLE_MS={raw!r}: give the milliseconds without work "
                          f"after which the host share's worker parks, a number > 0 (e.g. "
                          f"50), or unset it so that the worker never parks")
    return ms


def host_rows_unlike_vllms(store: dict, e8m0: bool | None = None) -> str | None:
    """Why the host's rows of ``store``'s experts would not be the rows vLLM's kernel computes,
    or None. Block-fp8 rows follow vLLM's fused activation and its scales (Note [Host rows
    round as the kernel]); with DeepGEMM's E8M0 scales (``e8m0``; None: vLLM's
    ``is_deep_gemm_e8m0_used()``), vLLM rounds every activation scale to a power of two and
    skips that fused kernel, which the host does not model."""
    scale = store.get("w13_scale")
    if scale is None or scale.dim() != 3:
        return None
    if e8m0 is None:
        try:
            from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
        except ImportError:
            return None
        e8m0 = bool(is_deep_gemm_e8m0_used())
    if not e8m0:
        return None
    return ("vLLM quantizes block-fp8 activations with DeepGEMM's power-of-two (E8M0) scales, "
            "which the host's rows do not follow")


def _share_of_cpus(vllm_config) -> int:
    """The CPUs this worker may run on, divided among the GPU workers of this host (each rank
    of tensor or pipeline parallelism runs its own host share), less one for the engine's own
    thread: the most threads the share is given."""
    usable = len(os.sched_getaffinity(0))
    parallel = getattr(vllm_config, "parallel_config", None)
    world = getattr(parallel, "world_size", 1) or 1
    local = max(1, min(world, torch.cuda.device_count() or 1))
    return max(1, usable // local - 1)
