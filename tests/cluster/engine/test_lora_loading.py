"""PEFT adapters read and checked at load (cluster/engine/lora.py): scaling, the modules kept,
every refusal with the field it names, and the host cache's LRU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lora_adapters import edit_config, make_adapter
from safetensors.torch import load_file, save_file

from cluster.engine.lora import LoRAHostCache, load_adapter
from scheduler.lora import LoRARequest
from workers.model_config import load_model_config

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def mc(tiny_model_path: str):
    return load_model_config(tiny_model_path, 1)


@pytest.fixture(scope="module")
def adapter(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_adapter(tiny_model_path, tmp_path_factory.mktemp("a") / "a", r=8, lora_alpha=16)


def _saved(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _copy(src: str, dst: Path, tensors: dict[str, torch.Tensor] | None = None) -> str:
    dst.mkdir()
    (dst / "adapter_config.json").write_text((Path(src) / "adapter_config.json").read_text())
    save_file(tensors if tensors is not None else _saved(src),
              str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_every_module_loads_with_b_scaled_by_alpha_over_r(adapter: str, mc) -> None:
    weights = load_adapter(adapter, mc, max_lora_rank=16)
    saved = _saved(adapter)
    assert weights.rank == 8
    assert len(weights.tensors) == 7 * mc.num_hidden_layers
    a, b = weights.tensors["layers.2.k_proj"]
    assert a.shape == (8, mc.hidden_size) and b.shape == (mc.num_key_value_heads * mc.head_dim, 8)
    torch.testing.assert_close(torch.from_numpy(a), saved[f"{PREFIX}.2.self_attn.k_proj.lora_A.weight"])
    torch.testing.assert_close(torch.from_numpy(b),
                               saved[f"{PREFIX}.2.self_attn.k_proj.lora_B.weight"] * 2.0)


def test_rslora_scales_by_alpha_over_sqrt_r_and_subsets_keep_their_modules(
        tiny_model_path: str, tmp_path: Path, mc) -> None:
    path = make_adapter(tiny_model_path, tmp_path / "rs", r=4, lora_alpha=6, use_rslora=True,
                        target_modules=["v_proj", "down_proj"], seed=3)
    weights = load_adapter(path, mc, max_lora_rank=4)
    assert sorted({k.split(".", 2)[2] for k in weights.tensors}) == ["down_proj", "v_proj"]
    b = _saved(path)[f"{PREFIX}.0.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(torch.from_numpy(weights.tensors["layers.0.down_proj"][1]),
                               b * (6 / math.sqrt(4)))


@pytest.mark.parametrize(("fields", "message"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embedding and LM-head LoRA"),
    ({"target_modules": ["lm_head"]}, "embedding and LM-head LoRA"),
    ({"target_modules": ["q_proj", "c_attn"]}, "'c_attn', a module Qwen3 does not have"),
    ({"r": 32}, "r=32 exceeds max_lora_rank=16"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type"),
])
def test_unsupported_config_is_refused_naming_the_field(adapter: str, tmp_path: Path, mc,
                                                         fields: dict, message: str) -> None:
    path = _copy(adapter, tmp_path / "bad")
    edit_config(path, **fields)
    with pytest.raises(ValueError, match=message):
        load_adapter(path, mc, max_lora_rank=16)


def test_peft_dora_and_embedding_adapters_are_refused(tiny_model_path: str, tmp_path: Path,
                                                      mc) -> None:
    dora = make_adapter(tiny_model_path, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        load_adapter(dora, mc, max_lora_rank=16)
    embed = make_adapter(tiny_model_path, tmp_path / "embed", target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="embedding and LM-head LoRA"):
        load_adapter(embed, mc, max_lora_rank=16)


def test_tensors_the_base_model_cannot_take_are_refused(adapter: str, tmp_path: Path,
                                                        mc) -> None:
    tensors = _saved(adapter)
    wrong = dict(tensors)
    key = f"{PREFIX}.1.mlp.up_proj.lora_B.weight"
    wrong[key] = torch.zeros(100, 8)  # intermediate_size is 384
    with pytest.raises(ValueError, match=r"up_proj.lora_B.weight' has shape \(100, 8\); the base "
                                         r"model needs \(384, 8\)"):
        load_adapter(_copy(adapter, tmp_path / "shape", wrong), mc, max_lora_rank=16)
    deep = dict(tensors)
    deep[f"{PREFIX}.9.self_attn.q_proj.lora_A.weight"] = tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].clone()
    with pytest.raises(ValueError, match="adapts layer 9; the base model has 4 layers"):
        load_adapter(_copy(adapter, tmp_path / "deep", deep), mc, max_lora_rank=16)
    half = {k: v for k, v in tensors.items() if k != key}
    with pytest.raises(ValueError, match="layers.1.up_proj has lora_A but not its other half"):
        load_adapter(_copy(adapter, tmp_path / "half", half), mc, max_lora_rank=16)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(str(tmp_path), mc, max_lora_rank=16)


def test_host_cache_keeps_max_cpu_loras_and_reloads_evicted_ones(
        adapter: str, tiny_model_path: str, tmp_path: Path, mc) -> None:
    other = make_adapter(tiny_model_path, tmp_path / "b", seed=5)
    cache = LoRAHostCache(mc, max_lora_rank=16, max_cpu_loras=1)
    cache.add(LoRARequest("a", 1, adapter))
    cache.add(LoRARequest("b", 2, other))
    assert list(cache.loaded) == [2]  # a evicted
    a = cache.weights(1)  # read again from its path
    assert list(cache.loaded) == [1]
    assert a.tensors.keys() == load_adapter(adapter, mc, 16).tensors.keys()
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        cache.add(LoRARequest("c", 1, other))
    with pytest.raises(ValueError, match="lora_name 'a' is already adapter 1"):
        cache.add(LoRARequest("a", 3, other))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("z", 0, adapter)


def test_a_removed_adapter_frees_its_name_and_keeps_its_id_for_requests_in_flight(
        adapter: str, tiny_model_path: str, tmp_path: Path, mc) -> None:
    other = make_adapter(tiny_model_path, tmp_path / "b", seed=6)
    cache = LoRAHostCache(mc, max_lora_rank=16, max_cpu_loras=2)
    cache.add(LoRARequest("a", 1, adapter))
    assert cache.remove("a") and not cache.remove("a")
    assert (cache.names, list(cache.loaded)) == ({}, [])
    assert cache.weights(1).tensors.keys() == load_adapter(adapter, mc, 16).tensors.keys()
    cache.add(LoRARequest("a", 2, other))  # the name is free for another adapter
    assert cache.names == {"a": 2}
    with pytest.raises(ValueError, match="lora_name 'a' is already adapter 2"):
        cache.add(LoRARequest("a", 1, adapter))
    cache.remove("a")
    cache.add(LoRARequest("a", 1, adapter))  # the first one again, under its own id
    assert cache.names == {"a": 1}


def test_the_embedded_adapter_is_a_peft_adapter_of_qwen3_tiny(tiny_model_path: str, mc) -> None:
    """qwen3-tiny-lora (cluster/engine/tiny_lora.py) as peft reads it: the engine's greedy
    tokens under it equal transformers' with peft's merge."""
    from lora_adapters import merged_greedy

    from cluster import LLM, SamplingParams
    from cluster.engine.tiny_lora import TINY_LORA_NAME, resolve_adapter

    path = resolve_adapter(TINY_LORA_NAME)
    assert resolve_adapter(TINY_LORA_NAME) == path and resolve_adapter("/x") == "/x"
    weights = load_adapter(TINY_LORA_NAME, mc, max_lora_rank=8)
    assert weights.rank == 8 and len(weights.tensors) == 7 * mc.num_hidden_layers
    prompts = [[9707, 11, 1879, 0, 358, 1079], [785, 6722, 315, 9625, 374]]
    llm = LLM("qwen3-tiny", enable_lora=True, max_lora_rank=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                            lora_request=LoRARequest("tiny", 1, TINY_LORA_NAME))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == merged_greedy(tiny_model_path, path,
                                                                   prompts, 8)
