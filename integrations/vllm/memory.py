"""The KV-cache budget and ringflow's rings: what streaming saved, credited to vLLM's own figure
of the model's weights before vLLM sizes the KV cache, and what the KV cache then became.

vLLM measures the model's weights when loading returns, before the plugin frees the offloaded
ones; the plugin measures what streaming saved on the device (offloaded weights freed minus the
ring, ``torch.cuda.memory_allocated`` before and after) and subtracts it from the model
runner's ``model_memory_usage``, so the KV budget vLLM computes next includes it.
"""

from __future__ import annotations

import logging

from ringflow.units import mib

log = logging.getLogger("ringflow")


def kv_bytes_per_token(worker) -> float | None:
    """Bytes one token takes in the KV cache across all attention layers (None if unknown)."""
    try:
        specs = worker.model_runner.get_kv_cache_spec()
        return sum(spec.page_size_bytes / spec.block_size for spec in specs.values()) or None
    except Exception as exc:  # an engine version without the spec API: report, do not fail
        log.info("KV bytes per token unknown (%s)", exc)
        return None


def credit_weights_memory(worker, saved: int) -> bool:
    """Subtract ``saved`` bytes from vLLM's measured weights memory; False where this vLLM's
    model runner keeps no such figure (then nothing is credited, and the log says so)."""
    runner = worker.model_runner
    if not isinstance(getattr(runner, "model_memory_usage", None), (int, float)):
        return False
    runner.model_memory_usage -= saved
    return True


def log_kv_size(worker, streamer, kv_cache_config=None, *args, **kwargs) -> None:
    """What vLLM's own sizing gave the KV cache, and the part ringflow's saving bought."""
    config = kv_cache_config if kv_cache_config is not None else kwargs.get("kv_cache_config")
    try:
        block = config.kv_cache_groups[0].kv_cache_spec.block_size
        sized = config.num_blocks * block
    except (AttributeError, IndexError, TypeError):
        return
    saved = getattr(streamer, "saved_bytes", None)
    available = getattr(worker, "available_kv_cache_memory_bytes", None)
    bought = ""
    if saved is not None and isinstance(available, int) and available > 0:
        without = int(config.num_blocks * max(available - saved, 0) / available) * block
        bought = (f"; without ringflow's measured saving of {mib(saved)} it would have been "
                  f"{without:,} ({sized - without:+,} tokens)")
    log.info("vLLM sized the KV cache at %d blocks x %d = %s tokens%s", config.num_blocks,
             block, f"{sized:,}", bought)
