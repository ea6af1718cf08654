"""Paged-attention and fused kernels (Triton on CUDA, torch references on CPU) behind one dispatch point."""

from kernels.cpu_linear import linear, pack_linear_weight, transpose_linear_weight
from kernels.ops import (
    FP8_KV_DTYPE,
    Backend,
    compute_cos_sin_cache,
    fp8_block_linear,
    fused_moe,
    lora_expand,
    lora_shrink,
    moe_route,
    paged_attention,
    qk_norm_rope_write_kv,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)

__all__ = ["FP8_KV_DTYPE", "Backend", "compute_cos_sin_cache", "fp8_block_linear", "fused_moe", "linear", "lora_expand",
           "lora_shrink", "moe_route", "pack_linear_weight",
           "paged_attention", "qk_norm_rope_write_kv",
           "rms_norm", "rotary_embedding", "silu_and_mul", "transpose_linear_weight", "write_kv"]
