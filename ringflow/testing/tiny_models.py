"""Tiny models of the families ringflow serves in vLLM, written to a folder without a download:
``config.json`` and seeded random weights of real scale (vLLM's ``load_format="dummy"`` gives
near-zero weights and flat logits that hide errors, MoE errors above all). The tests serve them,
and so can a newcomer on a machine without network (the README's CPU recipes):

    python -m ringflow.testing.tiny_models llama8 /tmp/ringflow-models

writes ``/tmp/ringflow-models/llama8`` and prints its path. Needs ``transformers`` and
``safetensors`` (vLLM brings both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_SMALL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 4, "intermediate_size": 512, "vocab_size": 1000,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float32"}
MODELS = {
    "llama": {  # dense
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **_SMALL, "head_dim": 64,
        "hidden_act": "silu",
    },
    "dsv2": {  # DeepSeek-V2 with MLA; every layer dense (first_k_dense_replace >= layers)
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **_SMALL,
        "num_key_value_heads": 4, "moe_intermediate_size": 128, "hidden_act": "silu",
        "kv_lora_rank": 512, "q_lora_rank": None,
        # DeepSeek-V2's real head dimensions: vLLM's GPU prefill kernels accept no others
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
    },
    "qwen3_moe": {  # mixture of experts: FusedMoE's w13_weight / w2_weight are streamed
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_SMALL,
        "head_dim": 64, "hidden_act": "silu", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "gemma2": {  # sandwich norms (post-attention and post-feedforward), soft-capping
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **_SMALL,
        "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 16,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 64, "tie_word_embeddings": True,
    },
    "gemma3": {  # sliding-window layers between global ones (two KV-cache groups)
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_SMALL,
        "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                        "full_attention"],
        "query_pre_attn_scalar": 64, "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
    "opt": {  # decoder layers at model.decoder.layers, learned positions, biases
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 256,
        "num_attention_heads": 4, "num_hidden_layers": 4, "ffn_dim": 512,
        "vocab_size": 1000, "max_position_embeddings": 512, "word_embed_proj_dim": 256,
        "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "float32",
    },
}
#: more experts than the slots an experts profile keeps: misses, evictions and passes
MODELS["qwen3_moe16"] = {**MODELS["qwen3_moe"], "num_experts": 16}
#: 128 experts, top-8, intermediate 96: vLLM ships tuned H200 tiles for this layer (E=128,
#: N=96) and none for a cache's 32 slots, so a lane computing with the slots' own tiles rounds
#: differently from the resident layer (Note [Same bits as resident])
MODELS["qwen3_moe128"] = {**MODELS["qwen3_moe"], "num_experts": 128, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 96}
#: the same layer shape as an fp8 checkpoint in 128x128 blocks (Qwen3-30B-A3B-FP8's and
#: DeepSeek-V3's format: fp8 weights, float32 ``weight_scale_inv`` per block, experts one by one;
#: intermediate 128, a whole block)
MODELS["qwen3_moe128_fp8"] = {**MODELS["qwen3_moe128"], "moe_intermediate_size": 128,
                              "quantization_config": {"quant_method": "fp8",
                                                      "activation_scheme": "dynamic",
                                                      "weight_block_size": [128, 128]}}
#: an fp8 checkpoint with one scale per matrix (per tensor; AutoFP8's layout, what vLLM's
#: ``quantization="fp8"`` makes at load, which its UVA offloader cannot take in 0.26)
MODELS["qwen3_moe128_fp8t"] = {**MODELS["qwen3_moe128"],
                               "quantization_config": {"quant_method": "fp8",
                                                       "activation_scheme": "dynamic"}}
#: DeepSeek-V2-Lite's MoE shape, small: MLA, layers 1-3 MoE with 16 routed experts (top-2) and
#: 2 shared experts beside them
MODELS["dsv2_moe16"] = {**MODELS["dsv2"], "first_k_dense_replace": 1, "n_routed_experts": 16,
                        "n_shared_experts": 2}
#: memory accounting on a GPU (dummy weights: only their size matters): ~126 MB per layer
#: eight small layers: what the built-in vllm_weights needs (the last 2 of every 8)
MODELS["llama8"] = {**MODELS["llama"], "num_hidden_layers": 8}
MODELS["llama_mid"] = {**MODELS["llama"], "hidden_size": 2048, "intermediate_size": 8192,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                       "num_hidden_layers": 8, "vocab_size": 32000, "torch_dtype": "bfloat16"}
#: families whose RMSNorm computes x * (1 + w) and whose embeddings are scaled by sqrt(hidden)
_ONE_PLUS_NORMS = ("gemma2", "gemma3")
#: tied-embedding families: larger layer weights, so the output is not the input token echoed
_LAYER_GAIN = {"gemma2": 3.0, "gemma3": 3.0, "opt": 3.0}


def write_model(root: Path, name: str, weights: bool = True, seed: int = 0) -> str:
    """``root/name``: config.json plus seeded random weights (vLLM's dummy weights give flat
    logits; they do for memory accounting, where ``weights=False`` writes the config only);
    another ``seed`` is another checkpoint of the same model (``root/name-seedS``). Kept as it
    is where it was already written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / (name if seed == 0 else f"{name}-seed{seed}")
    cfg = MODELS[name]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if not weights or (path / "model.safetensors").exists():
        return str(path)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                         "torch_dtype", "quantization_config")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kwargs))
        shapes = {k: v.shape for k, v in model.named_parameters()}  # tied weights once
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for key, shape in sorted(shapes.items()):
        if len(shape) == 1 and key.endswith("bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # norms; Gemma's scale by (1 + w): 2 as well
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif "embed" in key:  # Gemma scales embeddings by sqrt(hidden): keep them small
            scale = 0.5 * shape[1] ** -0.5 if name in _ONE_PLUS_NORMS else 1.0
            t = scale * torch.randn(shape, generator=gen)
        elif "lm_head" in key:
            t = 3.0 * torch.randn(shape, generator=gen) / shape[1] ** 0.5
        else:
            t = _LAYER_GAIN.get(name, 1.0) * torch.randn(shape, generator=gen) / shape[1] ** 0.5
        weights[key] = t.float().contiguous()
    if cfg["model_type"] == "deepseek_v2":  # vLLM's DeepSeek loader reads experts one by one
        for key in [k for k in weights if k.endswith("mlp.experts.gate_up_proj")]:
            stem, gate_up = key[:-len("gate_up_proj")], weights.pop(key)
            down = weights.pop(stem + "down_proj")
            for e, (gate, up) in enumerate(zip(*gate_up.chunk(2, dim=1))):
                weights[f"{stem}{e}.gate_proj.weight"] = gate.contiguous()
                weights[f"{stem}{e}.up_proj.weight"] = up.contiguous()
                weights[f"{stem}{e}.down_proj.weight"] = down[e].contiguous()
    if "quantization_config" in cfg:
        weights = _fp8(weights, cfg["quantization_config"].get("weight_block_size"))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def _fp8(weights: dict, block: list[int] | None) -> dict:
    """An fp8 checkpoint as Qwen3's and DeepSeek's FP8 releases are laid out: each matrix of
    the decoder layers in fp8 with a float32 ``weight_scale_inv`` per ``block`` (the value is
    ``fp8 * scale``; ``block`` None: one ``weight_scale`` per matrix, AutoFP8's layout), the
    routed experts one by one; embeddings, norms and the head as they were."""
    import torch
    out = {}
    for key, t in weights.items():
        if key.endswith("mlp.experts.gate_up_proj"):  # [experts, 2I, H]: gate rows, then up
            stem = key[:-len("gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{stem}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{stem}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            stem = key[:-len("down_proj")]
            for e, down in enumerate(t):
                out[f"{stem}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[key] = t
    for key in [k for k, t in out.items() if k.startswith("model.layers.") and t.dim() == 2]:
        w = out.pop(key)
        n, k = w.shape
        if block is None:
            scale = w.abs().max().clamp(min=1e-12) / 448.0
            out[key] = (w / scale).to(torch.float8_e4m3fn).contiguous()
            out[f"{key}_scale"] = scale.float().reshape(())
            continue
        bn, bk = block
        tiles = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).reshape(
            -(-n // bn), bn, -(-k // bk), bk)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        out[key] = q.reshape(tiles.shape[0] * bn, -1)[:n, :k].contiguous()
        out[f"{key}_scale_inv"] = scale.float().contiguous()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringflow.testing.tiny_models",
        description="Write a tiny model with seeded random weights for vLLM to serve.")
    parser.add_argument("model", choices=sorted(MODELS), help="the model's family and shape")
    parser.add_argument("root", help="the folder to write it under (root/MODEL)")
    parser.add_argument("--seed", type=int, default=0, help="another seed: other weights")
    args = parser.parse_args(argv)
    print(write_model(Path(args.root), args.model, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
