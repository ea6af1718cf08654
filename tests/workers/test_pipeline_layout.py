"""Pipeline parallelism's layout (workers/pipeline.py) without processes: the layer partition
(vLLM's rule and VLLM_PP_LAYER_PARTITION), which checkpoint tensors each stage loads (tied
embeddings: the last stage's LM head gets the embedding's table), each stage's KV layers, and
what a stage refuses to run."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import check_layer_partition
from workers.checkpoint import checkpoint_files
from workers.config import PoolerConfig, WorkerConfig
from workers.distributed import TensorParallelGroup
from workers.loader import load_model
from workers.model_config import load_model_config
from workers.pipeline import PP_LAYER_PARTITION_ENV, PipelineStage, get_pp_indices, layer_partition
from workers.qwen3 import Qwen3ForCausalLM


@pytest.mark.parametrize(("layers", "pp", "parts"), [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (8, 3, [3, 3, 2]), (4, 4, [1, 1, 1, 1])])
def test_even_split_gives_the_remainder_to_stages_before_the_last(layers, pp, parts,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    assert layer_partition(layers, pp) == parts
    assert [get_pp_indices(layers, s, pp) for s in range(pp)] == [
        (sum(parts[:s]), sum(parts[:s + 1])) for s in range(pp)]


def test_partition_key_then_environment(monkeypatch) -> None:
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,3")
    assert layer_partition(4, 2) == [1, 3]
    assert layer_partition(4, 2, "3,1") == [3, 1]  # the engine key wins
    assert get_pp_indices(4, 1, 2, "3,1") == (3, 4)


@pytest.mark.parametrize("bad", ["3,2", "4", "2,1,1", "4,0", "a,b", "3;1"])
def test_bad_partition_is_a_value_error_naming_it(bad) -> None:
    with pytest.raises(ValueError, match=f"pp_layer_partition {bad!r}"):
        layer_partition(4, 2, bad)


def test_engine_refuses_a_bad_partition_and_more_stages_than_layers(monkeypatch) -> None:
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    with pytest.raises(ValueError, match="pp_layer_partition '3,2'"):
        check_layer_partition(EngineConfig(pipeline_parallel_size=2, pp_layer_partition="3,2"), 4)
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's 4 layers"):
        check_layer_partition(EngineConfig(pipeline_parallel_size=5), 4)
    with pytest.raises(ValueError, match="pp_layer_partition must be a string"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition=[3, 1])
    with pytest.raises(ValueError, match="executor 'inprocess' runs one worker"):
        EngineConfig(pipeline_parallel_size=2, executor="inprocess")
    assert EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4
    assert EngineConfig(pipeline_parallel_size=2).uses_ray


def test_worker_config_ranks_and_refusals() -> None:
    cfg = WorkerConfig(model="m", tensor_parallel_size=2, pipeline_parallel_size=2, rank=3,
                       dist_init_method="tcp://127.0.0.1:1")
    assert (cfg.world_size, cfg.output_rank) == (4, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        WorkerConfig(model="m", pipeline_parallel_size=2, rank=2, dist_init_method="tcp://h:1")
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 does not support a "
                                         "draft-model speculative_config"):
        WorkerConfig(model="m", pipeline_parallel_size=2, dist_init_method="tcp://h:1",
                     speculative_model="d")
    # LoRA and the pooling runner run at pp > 1 (tests/cluster/engine/test_pipeline_lora_pooling.py)
    for kwargs in (dict(max_loras=1, max_lora_rank=8), dict(pooler=PoolerConfig())):
        WorkerConfig(model="m", pipeline_parallel_size=2, dist_init_method="tcp://h:1", **kwargs)


def _stage(tiny_dir: str, rank: int, partition: str) -> Qwen3ForCausalLM:
    mc = load_model_config(tiny_dir, 1)
    start, end = get_pp_indices(mc.num_hidden_layers, rank, 2, partition)
    stage = PipelineStage(rank, 2, start, end, global_rank=rank, tp_size=1)
    model = Qwen3ForCausalLM(mc, TensorParallelGroup.single(), torch.float32, stage=stage)
    load_model(model, tiny_dir)
    return model


def test_each_stage_builds_and_loads_only_its_layers(tiny_dir: str) -> None:
    first, last = _stage(tiny_dir, 0, "3,1"), _stage(tiny_dir, 1, "3,1")
    names = {n for n, _ in first.named_parameters()}
    assert "model.embed_tokens.weight" in names and first.lm_head is None
    assert first.model.norm is None and len(first.attention_layers()) == 3
    assert not any(n.startswith("model.layers.3.") for n in names)
    names = {n for n, _ in last.named_parameters()}
    assert last.model.embed_tokens is None and len(last.attention_layers()) == 1
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"3"}
    # tied embeddings: the last stage's own LM head holds the embedding's table
    (file,) = checkpoint_files(tiny_dir)
    with safe_open(str(file), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
        layer3 = f.get_tensor("model.layers.3.mlp.down_proj.weight")
    assert torch.equal(last.lm_head.weight, table)
    assert torch.equal(first.model.embed_tokens.weight, table)
    assert torch.equal(last.model.layers[3].mlp.down_proj.weight, layer3)


def test_stage_kv_block_bytes_count_its_layers(tiny_dir: str) -> None:
    mc = load_model_config(tiny_dir, 1)
    whole = mc.kv_block_bytes(16, 1, 4)
    assert mc.kv_block_bytes(16, 1, 4, 1) * 4 == whole
    assert mc.kv_block_bytes(16, 1, 4, 3) * 4 == 3 * whole


def test_stage_weight_bytes_count_its_layers_embedding_and_head(tiny_dir: str) -> None:
    """qwen3-tiny (tied): stage 0 holds the table and 3 layers, stage 1 one layer, the final
    norm and its own copy of the table; together one table more than the whole model."""
    mc = load_model_config(tiny_dir, 1)
    whole = mc.weight_bytes_per_rank(1, 4)
    first = PipelineStage(0, 2, 0, 3, global_rank=0, tp_size=1)
    last = PipelineStage(1, 2, 3, 4, global_rank=1, tp_size=1)
    table = mc.vocab_size * mc.hidden_size * 4
    parts = [mc.weight_bytes_per_rank(1, 4, s) for s in (first, last)]
    assert sum(parts) == whole + table
    # 3 layers against 1 and the final norm, beside the tables
    assert parts[0] - table == 3 * (parts[1] - table - mc.hidden_size * 4)
    assert mc.weight_bytes_per_rank(1, 4, PipelineStage.single()) == whole
