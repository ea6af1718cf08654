"""LoRA adapters as users have them (PEFT's `save_pretrained` directories): reading, the checks
against the base model, and the engine's host cache of adapters.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with PEFT's
names, `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
(A [r, in_features], B [out_features, r]). Everything this engine cannot run is refused when
the adapter is loaded (`load_adapter`), with a ValueError naming the field: DoRA, modules to
save, embedding or LM-head LoRA, trainable tokens, biases, per-module ranks or alphas, a rank
above `max_lora_rank`, a module the model lacks, a tensor whose shape is not the base
model's. So no adapter fails at its first forward pass.

`LoRAHostCache` owns the adapters an engine knows: every `LoRARequest` it was given (an id
keeps its name and path for the engine's whole life; a name belongs to one id until it is
removed, then it may name another adapter) and up to `max_cpu_loras` loaded adapters in host
memory, least recently used evicted first (an evicted one is read again from its path when the
scheduler places it in a device slot, scheduler/lora.py). A removed adapter's requests that
are still queued or running finish under it: removal frees its name, not its id.

`lora_metrics` is what the engine reports of its adapters (vLLM's `lora_requests_info`).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from safetensors import safe_open

from cluster.engine.tiny_lora import resolve_adapter
from scheduler.lora import LoRARequest
from scheduler.plan import LoRAWeights
from workers.model_config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                     r"\.lora_(A|B)\.weight$")
# PEFT config fields that change what the adapter computes: each must be off (falsy).
_UNSUPPORTED = {
    "use_dora": "DoRA adapters (use_dora) are not supported; merge the adapter or retrain "
                "with use_dora=False",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not "
                       "supported; only LoRA on q/k/v/o/gate/up/down_proj can be served",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not "
                               "supported; embedding changes cannot be served as LoRA",
    "rank_pattern": "rank_pattern (a rank per module) is not supported; use one r for every "
                    "module",
    "alpha_pattern": "alpha_pattern (an alpha per module) is not supported; use one lora_alpha "
                     "for every module",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) does not apply to Qwen3's "
                      "Linear layers",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts) is "
                         "not supported",
    "layer_replication": "layer_replication is not supported",
}


def module_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable module, full (unsharded)."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h, i = mc.hidden_size, mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {what}")


def _check_config(path: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """(r, scaling) of a PEFT adapter_config.json; ValueError naming the field it refuses."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type is {config.get('peft_type')!r}; only LORA adapters are "
                          "supported")
    for name, why in _UNSUPPORTED.items():
        if config.get(name):
            raise _fail(path, why)
    if config.get("bias", "none") != "none":
        raise _fail(path, f"bias is {config.get('bias')!r}; only bias='none' adapters are "
                          "supported")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(path, f"r must be an integer >= 1; got {r!r}")
    if r > max_lora_rank:
        raise _fail(path, f"r={r} exceeds max_lora_rank={max_lora_rank}; start the engine with "
                          f"max_lora_rank >= {r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(path, f"lora_alpha must be a number; got {alpha!r}")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):  # (a string is a regex over module paths: tensors decide)
        for name in targets:
            _check_module(path, str(name), "target_modules")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, scaling


def _check_module(path: str, module: str, where: str) -> None:
    if module in _EMBEDDING_MODULES:
        raise _fail(path, f"{where} names {module!r}: embedding and LM-head LoRA are not "
                          f"supported; adapt only {list(LORA_MODULES)}")
    if module not in LORA_MODULES:
        raise _fail(path, f"{where} names {module!r}, a module Qwen3 does not have (LoRA "
                          f"applies to {list(LORA_MODULES)})")


def load_adapter(path: str, mc: ModelConfig, max_lora_rank: int) -> LoRAWeights:
    """Read and check one PEFT adapter directory (or the embedded `qwen3-tiny-lora`,
    cluster/engine/tiny_lora.py) against the base model `mc`."""
    root = Path(resolve_adapter(path))
    config_file, tensors_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file():
        raise _fail(path, "no adapter_config.json; pass a directory PEFT's save_pretrained wrote")
    if not tensors_file.is_file():
        raise _fail(path, "no adapter_model.safetensors; save the adapter with "
                          "safe_serialization=True")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise _fail(path, f"adapter_config.json is not valid JSON: {e}") from None
    r, scaling = _check_config(path, config, max_lora_rank)
    shapes = module_shapes(mc)
    halves: dict[str, dict[str, Any]] = {}
    with safe_open(str(tensors_file), framework="pt", device="cpu") as f:
        for name in f.keys():
            m = _TENSOR.match(name)
            if m is None:
                if any(e in name for e in _EMBEDDING_MODULES) or "lora_embedding" in name:
                    raise _fail(path, f"tensor {name!r}: embedding and LM-head LoRA are not "
                                      "supported")
                raise _fail(path, f"tensor {name!r} is not a LoRA weight of a Qwen3 decoder "
                                  "layer's q/k/v/o/gate/up/down_proj")
            layer, module, half = int(m.group(1)), m.group(2), m.group(3)
            _check_module(path, module, f"tensor {name!r}")
            if layer >= mc.num_hidden_layers:
                raise _fail(path, f"tensor {name!r} adapts layer {layer}; the base model has "
                                  f"{mc.num_hidden_layers} layers: was it trained for this model?")
            if module in _MLP_MODULES and mc.is_sparse_layer(layer):
                raise _fail(path, f"tensor {name!r} adapts the dense MLP of layer {layer}, "
                                  "which is a mixture-of-experts block in this model")
            n_in, n_out = shapes[module]
            expected = (r, n_in) if half == "A" else (n_out, r)
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != expected:
                raise _fail(path, f"tensor {name!r} has shape {tuple(tensor.shape)}; the base "
                                  f"model needs {expected} (r={r}): was the adapter trained "
                                  "for this model?")
            halves.setdefault(f"layers.{layer}.{module}", {})[half] = tensor.float()
    tensors = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _fail(path, f"{key} has lora_{next(iter(pair))} but not its other half")
        tensors[key] = (pair["A"].numpy(), (pair["B"] * scaling).numpy())
    if not tensors:
        raise _fail(path, "adapter_model.safetensors holds no LoRA weights")
    return LoRAWeights(r, tensors)


class LoRAHostCache:
    """The adapters an engine knows, and the loaded ones kept in host memory (LRU)."""

    def __init__(self, model_config: ModelConfig, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.requests: dict[int, LoRARequest] = {}  # every adapter given, by lora_int_id
        self.names: dict[str, int] = {}  # the adapters not removed: lora_name -> lora_int_id
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # least recently used first

    def add(self, request: LoRARequest) -> None:
        """Know and load (checking) an adapter; ValueError for a bad adapter, or an id or name
        already given to another adapter."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (or None); "
                             f"got {type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} at {known.lora_path!r}; give each adapter its "
                             "own id")
        active = self.names.get(request.lora_name, request.lora_int_id)
        if active != request.lora_int_id:
            same_name = self.requests[active]
            raise ValueError(f"lora_name {request.lora_name!r} is already adapter "
                             f"{same_name.lora_int_id} at {same_name.lora_path!r}; give each "
                             "adapter its own name")
        if known is None:
            self._load(request)
            self.requests[request.lora_int_id] = request
        self.names[request.lora_name] = request.lora_int_id

    def remove(self, lora_name: str) -> bool:
        """Forget the adapter named `lora_name` (False if none is): its name is free for
        another adapter and its host copy is dropped; requests already given it finish under it
        (re-read from its path if they need its tensors again)."""
        lora_id = self.names.pop(lora_name, None)
        if lora_id is None:
            return False
        self.loaded.pop(lora_id, None)
        return True

    def weights(self, lora_id: int) -> LoRAWeights:
        """A known adapter's tensors, read again from its path if the cache evicted them."""
        weights = self.loaded.get(lora_id)
        if weights is None:
            return self._load(self.requests[lora_id])
        self.loaded.move_to_end(lora_id)
        return weights

    def _load(self, request: LoRARequest) -> LoRAWeights:
        weights = load_adapter(request.lora_path, self.model_config, self.max_lora_rank)
        self.loaded[request.lora_int_id] = weights
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return weights


def lora_metrics(engine: Any, requests_total: dict[str, int]) -> dict[str, Any]:
    """What an `LLMEngine` (`engine`) reports of its adapters, by name: `lora_running` /
    `lora_waiting` (adapters of running requests; of waiting or swapped ones), `lora_loaded`
    (the adapters it knows and has not removed), `max_lora` (its device slots, 0: LoRA off)
    and `lora_requests_total` (`requests_total`: requests admitted per adapter)."""
    loras: LoRAHostCache | None = engine.loras
    if loras is None:
        return {"max_lora": 0, "lora_running": [], "lora_waiting": [], "lora_loaded": [],
                "lora_requests_total": {}}
    queues = engine.scheduler.queues

    def names(requests: Any) -> list[str]:
        return sorted({loras.requests[r.lora_id].lora_name for r in requests if r.lora_id})

    return {"max_lora": engine.config.max_loras, "lora_running": names(queues.running),
            "lora_waiting": names([*queues.waiting, *queues.swapped]),
            "lora_loaded": sorted(loras.names), "lora_requests_total": dict(requests_total)}
