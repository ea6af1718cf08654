"""PEFT adapters of qwen3-tiny made by peft itself, and the oracle: transformers with the
adapter merged into the base weights (peft's merge_and_unload), greedy in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out_dir: Path, *, r: int = 8, lora_alpha: int = 16,
                 target_modules: list[str] | None = None, seed: int = 0,
                 use_rslora: bool = False, std: float = 0.08, **config: object) -> str:
    """Save a LoRA adapter of the base model with random non-zero A and B (so it changes the
    outputs); extra `config` fields go into peft's LoraConfig."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora,
                     target_modules=target_modules or ALL_MODULES, **config)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def edit_config(adapter_dir: str, **fields: object) -> None:
    """Change fields of a saved adapter_config.json (to make adapters peft would not save)."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def merged_greedy(base_path: str, adapter_dir: str | None, prompts: list[list[int]],
                  max_new: int) -> list[list[int]]:
    """Greedy tokens of transformers with the adapter merged (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]
