"""Tensor-parallel building blocks of the model (nano-vllm's layer set)."""

from workers.layers.attention import Attention, AttentionMetadata, OutputRows
from workers.layers.basic import RMSNorm, RotaryEmbedding, SiluAndMul
from workers.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.layers.moe import FusedMoE
from workers.layers.weights import WeightSource, default_weight_loader

__all__ = ["Attention", "AttentionMetadata", "ColumnParallelLinear", "FusedMoE",
           "MergedColumnParallelLinear", "OutputRows",
           "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear",
           "SiluAndMul", "VocabParallelEmbedding", "WeightSource", "default_weight_loader"]
