"""The sparse MLP block of Qwen3-MoE: a replicated router and the experts, stacked per layer.

Experts live in two stacked parameters, `w13_weight` `[E_local, 2 I_local, H]` (gate rows,
then up rows) and `w2_weight` `[E_local, H, I_local]`, filled straight from the hub's
`mlp.experts.{e}.{gate,up,down}_proj.weight` by their `weight_loader` (shard id
`(e, "gate_proj")` ...): each rank reads only its slice of the memory-mapped file, so no
second copy of the experts is ever made in host memory.

Two ways to split the experts over the tensor-parallel ranks:

* tensor parallel (default): every rank holds every expert, with 1/tp of its intermediate
  dim (gate/up column-parallel, down row-parallel);
* expert parallel (`enable_expert_parallel`): rank r holds whole experts
  [r E/tp, (r+1) E/tp). Attention is tensor-parallel, so every rank already holds every
  token's hidden state after it: the dispatch is local (a rank computes its own experts'
  pairs and skips the rest, expert id -1) and the combine is the layer's one all-reduce,
  exactly as in TP. An all-to-all (or all-gather + reduce-scatter) exchange only pays once
  tokens are sharded over ranks (data-parallel attention), where it moves each token to
  its k experts' ranks (~k/E_ranks of the rows) instead of reducing every row.

Either way the layer ends in one all-reduce of `[T, H]`, so the communication is the dense
MLP's. EP reads whole expert matrices (better GEMM shapes when I/tp gets small); TP balances
work whatever the routing.

FP8 (workers/quantization.py's `Fp8Config`): the stacked weights are e4m3 with
`w13_weight_scale_inv` `[E_local, 2 I_local / bn, ceil(H / bk)]` and `w2_weight_scale_inv`
`[E_local, ceil(H / bn), I_local / bk]` (a hidden size may end in a partial block), loaded
from the hub's per-expert `weight_scale_inv` through the same geometry counted in blocks (or
quantized at load, `quantization: fp8`); gate and up (merged) are whole blocks and every rank
holds whole blocks of what it splits, as in vLLM (refused at construction naming the sizes).
On CPU (no FP8 GEMM) the block also keeps both stacks dequantized to the model's dtype from
load (`dequantized`: what the torch path made on every call), as the FP8 linear layers do.
The fused kernels read the e4m3 experts and their scales, W8A8 (kernels.fused_moe quantizes
each GEMM's input per token and bk group on the fly on Triton; the torch twin dequantizes a
layer's experts and quantizes and dequantizes the inputs before its matmuls).

Memory: a forward's expert buffers (`[T k, I_local]` and `[T k, H]` plus the alignment's
index arrays) have sizes fixed by T alone, not by the routing, so the worker's profiling
forward at the largest batch measures their peak and the KV cache is sized after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from kernels.fp8_reference import FP8_DTYPE, dequantize_weight_blocks, quantize_weight_blocks
from workers.distributed import TensorParallelGroup
from workers.layers.weights import WeightSource, copy_checked
from workers.quantization import Fp8Config, check_fp8_blocks

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FusedMoE(nn.Module):
    """Router (`gate.weight` `[E, H]`, replicated) + experts; `forward(x [T, H]) -> [T, H]`
    summed over the ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TensorParallelGroup, dtype: torch.dtype, ops: str,
                 expert_parallel: bool = False, quant: Fp8Config | None = None) -> None:
        super().__init__()
        ws = tp.world_size
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.ops = ops
        self.dtype = dtype
        self.dequantized: tuple[Tensor, Tensor] | None = None  # (CPU FP8: set once loaded)
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel and ws > 1
        if self.expert_parallel:
            if num_experts % ws:
                raise ValueError(f"enable_expert_parallel: num_experts={num_experts} is not "
                                 f"divisible by tensor_parallel_size={ws}; choose a "
                                 "tensor_parallel_size that divides it, or turn expert "
                                 "parallelism off (tensor parallelism splits every expert)")
            self.num_local_experts = num_experts // ws
            self.expert_start = tp.rank * self.num_local_experts
            self.local_intermediate = intermediate_size
        else:
            if intermediate_size % ws:
                raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                                 f"tensor_parallel_size={ws}; choose a tensor_parallel_size "
                                 "that divides it, or enable_expert_parallel")
            self.num_local_experts = num_experts
            self.expert_start = 0
            self.local_intermediate = intermediate_size // ws
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        e, i = self.num_local_experts, self.local_intermediate
        self.quant = quant
        self.gate = _Router(num_experts, hidden_size, dtype)
        stored = FP8_DTYPE if quant is not None and quant.from_checkpoint else dtype
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=stored),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=stored),
                                      requires_grad=False)
        params = [(self.w13_weight, ("gate_proj", "up_proj"), None),
                  (self.w2_weight, ("down_proj",), None)]
        if quant is not None:  # gate and up: whole blocks (merged); hidden may end partial
            split = ws > 1 and not self.expert_parallel
            check_fp8_blocks(quant, "expert gate_proj/up_proj", [i, i], hidden_size,
                             output_split=split, input_split=False, tensor_parallel_size=ws)
            check_fp8_blocks(quant, "expert down_proj", [hidden_size], i, output_split=False,
                             input_split=split, tensor_parallel_size=ws)
        if quant is not None and quant.from_checkpoint:
            bn, bk = block = quant.weight_block_size
            h_rows, h_cols = -(-hidden_size // bn), -(-hidden_size // bk)
            self.w13_weight_scale_inv = nn.Parameter(
                torch.empty(e, 2 * i // bn, h_cols), requires_grad=False)
            self.w2_weight_scale_inv = nn.Parameter(
                torch.empty(e, h_rows, -(-i // bk)), requires_grad=False)
            params += [(self.w13_weight_scale_inv, ("gate_proj", "up_proj"), block),
                       (self.w2_weight_scale_inv, ("down_proj",), block)]
        for param, projections, block in params:
            param.weight_loader = (self.weight_loader if block is None else
                                   lambda p, loaded, sid, b=block: self.weight_loader(
                                       p, loaded, sid, block=b))
            # What the loader must see for this parameter: every expert's tensors, on every
            # rank (an EP rank checks the shapes of the experts it does not keep).
            param.expert_projections = projections
            param.num_experts = num_experts
            param.checkpoint_suffix = "weight" if block is None else "weight_scale_inv"

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | tuple | None = None,
                      block: tuple[int, int] | None = None) -> None:
        """Copy this rank's part of expert `e`'s `proj` tensor; shard_id is `(e, proj)`; with
        `block`, the tensors are per-block scales and every size is counted in blocks."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and shard_id[1] in EXPERT_PROJECTIONS):
            raise ValueError(f"{loaded.name}: expert shard id must be (expert, one of "
                             f"{EXPERT_PROJECTIONS}); got {shard_id!r}")
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {loaded.name} is for expert {expert}, but "
                             f"config.json has num_experts={self.num_experts}")
        bn, bk = block or (1, 1)
        h, full_i = self.hidden_size, self.intermediate_size
        want = ((-(-h // bn), -(-full_i // bk)) if proj == "down_proj"
                else (-(-full_i // bn), -(-h // bk)))
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint tensor {loaded.name} has shape {tuple(loaded.shape)}; "
                             f"expected {want} (hidden_size={h}, moe_intermediate_size={full_i}"
                             f"{'' if block is None else f', blocks {block}'}): "
                             "does config.json match the weights?")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallelism)
        i = self.local_intermediate
        start = 0 if self.expert_parallel else self.tp.rank * i
        if proj == "down_proj":
            copy_checked(param.data[local], loaded.narrow(1, start // bk, i // bk), loaded.name)
        else:
            offset = 0 if proj == "gate_proj" else i // bn
            copy_checked(param.data[local].narrow(0, offset, i // bn),
                         loaded.narrow(0, start // bn, i // bn), loaded.name)

    def process_weights_after_loading(self) -> None:
        """`quantization: fp8`: quantize the loaded float experts, one expert at a time; on
        CPU, keep them dequantized too (the module docstring)."""
        if self.quant is None:
            return
        block = self.quant.weight_block_size
        if not self.quant.from_checkpoint:
            for name in ("w13_weight", "w2_weight"):
                pairs = [quantize_weight_blocks(w, block) for w in getattr(self, name).data]
                setattr(self, name, nn.Parameter(torch.stack([q for q, _ in pairs]),
                                                 requires_grad=False))
                setattr(self, f"{name}_scale_inv",
                        nn.Parameter(torch.stack([s for _, s in pairs]), requires_grad=False))
        if self.w13_weight.device.type == "cpu":
            self.dequantized = tuple(
                dequantize_weight_blocks(getattr(self, name).data,
                                         getattr(self, f"{name}_scale_inv").data, block,
                                         self.dtype)
                for name in ("w13_weight", "w2_weight"))

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = kernels.moe_route(self.gate(x), self.top_k, self.renormalize)
        if self.expert_parallel:
            ids = ids - self.expert_start
            ids = ids.masked_fill((ids < 0) | (ids >= self.num_local_experts), -1)
        scales = {} if self.quant is None else {
            "w13_scale": self.w13_weight_scale_inv, "w2_scale": self.w2_weight_scale_inv,
            "block": self.quant.weight_block_size,
            "dequantized": self.dequantized if x.dtype == self.dtype else None}
        out = kernels.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids,
                                backend=self.ops, **scales)
        return self.tp.all_reduce(out)


class _Router(nn.Module):
    """`mlp.gate`: router logits `[T, E]` (every rank holds the whole `[E, H]` weight)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)
