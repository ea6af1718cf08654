"""Qwen3-MoE test models and helpers: two configs (all layers sparse and renormalised; dense
and sparse layers mixed, not renormalised), crafted routers, and transformers' routing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# Every layer sparse, norm_topk_prob true (Qwen3-30B-A3B's choices), 8 experts, 2 active.
MOE_ALL_SPARSE = {
    "vocab_size": 1003, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
# decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; 6 experts, 3 active, the
# top-k weights not renormalised; tied embeddings.
MOE_MIXED = {
    "vocab_size": 515, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
    "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [],
}


def route_every_token_to_first_experts(model_dir: str | Path, top_k: int) -> None:
    """Rewrite the checkpoint so every token of every layer picks experts 0..top_k-1.

    Embedding column 0 becomes a constant 1 (the others are ~0.1), so after each RMSNorm
    the hidden state's first component is large and positive for every token; the routers'
    column 0 then ranks experts 0, 1, ... far above the rest, whatever the token.
    """
    path = Path(model_dir) / "model.safetensors"
    w = load_file(str(path))
    w["model.embed_tokens.weight"][:, 0] = 1.0
    for name, t in w.items():
        if name.endswith("mlp.gate.weight"):
            t.mul_(0.05)
            t[:top_k, 0] = torch.linspace(1.5, 1.0, top_k)
    save_file(w, str(path), metadata={"format": "pt"})


def hf_experts_used(model_dir: str, prompts: list[list[int]]) -> list[set[int]]:
    """Per sparse layer, the experts transformers' router picks for any prompt token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    used: dict[int, set[int]] = {}
    hooks: list[Any] = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue
        used[i] = set()
        hooks.append(gate.register_forward_hook(
            lambda _m, _inp, out, i=i: used[i].update(out[2].flatten().tolist())))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return [used[i] for i in sorted(used)]
