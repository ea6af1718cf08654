"""What a decode step launches, counted at the dispatch point, on CPU and CUDA alike.

`LaunchCounter` records every Triton launch by kernel name and every computing torch op (GEMMs
as "gemm"), and host reads of tensor values apart; `build_decode_layer` makes one Qwen3 decoder
layer with random weights and its own paged KV cache, and a closure that runs a decode step of
it. bench/kernels_bench.py profiles the whole step on a GPU with these; the kernel tests count a
layer's launches under Triton's interpreter (tests/kernels/test_decode_launches.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.distributed import TensorParallelGroup  # noqa: E402
from workers.layers.attention import AttentionMetadata  # noqa: E402
from workers.model_config import ModelConfig  # noqa: E402
from workers.qwen3 import Qwen3DecoderLayer  # noqa: E402

BLOCK_SIZE = 16
SEED = 0
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128)

_ATEN = torch.ops.aten
# Ops that allocate or reinterpret memory but launch no kernel.
_NO_LAUNCH = {_ATEN.empty.memory_format, _ATEN.empty_like.default, _ATEN.empty_strided.default,
              _ATEN.new_empty.default, _ATEN.new_empty_strided.default, _ATEN.detach.default,
              _ATEN.alias.default, _ATEN._unsafe_view.default, _ATEN.lift_fresh.default}
# Ops that read a tensor's values on the host (a device sync; not capturable in a CUDA graph).
_HOST_READS = {_ATEN._local_scalar_dense.default, _ATEN.nonzero.default, _ATEN.equal.default}


_GEMMS = {"mm", "addmm", "linear", "matmul", "bmm", "baddbmm"}


def _has_tensor(out: object) -> bool:
    """Whether an op's result holds a tensor (ops on dtypes or sizes launch nothing)."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)


class LaunchCounter(TorchDispatchMode):
    """Records every kernel launch under it: each Triton launch by kernel name, each torch op
    that computes by op name (any GEMM entry point as "gemm"); views and allocations are not
    launches. Host reads of tensor values are recorded apart in `host_reads`. Torch ops that
    Triton's interpreter runs inside a launch (copying arguments) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self.host_reads: list[str] = []
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._in_triton:
            name = func.overloadpacket.__name__
            if func in _HOST_READS:
                self.host_reads.append(name)
            elif not func.is_view and func not in _NO_LAUNCH and _has_tensor(out):
                self.launches.append("gemm" if name in _GEMMS else f"aten.{name}")
        return out

    @contextlib.contextmanager
    def counting(self) -> Iterator[LaunchCounter]:
        """Enter the mode with Triton's launch entry points (compiled and interpreted) wrapped."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
        counter = self

        def wrap(run: Callable) -> Callable:
            def counted_run(fn, *args, grid, warmup, **kwargs):
                if not warmup:
                    counter.launches.append(f"triton.{fn.fn.__name__}")
                counter._in_triton += 1
                try:
                    return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
                finally:
                    counter._in_triton -= 1
            return counted_run

        for cls, run in originals.items():
            cls.run = wrap(run)
        try:
            with self:
                yield self
        finally:
            for cls, run in originals.items():
                cls.run = run


def model_config(**shape: int) -> ModelConfig:
    """A Qwen3 config of the given shape (Qwen3-0.6B's by default)."""
    fields = {**QWEN3_0_6B, **shape}
    return ModelConfig(model="qwen3-shapes", max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, dtype="bfloat16",
                       bos_token_id=None, eos_token_ids=(0,), **fields)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights: N(0, 0.02) matrices, norms 1 + N(0, 0.1)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            values = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            values = 0.02 * torch.randn(p.shape, generator=gen)
        p.data.copy_(values.to(p.dtype))


def decode_metadata(batch: int, ctx: int, num_blocks: int, max_seq_len: int,
                    device: torch.device, seed: int = SEED
                    ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of a decode step: B sequences of `ctx` tokens (this one included)
    on disjoint shuffled blocks of a cache of `num_blocks` blocks."""
    per_seq = -(-ctx // BLOCK_SIZE)
    if batch * per_seq > num_blocks:
        raise ValueError(f"{batch} sequences of {ctx} tokens need {batch * per_seq} blocks; "
                         f"the cache has {num_blocks}")
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    pos = ctx - 1
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    md = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(torch.int32).to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=max_seq_len)
    return torch.full((batch,), pos, dtype=torch.int64, device=device), md


def build_decode_layer(cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype,
                       device: torch.device, backend: str, max_seq_len: int | None = None
                       ) -> tuple[Qwen3DecoderLayer, Callable[[], tuple[torch.Tensor, ...]]]:
    """One decoder layer with random weights and its own random KV cache, and a closure that runs
    a decode step of it (hidden states and residual from a previous layer)."""
    from workers.layers import RotaryEmbedding

    tp = TensorParallelGroup.single()
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    layer = Qwen3DecoderLayer(cfg, tp, rotary, dtype, backend).to(device)
    randomize_(layer, SEED)
    num_blocks = batch * -(-ctx // BLOCK_SIZE) + 1
    gen = torch.Generator().manual_seed(SEED + 1)
    cache_shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    layer.self_attn.attn.k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    layer.self_attn.attn.v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    positions, md = decode_metadata(batch, ctx, num_blocks, max_seq_len or ctx, device)
    hidden = torch.randn(batch, cfg.hidden_size, generator=gen).to(dtype).to(device)
    residual = torch.randn(batch, cfg.hidden_size, generator=gen).to(dtype).to(device)
    return layer, lambda: layer(positions, hidden, residual, md)


def count_layer_launches(cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype,
                         device: torch.device, backend: str, max_seq_len: int | None = None
                         ) -> LaunchCounter:
    """The launches of one decode step of one decoder layer (after a warm-up step)."""
    _, step = build_decode_layer(cfg, batch, ctx, dtype, device, backend, max_seq_len)
    with torch.inference_mode():
        step()
        with LaunchCounter().counting() as counter:
            step()
    return counter
