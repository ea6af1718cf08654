"""Pipeline parallelism: the layer partition, the rank layout and the stage-to-stage hand-over.

A replica of `pipeline_parallel_size` (pp) x `tensor_parallel_size` (tp) ranks: global rank
g is stage g // tp, tensor-parallel rank g % tp; stage s is ranks [s * tp, (s + 1) * tp), each
stage its own tensor-parallel group (a `new_group` over the one world process group, gloo on
CPU, NCCL on CUDA). Stage s holds layers [start, end) of the partition (`get_pp_indices`):
the embedding on the first stage, the final norm and the LM head on the last.

Invariants: every rank receives every plan, in order, and runs the same collectives in the
same order, so a plan's hidden states go stage to stage with plain send/recv (rank (s, t)
sends to (s + 1, t): after a layer's all-reduce every rank of a stage holds the whole hidden
states and residual); their shape is known on both sides from the plan (its token count).
The last stage's first rank is the output rank: it samples and its StepResult is the
replica's. Async scheduling's pending tokens are broadcast from it to every rank
(`OutputBroadcast`), so the first stage embeds the token the last stage sampled.
A step that replays a CUDA graph hands over the same way, from and into the stage graph's
static buffers (`recv_into`; workers/cuda_graph.py).
A stage's LoRA wrappers cover only its layers (workers/lora/model.py); the pooling runner's
pooler is the last stage's alone (the other stages pass hidden states on as for generation).
A base model saved alone (Qwen3-Embedding: `layers.0...`, no `model.`) is split by the same
rule as a causal LM's names (`checkpoint_target`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

# the first part of a tensor name of a base model saved alone (Qwen3-Embedding: no `model.`)
_BARE_MODEL_PREFIXES = ("layers", "embed_tokens", "norm")
# vLLM's environment variable for the partition; the engine key `pp_layer_partition` wins.
PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def layer_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """Layers per stage. `partition` ("3,1"; None: the environment's VLLM_PP_LAYER_PARTITION,
    else an even split) must name pp_size counts >= 1 that sum to `num_layers`; the even split
    gives a remainder's layers to the stages before the last, from the second-to-last
    backwards (vLLM's rule: the last stage also holds the LM head)."""
    if partition is None:
        partition = os.environ.get(PP_LAYER_PARTITION_ENV) or None
    if partition is None:
        if num_layers < pp_size:
            raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's "
                             f"{num_layers} layers; every stage needs at least one")
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
        return parts
    try:
        parts = [int(p) for p in str(partition).split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition {partition!r} must be comma-separated layer "
                         f"counts, one per stage (e.g. '3,1')") from None
    if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
        raise ValueError(f"pp_layer_partition {partition!r} must give each of the "
                         f"{pp_size} stages at least one layer and sum to the model's "
                         f"{num_layers} layers; got {len(parts)} count(s) summing to {sum(parts)}")
    return parts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int,
                   partition: str | None = None) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds (vLLM's name)."""
    parts = layer_partition(num_layers, pp_size, partition)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


@dataclass(slots=True)
class PipelineStage:
    """This rank's stage: which layers it holds and where its hidden states come from and go.
    `single()` is the whole model on one stage (no send, no receive)."""

    rank: int = 0  # the stage's index
    size: int = 1  # pipeline_parallel_size
    start_layer: int = 0
    end_layer: int = -1  # -1: every layer (a single stage)
    global_rank: int = 0
    tp_size: int = 1
    # seconds this stage spent running its layers (not waiting on send/recv): what
    # bench/pp_bench.py's bubble is measured from (host time: synchronous on CPU only)
    busy_s: float = 0.0

    @classmethod
    def single(cls) -> PipelineStage:
        return cls()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds_layer(self, index: int) -> bool:
        return self.end_layer < 0 or self.start_layer <= index < self.end_layer

    def checkpoint_target(self, name: str, tied: bool) -> str | None:
        """The parameter checkpoint tensor `name` fills on this stage; None: another stage's.
        With tied embeddings the last stage's own LM head loads the embedding's table."""
        if self.size == 1:
            return name
        if name.split(".", 1)[0] in _BARE_MODEL_PREFIXES:  # a base model saved alone
            target = self.checkpoint_target("model." + name, tied)
            return name if target == "model." + name else target
        if name.startswith("model.layers."):
            return name if self.holds_layer(int(name.split(".")[2])) else None
        if name.startswith("model.embed_tokens."):
            if self.is_first:
                return name
            return "lm_head." + name[len("model.embed_tokens."):] if tied and self.is_last else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last else None
        return name

    def forward(self, model: nn.Module, input_ids: Tensor, positions: Tensor,
                attn_metadata: object, out: object | None = None) -> Tensor | None:
        """Run this stage's part of `model`: receive the previous stage's hidden states, run
        the layers, send them on. The final hidden states on the last stage (of `out`'s rows
        only when given: workers/qwen3.py); None before."""
        if self.size == 1:
            if out is not None:
                return model(input_ids, positions, attn_metadata, out=out)
            return model(input_ids, positions, attn_metadata)
        intermediate = None
        if not self.is_first:
            intermediate = self.recv(input_ids.shape[0], model.config.hidden_size, model.dtype,
                                     input_ids.device)
        start = time.perf_counter()
        result = model(input_ids, positions, attn_metadata, intermediate,
                       out if self.is_last else None)
        self.busy_s += time.perf_counter() - start
        if self.is_last:
            return result
        self.send(*result)
        return None

    def send(self, hidden: Tensor, residual: Tensor) -> None:
        """Hand this stage's output to the same tensor-parallel rank of the next stage."""
        dst = self.global_rank + self.tp_size
        dist.send(hidden.contiguous(), dst=dst)
        dist.send(residual.contiguous(), dst=dst)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[Tensor, Tensor]:
        """The previous stage's (hidden states, residual) of a step of `num_tokens` tokens."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        self.recv_into(hidden, residual)
        return hidden, residual

    def recv_into(self, hidden: Tensor, residual: Tensor) -> None:
        """Receive the previous stage's (hidden states, residual) into these tensors (a CUDA
        graph's static inputs: workers/cuda_graph.py), whose shapes the step's plan fixes."""
        src = self.global_rank - self.tp_size
        dist.recv(hidden, src=src)
        dist.recv(residual, src=src)


class PPMissingLayer(nn.Module):
    """A decoder layer another stage holds: keeps the layer indices the checkpoint's; no
    parameters, never run."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a layer of another pipeline stage was run on this one")


class OutputBroadcast:
    """The group async scheduling's pending tokens come from (workers/pending.py): the output
    rank (the last stage's first) broadcasts the ids it sampled to every rank of the replica.
    Same interface as TensorParallelGroup's `is_first` / `broadcast_from_first`."""

    def __init__(self, global_rank: int, output_rank: int) -> None:
        self.output_rank = output_rank
        self.is_first = global_rank == output_rank

    def broadcast_from_first(self, x: Tensor) -> Tensor:
        dist.broadcast(x, src=self.output_rank)
        return x
