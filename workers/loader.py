"""Load a safetensors checkpoint into a model shard: one pass over the tensor names.

Every parameter carries a `weight_loader(param, WeightSource, shard_id=None)` that reads its
rank's slice of the full checkpoint tensor; `packed_modules_mapping` routes the separate
q/k/v and gate/up tensors into the packed parameters, and the hub's per-expert tensors
`...mlp.experts.{e}.{gate,up,down}_proj.weight` go to the layer's stacked `mlp.w13_weight` /
`mlp.w2_weight` with shard id `(e, proj)`. Files are memory-mapped and only the slices this rank
needs are read. Missing or unexpected tensors raise `ValueError` naming them.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from safetensors import safe_open
from torch import nn

from workers.checkpoint import checkpoint_files
from workers.kv_scales import KV_SCALE_TENSOR, apply_checkpoint_kv_scales
from workers.layers.linear_method import process_weights_after_loading
from workers.layers.weights import WeightSource, default_weight_loader

# Tensors some exporters add that carry nothing a Qwen3 forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in the hub layout -> the stacked parameter of its layer.
_EXPERT_TENSOR = re.compile(
    r"^(.*\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_EXPERT_PARAM = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}


def load_model(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`."""
    packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under the first name
    expected = {name: _num_shards(name, packed) for name in params}
    loaded: Counter[str] = Counter()
    seen_experts: set[str] = set()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    kv_scales = {}  # llm-compressor's FP8 KV-cache scales (workers/kv_scales.py)
    # a pipeline stage's: which tensors are its own (workers/pipeline.py)
    stage_name = getattr(model, "stage_name", lambda n: n)
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                name = stage_name(ckpt_name)
                if name is None or name.endswith(_IGNORED_SUFFIXES) \
                        or (tied and ckpt_name == "lm_head.weight"):
                    continue
                if KV_SCALE_TENSOR.match(name):
                    kv_scales[name] = f.get_tensor(ckpt_name)
                    continue
                param_name, shard_id = _target(name, packed)
                if isinstance(shard_id, tuple):
                    seen_experts.add(ckpt_name)
                param = params.get(param_name)
                if param is None and ("model." + param_name) in params:
                    # a base model saved alone (Qwen3-Embedding): its names lack `model.`
                    param_name = "model." + param_name
                    param = params[param_name]
                if param is None:
                    raise ValueError(f"{file.name} holds {name!r}, which this Qwen3 model has no "
                                     "parameter for: does config.json (dense or MoE, its layer "
                                     "and expert counts) match the weights?")
                source = WeightSource(name, safe_slice=f.get_slice(ckpt_name))
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    default_weight_loader(param, source)
                elif shard_id is None:
                    loader(param, source)
                else:
                    loader(param, source, shard_id)
                loaded[param_name] += 1
    missing = sorted(n for n, k in expected.items()
                     if loaded[n] < k and not hasattr(params[n], "expert_projections"))
    missing += sorted(set(_expert_tensor_names(params)) - seen_experts)
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks tensors for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    process_weights_after_loading(model)
    apply_checkpoint_kv_scales(model, kv_scales)


def _target(name: str, packed: dict[str, tuple[str, int | str]]
            ) -> tuple[str, int | str | tuple[int, str] | None]:
    """(parameter name, shard id) that checkpoint tensor `name` fills."""
    m = _EXPERT_TENSOR.match(name)
    if m:
        prefix, expert, proj, suffix = m.groups()
        scale = suffix[len("weight"):]  # "" or "_scale_inv"
        return f"{prefix}{_EXPERT_PARAM[proj]}{scale}", (int(expert), proj)
    for ckpt_part, (packed_part, sid) in packed.items():
        if ckpt_part in name:
            return name.replace(ckpt_part, packed_part), sid
    return name, None


def _expert_tensor_names(params: dict[str, nn.Parameter]) -> list[str]:
    """Every hub tensor the stacked expert parameters expect (all experts, on every rank)."""
    names = []
    for pname, param in params.items():
        projections = getattr(param, "expert_projections", None)
        if projections is None:
            continue
        prefix = pname.rsplit(".", 1)[0]  # ...mlp
        names += [f"{prefix}.experts.{e}.{proj}.{param.checkpoint_suffix}"
                  for e in range(param.num_experts) for proj in projections]
    return names


def _num_shards(param_name: str, packed: dict[str, tuple[str, int | str]]) -> int:
    """How many checkpoint tensors fill `param_name` (3 for qkv, 2 for gate_up, else 1)."""
    n = sum(1 for packed_part, _ in packed.values() if packed_part in param_name)
    return max(n, 1)
