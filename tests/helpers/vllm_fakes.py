"""Small stand-ins for the vLLM objects ringflow's MLA context path touches, for tests that run
without an engine: each has only what ringflow reads or calls, under vLLM's names.

* :class:`FakeMLALayer`: an ``MLAAttention`` layer (its paged ``kv_cache``, its ``_k_scale``,
  its ``impl``, the sizes the ring is shaped from);
* :class:`FakeMLAImpl`: its ``MLACommonBaseImpl`` (which context chunk loop it has);
  :func:`vllm_mla_impl`: vLLM's own class, to run vLLM's own chunk loop;
* :func:`mla_metadata`: a step's MLA attention metadata (``prefill.chunked_context`` with the
  ``workspace`` vLLM gathers into);
* :func:`fake_gather`: a context gather of ``vllm._custom_ops``;
* under DCP, :class:`FakeCoordinator` (0.26's ``GroupCoordinator.all_gather``) and
  :class:`FakeDcpManager` (0.32's ``MLADCPManager.kv_gather``);
* :func:`vllm_config`: the parts of a ``VllmConfig`` that decide whether a layer has a consumer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

#: the exchange a fake DCP object runs: every rank's ``local`` rows, rank after rank
Exchanged = Callable[[torch.Tensor], torch.Tensor]


def fake_gather(src_cache, dst, block_table, cu_seq_lens):
    """vLLM's context gather: the block table's rows of the paged cache, in order, into dst."""
    rows = src_cache[block_table].reshape(-1, src_cache.shape[-1])
    n = int(cu_seq_lens[-1])
    dst[:n].copy_(rows[:n])


class FakeMLAImpl:
    """vLLM's MLA implementation as ringflow sees it: the context chunk loop it has
    (``dcp``: ``_context_parallel_compute_prefill_context``, else ``_compute_prefill_context``;
    never called here) and whatever ringflow sets on it."""

    def __init__(self, dcp: bool = False) -> None:
        loop = ("_context_parallel_compute_prefill_context" if dcp
                else "_compute_prefill_context")
        setattr(self, loop, self._not_run)

    @staticmethod
    def _not_run(*args, **kwargs):  # pragma: no cover - the tests run their own chunk loop
        raise AssertionError("a fake impl's chunk loop is not run")


class FakeMLALayer:
    """vLLM's ``MLAAttention`` layer: its paged cache (``[blocks, block_size, width]``), its KV
    scale and its ``impl``; ``kv_lora_rank + qk_rope_head_dim`` is the workspace's width. A
    class of its own (not a SimpleNamespace): a context model holds its layers weakly."""

    def __init__(self, kv_cache: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, impl=None, *, kv_lora_rank: int = 512,
                 qk_rope_head_dim: int = 64, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache = kv_cache
        self._k_scale = k_scale
        self.impl = FakeMLAImpl() if impl is None else impl
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dtype = kv_cache_dtype


def mla_layers(count: int, blocks: int, block_size: int, width: int, *, seed: int = 0,
               dcp: bool = False) -> list[FakeMLALayer]:
    """``count`` layers with random caches of ``blocks x block_size`` rows of ``width`` and a
    KV scale of 1."""
    g = torch.Generator().manual_seed(seed)
    return [FakeMLALayer(torch.randn(blocks, block_size, width, generator=g), torch.tensor(1.0),
                         FakeMLAImpl(dcp=dcp)) for _ in range(count)]


def mla_metadata(workspace: torch.Tensor, *, prefill: dict | None = None,
                 metadata: dict | None = None, **chunked) -> SimpleNamespace:
    """A step's MLA attention metadata: ``prefill.chunked_context.workspace`` (``chunked``: the
    chunked context's other fields, e.g. 0.26's ``seq_tot``, 0.32's ``chunks`` and
    ``dcp_manager``); ``prefill`` and ``metadata``: fields of the prefill metadata and of the
    metadata itself. One object per step: vLLM passes the same one to every layer."""
    chunked_context = SimpleNamespace(workspace=workspace, **chunked)
    return SimpleNamespace(prefill=SimpleNamespace(chunked_context=chunked_context,
                                                   **(prefill or {})),
                           **(metadata or {}))


class FakeCoordinator:
    """vLLM 0.26's DCP ``GroupCoordinator``: ``all_gather(local, dim=0)`` returns every rank's
    rows (``exchange`` computes them); ``calls`` counts the calls vLLM's own made."""

    def __init__(self, exchange: Exchanged) -> None:
        self.calls, self._exchange = 0, exchange

    def all_gather(self, input_, dim=-1):
        self.calls += 1
        return self._exchange(input_)


class FakeDcpManager:
    """vLLM 0.32's ``MLADCPManager`` (the metadata's ``chunked_context.dcp_manager``):
    ``kv_gather(gathered_kv, local_kv)`` fills ``gathered_kv``; ``calls`` as above."""

    def __init__(self, exchange: Exchanged) -> None:
        self.calls, self._exchange = 0, exchange

    def kv_gather(self, gathered_kv, local_kv):
        self.calls += 1
        gathered_kv.copy_(self._exchange(local_kv))


@functools.cache
def _vllm_impl_class() -> type:
    from vllm.model_executor.layers.attention import mla_attention

    class Impl(mla_attention.MLACommonBaseImpl):
        def __init__(self, **attributes) -> None:  # vLLM's own needs an engine's config
            self.__dict__.update(attributes)

        def forward_mqa(self, *args, **kwargs):  # pragma: no cover - decode, not used here
            raise AssertionError("decode")

    return Impl


def vllm_mla_impl(**attributes):
    """An instance of vLLM's own ``MLACommonBaseImpl`` with only ``attributes`` (those its
    chunk loop reads), to run that loop itself."""
    return _vllm_impl_class()(**attributes)


def vllm_config(dcp_size: int = 1, *, dbo: bool = False) -> SimpleNamespace:
    """A ``VllmConfig``'s parallel config: the DCP group's size and dual-batch overlap."""
    return SimpleNamespace(parallel_config=SimpleNamespace(
        decode_context_parallel_size=dcp_size, enable_dbo=dbo))
