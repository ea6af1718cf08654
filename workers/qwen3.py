"""Qwen3 for causal LM (dense `Qwen3ForCausalLM` and mixture-of-experts `Qwen3MoeForCausalLM`),
one tensor-parallel shard of it.

A MoE config makes layer i's MLP the experts block (`workers/layers/moe.py`) when
`ModelConfig.is_sparse_layer(i)`; the other layers keep the dense MLP, so one class serves
both architectures and plugs into the same runner, graphs and loader.

Same parameter names as Hugging Face's `Qwen3ForCausalLM` except the packed projections
(`qkv_proj`, `gate_up_proj`): `packed_modules_mapping` tells the loader which checkpoint
names feed which packed parameter and shard. Tokens of the whole batch are flattened to
`[num_tokens, hidden]`; per-sequence layout lives in the `AttentionMetadata`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import kernels
from workers.distributed import TensorParallelGroup
from workers.kv_scales import calculate_kv_scales
from workers.layers import (
    Attention,
    AttentionMetadata,
    FusedMoE,
    MergedColumnParallelLinear,
    OutputRows,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from workers.model_config import ModelConfig
from workers.pipeline import PipelineStage, PPMissingLayer


def ops_backend(backend: str) -> str:
    """The backend of the small ops for an attention backend (flash-attn has only attention)."""
    return "auto" if backend == "flash_attn" else backend


class Qwen3Attention(nn.Module):
    """QKV projection, the fused prologue (q/k norm, rotary, KV store), paged attention, o_proj."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        self.ops = ops = ops_backend(backend)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, dtype, cfg.quantization)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        tp, dtype, cfg.quantization)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5, backend)

    def forward(self, positions: Tensor, hidden_states: Tensor,
                attn_metadata: AttentionMetadata, out: OutputRows | None = None) -> Tensor:
        """`[T, hidden]`; with `out`, `[S, hidden]` for its rows only (every K/V still stored)."""
        qkv = self.qkv_proj(hidden_states)
        k_cache, v_cache = self.attn.kv_cache()
        # One launch: q/k norm and rotary in place inside qkv, K/V stored for this and later steps.
        q, k, v = kernels.qk_norm_rope_write_kv(
            qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight,
            self.q_norm.eps, positions, self.rotary_emb.cos_sin_cache, k_cache, v_cache,
            attn_metadata.slot_mapping, backend=self.ops, k_scale=self.attn.k_scale,
            v_scale=self.attn.v_scale, step_cache=attn_metadata.step_cache)
        if self.attn.kv_scales_pending:  # calculate_kv_scales: the first step after start-up
            calculate_kv_scales(self.attn, k, v, attn_metadata.slot_mapping, self.ops)
        o = self.attn(q, k, v, attn_metadata, out)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
                 ops: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, tp, dtype, cfg.quantization)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, dtype,
                                           cfg.quantization)
        self.act_fn = SiluAndMul(ops)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, backend: str, layer_idx: int = 0,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        ops = ops_backend(backend)
        self.self_attn = Qwen3Attention(cfg, tp, rotary_emb, dtype, backend)
        self.mlp: nn.Module
        if cfg.is_sparse_layer(layer_idx):
            self.mlp = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, cfg.norm_topk_prob, tp, dtype, ops,
                                expert_parallel, cfg.quantization)
        else:
            self.mlp = Qwen3MLP(cfg, tp, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None,
                attn_metadata: AttentionMetadata, out: OutputRows | None = None
                ) -> tuple[Tensor, Tensor]:
        """With `out`: the rows of `out` only, past the K/V store (see `Qwen3Model.forward`)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata, out)
        if out is not None:
            residual = residual[out.rows]
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    """One pipeline stage's part (all of it on a single stage): the embedding on the first,
    its layers (the others `PPMissingLayer`, so the indices stay the checkpoint's), the final
    norm on the last."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
                 backend: str, max_position: int, expert_parallel: bool = False,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        ops = ops_backend(backend)
        stage = stage or PipelineStage.single()
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
                             if stage.is_first else None)
        # One cos/sin table shared by every layer.
        rotary_emb = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.yarn)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, tp, rotary_emb, dtype, backend, i, expert_parallel)
            if stage.holds_layer(i) else PPMissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops) if stage.is_last else None

    def forward(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata,
                intermediate: tuple[Tensor, Tensor] | None = None,
                out: OutputRows | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Final hidden states on the last stage; (hidden states, residual) before it.
        `intermediate`: the previous stage's, on every stage but the first.

        `out` (the last stage only): the final hidden states of its rows alone, `[S, hidden]`
        in its order. The last layer stores every token's K/V, then runs attention's queries,
        o_proj, the residual and the MLP for those rows only: a prompt chunk's other rows feed
        no later layer and no logits. On qwen3-tiny (4 layers) that is a quarter of a 256-token
        prefill's layer work (docs/benchmarks.md, issue #43); llama.cpp's `inp_out_ids` does
        the same."""
        if out is not None and self.norm is None:
            raise ValueError("OutputRows apply on the last pipeline stage only")
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, PPMissingLayer):
                hidden_states, residual = layer(positions, hidden_states, residual,
                                                attn_metadata, out if i == last else None)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    """`forward` gives final hidden states for every token; `compute_logits` only for the rows asked."""

    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
                 backend: str = "auto", max_position: int | None = None,
                 expert_parallel: bool = False, stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype  # (the activations'; a quantized layer's weights may differ)
        self.stage = stage or PipelineStage.single()
        self.model = Qwen3Model(cfg, tp, dtype, backend, max_position or cfg.max_context_len,
                                expert_parallel, self.stage)
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
                        if self.stage.is_last else None)
        if cfg.tie_word_embeddings and self.stage.size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata,
                intermediate: tuple[Tensor, Tensor] | None = None,
                out: OutputRows | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Qwen3Model.forward (a Tensor unless pipeline-parallel, before the last stage)."""
        return self.model(input_ids, positions, attn_metadata, intermediate, out)

    def stage_name(self, name: str) -> str | None:
        """The parameter checkpoint tensor `name` fills on this stage (None: another stage's).
        Tied embeddings at pp > 1: the last stage's LM head loads the embedding's table."""
        return self.stage.checkpoint_target(name, self.config.tie_word_embeddings)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        """Logits `[N, vocab_size]` on rank 0; None on the other ranks."""
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers, in order (its KV cache's layers)."""
        return [layer.self_attn.attn for layer in self.model.layers
                if not isinstance(layer, PPMissingLayer)]
