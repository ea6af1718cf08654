"""PEFT adapters of qwen3-tiny made by peft itself, and the oracle: transformers with the
adapter merged into the base weights (peft's merge_and_unload), greedy in fp32."""

from __future__ import annotations

import json
import random
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


def mixed_prompts() -> list[list[int]]:
    """Four prompts: two sharing a 40-token prefix (2.5 blocks of 16), two of their own."""
    rng = random.Random(3)
    shared = [rng.randrange(100, 150000) for _ in range(40)]
    return [shared + [rng.randrange(100, 150000) for _ in range(k)] for k in (2, 11)] + \
        [[rng.randrange(100, 150000) for _ in range(k)] for k in (5, 23)]


def three_adapters(base_path: str, root: Path) -> dict[str, str]:
    """name -> adapter dir: "a" every module r 8, "b" r 4 on four modules, "c" rsLoRA on k
    and the MLP's gate/up (so q/v/o/down of "c" and k/gate/up of "b" stay zero)."""
    return {
        "a": make_adapter(base_path, root / "a", r=8, seed=1),
        "b": make_adapter(base_path, root / "b", r=4, lora_alpha=8, seed=2,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
        "c": make_adapter(base_path, root / "c", r=8, seed=3, use_rslora=True,
                          target_modules=["k_proj", "gate_proj", "up_proj"]),
    }


def merged_greedy_by_name(base_path: str, adapters: dict[str, str], prompts: list[list[int]],
                          max_new: int) -> dict[str | None, list[list[int]]]:
    """name (None: the base model) -> `merged_greedy` of each prompt."""
    out = {name: merged_greedy(base_path, path, prompts, max_new)
           for name, path in adapters.items()}
    out[None] = merged_greedy(base_path, None, prompts, max_new)
    return out
