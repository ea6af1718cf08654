"""LoRA in the workers: wrappers of the parallel linear layers and the device slots."""

from workers.lora.layers import (
    BaseLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    LoRABatch,
    RowParallelLinearWithLoRA,
)
from workers.lora.model import LoRAModel, check_lora_plan

__all__ = ["BaseLinearWithLoRA", "ColumnParallelLinearWithLoRA", "LoRABatch", "LoRAModel",
           "RowParallelLinearWithLoRA", "check_lora_plan"]
