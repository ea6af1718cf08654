"""The embedded LoRA adapter `qwen3-tiny-lora`: a PEFT adapter of `qwen3-tiny` (rank 8, alpha
16, all seven modules, random A and B from a fixed seed), so a manifest can serve an adapter on
a machine with no adapter files (`lora_modules: [{name: ..., path: qwen3-tiny-lora}]`).

`resolve_adapter(path)` writes its directory (adapter_config.json and
adapter_model.safetensors with the names `peft` writes) into the models' cache on first use
and returns it; any other path is returned as it is. Importing this module does not import
torch (manifest checks name the adapter before Ray starts); writing it does.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

TINY_LORA_NAME = "qwen3-tiny-lora"
TINY_LORA_SEED = 7
_RANK, _ALPHA, _STD = 8, 16, 0.08
_FORMAT_VERSION = 1
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def resolve_adapter(path: str) -> str:
    """The adapter directory for `path`: the embedded adapter's name, or a path as it is."""
    if path != TINY_LORA_NAME:
        return path
    from workers.tiny_model import TINY_MODEL_NAME, cache_root

    target = cache_root() / f"{TINY_LORA_NAME}-v{_FORMAT_VERSION}"
    if not (target / "adapter_model.safetensors").is_file():
        _write(target, TINY_MODEL_NAME)
    return str(target)


def _write(target: Path, base: str) -> None:
    """Write the adapter into a temporary sibling and rename it (as write_random_qwen3 does),
    so concurrent callers never see a half-written directory."""
    import torch
    from safetensors.torch import save_file

    from cluster.engine.lora import module_shapes  # (the shapes the loader checks)
    from workers.model_config import load_model_config
    from workers.tiny_model import resolve_model

    mc = load_model_config(resolve_model(base))
    g = torch.Generator().manual_seed(TINY_LORA_SEED)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for module, (n_in, n_out) in module_shapes(mc).items():
            name = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(_RANK, n_in, generator=g) * _STD
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, _RANK, generator=g) * _STD
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": _RANK, "lora_alpha": _ALPHA, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(_BLOCK), "use_rslora": False, "use_dora": False}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "adapter_model.safetensors").is_file():  # lost a race to a partial
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
