"""The one dispatch point between the model and its kernels.

`backend="auto"` runs Triton when the tensors are on CUDA and torch otherwise: for paged
attention the fast CPU path (`kernels/cpu_attention.py`: decode in a C++ op, prefill on torch's
fused SDPA), for RMSNorm, SiLU-and-mul and the attention prologue the CPU versions with fewer
calls (`kernels/cpu_fused.py`, bit-identical to the twins), for sampling the C++ op of
`kernels/csrc/sample_cpu.cpp` (the twin's draw token for token, but at a chunk's or token's edge
within float rounding), for the other ops the torch reference. `"torch"` runs the plain-torch
reference twins (`kernels/reference.py`), the oracle the other backends are tested against.
`"triton"` also accepts CPU tensors when `TRITON_INTERPRET=1` is set (how the kernel tests run
without a GPU). `"flash_attn"` exists for `paged_attention` only.

The Triton modules are imported on first use, not here: `TRITON_INTERPRET` is read when a
`@triton.jit` function is defined, and a CPU-only process (the workers' CPU path) never needs them.
Argument checks look at shapes and dtypes only, never at tensor values, so they cost no device
sync and are safe inside CUDA-graph capture.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from torch import Tensor

from kernels import (
    cpu_attention,
    cpu_extension,
    cpu_fused,
    fp8_reference,
    lora_reference,
    moe_reference,
    reference,
)
from kernels.reference import FP8_KV_DTYPE
from kernels.rotary_tables import compute_cos_sin_cache

Backend = Literal["auto", "triton", "flash_attn", "torch"]
_BACKENDS = ("auto", "triton", "flash_attn", "torch")

__all__ = ["FP8_KV_DTYPE", "Backend", "compute_cos_sin_cache", "fp8_block_linear", "fused_moe",
           "lora_expand",
           "lora_shrink", "moe_route", "paged_attention", "paged_attention_decode_shapes",
           "qk_norm_rope_write_kv",
           "rms_norm", "rotary_embedding", "sample_tokens", "silu_and_mul", "write_kv"]


def _resolve(backend: str, t: Tensor, *, allow_flash: bool = False) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "flash_attn" and not allow_flash:
        raise ValueError("backend 'flash_attn' exists only for paged_attention; "
                         "use 'auto', 'triton' or 'torch' for this op")
    if backend == "auto":
        return "triton" if t.is_cuda else "torch"
    if backend == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "kernels are first used); use backend 'torch' or 'auto' on CPU")
    return backend


def _check_kv_scales(k_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
                     chosen: str) -> None:
    """An FP8 cache needs one scale per KV head (a per-tensor scale: the vector filled with
    it) and the torch or Triton kernels."""
    if k_cache.dtype != reference.FP8_KV_DTYPE:
        return
    heads = k_cache.shape[2]
    if any(s is None or s.shape != (heads,) or s.dtype != torch.float32
           for s in (k_scale, v_scale)):
        got = [None if s is None else f"{s.dtype} {tuple(s.shape)}" for s in (k_scale, v_scale)]
        raise ValueError(f"an FP8 (float8_e4m3fn) KV cache needs k_scale and v_scale, float32 "
                         f"[Hkv={heads}] (one per KV head; fill it for a per-tensor scale); "
                         f"got {got}")
    if chosen == "flash_attn":
        raise ValueError("the 'flash_attn' kernels do not read an FP8 KV cache; use backend "
                         "'triton' or 'torch' (kv_cache_dtype 'fp8')")


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             backend: Backend = "auto", k_scale: Tensor | None = None,
             v_scale: Tensor | None = None) -> None:
    """Store `key`/`value` `[T, Hkv, D]` into the paged caches at `slot_mapping` (`-1` = skip);
    an FP8 cache stores each head's divided by its `k_scale` / `v_scale` (float32 `[Hkv]`)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key/value must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}] to match "
                         f"the cache; got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}]; got {tuple(slot_mapping.shape)}")
    chosen = _resolve(backend, key)
    _check_kv_scales(k_cache, k_scale, v_scale, chosen)
    if chosen == "torch":
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from kernels.triton_kv import write_kv as triton_write_kv
    triton_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    max_query_len: int, max_seq_len: int, backend: Backend = "auto",
                    key: Tensor | None = None, value: Tensor | None = None,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                    step_cache: dict | None = None) -> Tensor:
    """Causal paged attention over a mixed prefill/decode batch; returns `[T, Hq, D]` in q's dtype.

    Query token j of sequence b (q_len_b tokens) sits at position `seq_lens[b] - q_len_b + j`;
    this step's K/V must already be in the cache. Block-table entries past a sequence's
    ceil(seq_len / block_size) blocks are never read. `max_query_len`/`max_seq_len` are upper
    bounds the caller already knows (no device sync): pure-decode batches
    (`max_query_len == 1`) take the decode tiles (split-K for long contexts), others the
    prefill tiles. `key`/`value` `[T, Hkv, D]`, optional, are this step's rows exactly as
    written to the cache: the Triton kernel then reads each chunk's own keys from them
    (contiguous) instead of through the block table; the other backends ignore them.
    An FP8 cache is read times each head's `k_scale` / `v_scale` (float32 `[Hkv]`).
    `step_cache`, optional: a dict that lives exactly as long as this metadata (one step's
    `AttentionMetadata`), where the CPU path keeps what it derives from the metadata once for
    every layer; the other backends ignore it.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, Hq, D] and k/v caches [num_blocks, block_size, Hkv, D]; "
                         f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the cache's KV heads "
                         f"({num_kv_heads}) and head_dim must match ({q.shape[2]} vs {head_dim})")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"for {num_seqs} sequences query_start_loc must be [{num_seqs + 1}] and "
                         f"block_tables [{num_seqs}, max_blocks]; got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    if max_query_len < 1 or max_seq_len < max_query_len:
        raise ValueError(f"need 1 <= max_query_len <= max_seq_len; got {max_query_len}, {max_seq_len}")
    if (key is None) != (value is None):
        raise ValueError("pass both key and value (this step's K/V rows) or neither")
    if key is not None and (key.shape != value.shape
                            or key.shape != (q.shape[0], num_kv_heads, head_dim)):
        raise ValueError(f"key/value must be [T={q.shape[0]}, {num_kv_heads}, {head_dim}] (this "
                         f"step's K/V rows); got {tuple(key.shape)} and {tuple(value.shape)}")
    chosen = _resolve(backend, q, allow_flash=True)
    _check_kv_scales(k_cache, k_scale, v_scale, chosen)
    if chosen == "torch":
        # "auto" on CPU: the fused-SDPA path; "torch" asked for by name: the reference twin.
        if backend == "torch":
            return reference.paged_attention(q, k_cache, v_cache, block_tables,
                                             query_start_loc, seq_lens, scale, k_scale, v_scale)
        return cpu_attention.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                             seq_lens, scale, k_scale, v_scale, step_cache)
    if chosen == "flash_attn":
        from kernels.flash_attn_backend import paged_attention as flash_paged_attention
        return flash_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                     scale, max_query_len, max_seq_len)
    from kernels.triton_attention import paged_attention as triton_paged_attention
    return triton_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  scale, max_query_len, max_seq_len, key, value, k_scale, v_scale)


def paged_attention_decode_shapes(max_num_seqs: int, num_kv_heads: int, max_model_len: int,
                                  device: torch.device, backend: Backend = "auto"
                                  ) -> list[tuple[int, int]]:
    """Decode batches (batch size, max_seq_len), one per kernel that `paged_attention` compiles
    for some decode step of at most `max_num_seqs` sequences within `max_model_len` on `device`
    (the Triton kernel's split-K factors): what a start-up warm-up runs so that no decode step
    compiles later. Empty where the backend compiles nothing."""
    if not (backend == "triton" or (backend == "auto" and device.type == "cuda")):
        return []
    from kernels.attention_split import decode_launch_shapes
    return decode_launch_shapes(max_num_seqs, num_kv_heads, max_model_len, device)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
             backend: Backend = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Qwen3RMSNorm over the last dim; with `residual` returns `(norm(x + residual), x + residual)`."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}] (x's last dim); "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if _resolve(backend, x) == "torch":
        twin = reference if backend == "torch" else cpu_fused  # "auto" on CPU: fewer calls
        return twin.rms_norm(x, weight, eps, residual)
    from kernels.triton_fused import rms_norm as triton_rms_norm
    return triton_rms_norm(x, weight, eps, residual)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                     backend: Backend = "auto") -> tuple[Tensor, Tensor]:
    """NeoX/HF rotary embedding applied to q `[T, Hq, D]` and k `[T, Hkv, D]` in place; returns (q, k)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k must be [T, H, D] with equal T and D; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or cos_sin_cache.dim() != 2 \
            or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError(f"positions must be [T={q.shape[0]}] and cos_sin_cache [max_pos, "
                         f"{q.shape[2]}]; got {tuple(positions.shape)}, {tuple(cos_sin_cache.shape)}")
    if _resolve(backend, q) == "torch":
        return reference.rotary_embedding(positions, q, k, cos_sin_cache)
    from kernels.triton_fused import rotary_embedding as triton_rotary_embedding
    return triton_rotary_embedding(positions, q, k, cos_sin_cache)


def qk_norm_rope_write_kv(qkv: Tensor, num_q_heads: int, num_kv_heads: int, q_weight: Tensor,
                          k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                          k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          backend: Backend = "auto", k_scale: Tensor | None = None,
                          v_scale: Tensor | None = None, step_cache: dict | None = None
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3's attention prologue on the QKV projection's output `[T, (Hq + 2 Hkv) D]`, one launch.

    q and k get their per-head RMSNorm (`q_weight`/`k_weight` `[D]`) and the rotary embedding at
    `positions`, in place inside `qkv`; K and V are stored into the paged caches at
    `slot_mapping` (-1 = skip), an FP8 cache divided by each head's `k_scale` / `v_scale`
    (float32 `[Hkv]`). Returns the views
    (q `[T, Hq, D]`, k, v `[T, Hkv, D]`) of `qkv`. `step_cache`, optional: the step's
    `AttentionMetadata.step_cache`, where the CPU path keeps the rotary rows of `positions` and
    the slots it writes once for every layer; the other backends ignore it.
    """
    if qkv.dim() != 2 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"qkv must be [T, (Hq + 2 Hkv) * D] and k/v caches [num_blocks, "
                         f"block_size, Hkv, D]; got qkv {tuple(qkv.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    head_dim = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv's width {qkv.shape[1]} must be (Hq={num_q_heads} + 2 * Hkv="
                         f"{num_kv_heads}) * head_dim={head_dim}, and the cache must hold "
                         f"{num_kv_heads} KV heads (it holds {k_cache.shape[2]})")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q/k norm weights must be [{head_dim}]; got {tuple(q_weight.shape)}, "
                         f"{tuple(k_weight.shape)}")
    if positions.shape != (qkv.shape[0],) or slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"positions and slot_mapping must be [T={qkv.shape[0]}]; got "
                         f"{tuple(positions.shape)}, {tuple(slot_mapping.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}]; got "
                         f"{tuple(cos_sin_cache.shape)}")
    args = (qkv, num_q_heads, num_kv_heads, q_weight, k_weight, eps, positions, cos_sin_cache,
            k_cache, v_cache, slot_mapping)
    chosen = _resolve(backend, qkv)
    _check_kv_scales(k_cache, k_scale, v_scale, chosen)
    if chosen == "torch":
        if backend == "torch":
            return reference.qk_norm_rope_write_kv(*args, k_scale, v_scale)
        return cpu_fused.qk_norm_rope_write_kv(*args, k_scale, v_scale, step_cache)
    from kernels.triton_fused import qk_norm_rope_write_kv as triton_qk_norm_rope_write_kv
    return triton_qk_norm_rope_write_kv(*args, k_scale, v_scale)


def silu_and_mul(x: Tensor, backend: Backend = "auto") -> Tensor:
    """`[..., 2I] -> silu(x[..., :I]) * x[..., I:]`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate and up halves); got {x.shape[-1]}")
    if _resolve(backend, x) == "torch":
        return (reference if backend == "torch" else cpu_fused).silu_and_mul(x)
    from kernels.triton_fused import silu_and_mul as triton_silu_and_mul
    return triton_silu_and_mul(x)


def sample_tokens(logits: Tensor, rng_key: Tensor, rng_counter: Tensor,
                  temperature: Tensor | None = None, backend: Backend = "auto") -> Tensor:
    """One token per row of `logits` `[S, V]`: int64 `[S]` on the logits' device.

    Rows whose temperature is not > 0 take their first maximum; the others draw from
    `softmax(logits / temperature)` at the uniform of their stream (`rng_key`, `rng_counter`:
    int64 `[S]`); with no `temperature` every row draws from `softmax(logits)`. See
    `reference.sample_tokens`.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [S, V] tensor; got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    rows = logits.shape[0]
    for name, t in (("rng_key", rng_key), ("rng_counter", rng_counter)):
        if t.shape != (rows,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [S={rows}]; got {t.dtype} {tuple(t.shape)}")
    if temperature is not None and (temperature.shape != (rows,)
                                    or temperature.dtype != torch.float32):
        raise ValueError(f"temperature must be float32 [S={rows}]; got {temperature.dtype} "
                         f"{tuple(temperature.shape)}")
    if _resolve(backend, logits) == "torch":
        # "auto" on CPU: the C++ op (the twin's draw, one pass per row) where it is built;
        # "torch" asked for by name: the reference twin.
        op = (cpu_extension.sample_rows() if backend == "auto" and logits.dtype == torch.float32
              and logits.stride(1) == 1 else None)
        if op is not None:
            return op(logits, rng_key.contiguous(), rng_counter.contiguous(), temperature)
        return reference.sample_tokens(logits, rng_key, rng_counter, temperature)
    from kernels.triton_sampling import sample_tokens as triton_sample_tokens
    return triton_sample_tokens(logits, rng_key, rng_counter, temperature)


def moe_route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE's router on `[T, E]` logits: (weights `[T, k]`, expert ids `[T, k]` int64).

    Softmax in fp32, top-k, renormalised to sum 1 when `renormalize` (`norm_topk_prob`);
    a few small torch ops on every backend (no host read, graph-capturable).
    """
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"router_logits must be [T, E] and top_k in [1, E]; got "
                         f"{tuple(router_logits.shape)} and top_k={top_k}")
    return moe_reference.route(router_logits, top_k, renormalize)


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              backend: Backend = "auto", w13_scale: Tensor | None = None,
              w2_scale: Tensor | None = None, block: tuple[int, int] | None = None,
              dequantized: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The experts of a sparse MLP block: `[T, H]` in x's dtype.

    Token t's output is `sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)` with
    `e = topk_ids[t, j]` and `g, u = w13[e] @ x_t` split in halves: x `[T, H]`, w13
    `[E, 2I, H]` (gate rows, then up rows), w2 `[E, H, I]`. `topk_ids` index this rank's
    E experts; -1 marks an expert held by another rank (expert parallelism), which adds
    nothing here. Triton: grouped GEMMs over tokens sorted by expert, no host sync; torch:
    the same grouping with batched matmuls. Block-scaled FP8 experts: w13/w2 e4m3 with
    `w13_scale` `[E, 2I / bn, H / bk]`, `w2_scale` `[E, H / bn, I / bk]` float32 and
    `block = (bn, bk)` (kernels/fp8_reference.py's format): W8A8, each GEMM's input quantized
    per row and `bk` group on the fly and the e4m3 products scaled in registers (Triton), or
    the experts dequantized and the inputs quantized and dequantized before the matmuls (torch).
    `dequantized`: that torch path's (w13, w2) in x's dtype, made once beforehand (a CPU layer
    keeps them from load) instead of per call; the Triton kernels ignore it.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, hidden, inter = w2.shape
    if w13.shape != (num_experts, 2 * inter, hidden) or x.shape[1] != hidden:
        raise ValueError(f"w13 must be [E={num_experts}, 2I={2 * inter}, H={hidden}] to match w2 "
                         f"{tuple(w2.shape)} and x {tuple(x.shape)}; got {tuple(w13.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={x.shape[0]}, k]; got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    fp8 = w13.dtype == fp8_reference.FP8_DTYPE
    if fp8 or w13_scale is not None:
        _check_expert_scales(w13, w2, w13_scale, w2_scale, block)
    if _resolve(backend, x) == "torch":
        if fp8:
            made = dequantized or (None, None)
            w13 = fp8_reference.dequantized_weight(w13, w13_scale, block, x.dtype, made[0])
            w2 = fp8_reference.dequantized_weight(w2, w2_scale, block, x.dtype, made[1])
        return moe_reference.fused_moe(x, w13, w2, topk_weights, topk_ids,
                                       act_group=block[1] if fp8 else None)
    from kernels.triton_moe import fused_moe as triton_fused_moe
    return triton_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                            w2_scale=w2_scale, block=block)


def _check_expert_scales(w13: Tensor, w2: Tensor, w13_scale: Tensor | None,
                         w2_scale: Tensor | None, block: tuple[int, int] | None) -> None:
    """Block-scaled FP8 experts need both scale grids (`ceil`: a partial last block has its
    own scale), a power-of-two block >= 16 (the Triton K loop steps one block) and e4m3
    weights."""
    if block is None or w13_scale is None or w2_scale is None:
        raise ValueError("fused_moe: FP8 (float8_e4m3fn) experts need w13_scale, w2_scale and "
                         "block")
    bn, bk = block
    if bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"fused_moe: FP8 expert blocks must be powers of two >= 16; got {block}")
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        grid = (w.shape[0], -(-w.shape[1] // bn), -(-w.shape[2] // bk))
        if w.dtype != fp8_reference.FP8_DTYPE or tuple(s.shape) != grid \
                or s.dtype != torch.float32:
            raise ValueError(f"fused_moe: {name} must be float8_e4m3fn with float32 scales "
                             f"{grid} for block {block}; got {w.dtype} and {s.dtype} "
                             f"{tuple(s.shape)}")


def _check_lora(x: Tensor, weights: Tensor, token_slots: Tensor, x_width: int, what: str) -> None:
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != x_width:
        raise ValueError(f"{what}: x must be [T, {x_width}] and the stacked weights [S, ., .]; "
                         f"got {tuple(x.shape)} and {tuple(weights.shape)}")
    if token_slots.dtype != torch.int64 or token_slots.dim() != 1 \
            or token_slots.shape[0] < x.shape[0]:
        raise ValueError(f"{what}: token_slots must be int64 [>= T={x.shape[0]}]; got "
                         f"{token_slots.dtype} {tuple(token_slots.shape)}")
    if any(n * weights.element_size() % 16 for n in weights.shape[1:]):
        raise ValueError(f"{what}: the stacked weights' rows must be multiples of 16 bytes "
                         f"(grouped GEMMs); got {tuple(weights.shape)} {weights.dtype}: pad the "
                         "rank with zero rows/columns")


def lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor,
                backend: Backend = "auto") -> Tensor:
    """Batched LoRA shrink: `[T, R]`, row t = `x[t] @ lora_a[token_slots[t]]^T`.

    `x` `[T, in]`; `lora_a` `[S, R, in]` stacked by slot, its last slot zeros; `token_slots`
    int64 `[>= T]` (a persistent buffer: only the first T are read), -1 = the base model
    (a zero row). R and `in` times the item size must be multiples of 16 bytes (pad R with
    zeros). kernels/lora_reference.py states the layout.
    """
    _check_lora(x, lora_a, token_slots, lora_a.shape[-1], "lora_shrink")
    if _resolve(backend, x) == "torch":
        return lora_reference.lora_shrink(x, lora_a, token_slots)
    from kernels.triton_lora import lora_shrink as triton_lora_shrink
    return triton_lora_shrink(x, lora_a, token_slots)


def lora_expand(y: Tensor, lora_b: Tensor, token_slots: Tensor, out: Tensor,
                backend: Backend = "auto") -> None:
    """Batched LoRA expand, in place: `out[t] += y[t] @ lora_b[token_slots[t]]^T`.

    `y` `[T, R]` (lora_shrink's), `lora_b` `[S, out, R]` stacked by slot (last slot zeros),
    `out` `[T, out]`; -1 slots add nothing.
    """
    _check_lora(y, lora_b, token_slots, lora_b.shape[-1], "lora_expand")
    if out.shape != (y.shape[0], lora_b.shape[1]):
        raise ValueError(f"lora_expand: out must be [T={y.shape[0]}, {lora_b.shape[1]}]; got "
                         f"{tuple(out.shape)}")
    if _resolve(backend, y) == "torch":
        lora_reference.lora_expand(y, lora_b, token_slots, out)
        return
    from kernels.triton_lora import lora_expand as triton_lora_expand
    triton_lora_expand(y, lora_b, token_slots, out)


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                     block: tuple[int, int], backend: Backend = "auto",
                     dequantized: Tensor | None = None) -> Tensor:
    """`x [M, K] @ W.T` for a block-scaled FP8 weight (e4m3 `[N, K]`, float32 scales per
    `block = (bn, bk)`: `[ceil(N/bn), ceil(K/bk)]`), activations quantized per token and `bk`
    group on the fly (W8A8); `[M, N]` in x's dtype. kernels/fp8_reference.py states the format.
    `dequantized` (float32 `[N, K]`, `fp8_reference.dequantize_weight_blocks` of the weight):
    the torch path's weight made once instead of per call; the Triton kernel reads the FP8
    weight itself and ignores it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_block_linear: x must be [M, K] and weight [N, K]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    bn, bk = block
    grid = (-(-weight.shape[0] // bn), -(-weight.shape[1] // bk))
    if weight.dtype != fp8_reference.FP8_DTYPE or weight_scale_inv.shape != grid \
            or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn and weight_scale_inv "
                         f"float32 {grid} for block {block}; got {weight.dtype} and "
                         f"{weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")
    if _resolve(backend, x) == "torch":
        return fp8_reference.fp8_block_linear(x, weight, weight_scale_inv, block, dequantized)
    if bk < 16 or bk & (bk - 1) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"the Triton FP8 GEMM needs power-of-two weight blocks >= 16; got "
                         f"{block}: use backend 'torch'")
    from kernels.triton_fp8 import fp8_block_linear as triton_fp8_block_linear
    return triton_fp8_block_linear(x, weight, weight_scale_inv, block)
