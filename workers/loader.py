"""Fill a model shard's weights: from a safetensors checkpoint in one pass over the tensor
names (`load_format` "auto"), or in place with random values ("dummy").

Every parameter carries a `weight_loader(param, WeightSource, shard_id=None)` that reads its
rank's slice of the full checkpoint tensor; `packed_modules_mapping` routes the separate
q/k/v and gate/up tensors into the packed parameters, and the hub's per-expert tensors
`...mlp.experts.{e}.{gate,up,down}_proj.weight` go to the layer's stacked `mlp.w13_weight` /
`mlp.w2_weight` with shard id `(e, proj)`. Files are memory-mapped and only the slices this rank
needs are read. Missing or unexpected tensors raise `ValueError` naming them.

"dummy" is vLLM's load format for running a model's shapes from its config.json alone (no
checkpoint written or read): every floating-point parameter is drawn uniform in
[-1e-3, 1e-3] on its own device, from a generator seeded by the parameter's name, so the same
config gives the same model in every engine. Each rank fills the shard it holds; every rank of
a group draws the same values for a name, so replicated parameters (norms, MoE routers) agree
as they must (and the shards of a split one repeat each other, as in vLLM, whose seed is one
for all). A pipeline stage fills its own layers; tied embeddings stay tied (at pp > 1 the last
stage's LM head draws the embedding's values). Either way each layer's post-load step runs
after (`quantization: fp8` quantizes the random float weights; CPU packing).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers.checkpoint import checkpoint_files
from workers.config import LOAD_FORMATS
from workers.kv_scales import KV_SCALE_TENSOR, apply_checkpoint_kv_scales
from workers.layers.linear_method import process_weights_after_loading
from workers.layers.weights import WeightSource, default_weight_loader

# Tensors some exporters add that carry nothing a Qwen3 forward needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in the hub layout -> the stacked parameter of its layer.
_EXPERT_TENSOR = re.compile(
    r"^(.*\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_EXPERT_PARAM = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}
# load_format "dummy": vLLM's range and seed (model_loader/weight_utils.initialize_dummy_weights)
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
DUMMY_SEED = 1234


def load_model(model: nn.Module, model_dir: str | Path, load_format: str = "auto") -> None:
    """Fill every parameter of `model` (module docstring): from the checkpoint in `model_dir`
    ("auto") or random ("dummy"), then run each layer's post-load step."""
    if load_format == "dummy":
        initialize_dummy_weights(model)
        kv_scales = {}
    elif load_format == "auto":
        kv_scales = _load_checkpoint(model, model_dir)
    else:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}; got {load_format!r}")
    process_weights_after_loading(model)
    apply_checkpoint_kv_scales(model, kv_scales)


def initialize_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Every floating-point parameter of `model` uniform in [DUMMY_LOW, DUMMY_HIGH], in place
    on its device, from a generator seeded by `seed` and the parameter's name."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, param in model.named_parameters():  # a tied table once, under the first name
        if not torch.is_floating_point(param):
            continue
        if tied and name == "lm_head.weight":  # pp > 1: the last stage's copy of the table
            name = "model.embed_tokens.weight"
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed + zlib.crc32(name.encode()))
        data = param.data
        if data.element_size() < 2:  # uniform_ has no FP8 kernel: draw in float16, cast
            data.copy_(torch.empty_like(data, dtype=torch.float16).uniform_(
                DUMMY_LOW, DUMMY_HIGH, generator=generator))
        else:
            data.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)


def _load_checkpoint(model: nn.Module, model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Fill every parameter from the safetensors in `model_dir`; the checkpoint's KV-cache
    scale tensors, by name (workers/kv_scales.py)."""
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
    return kv_scales


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
