"""LoRA adapters and the pooling runner at pipeline_parallel_size 2 (workers/pipeline.py).

Without processes: a stage's LoRA wrappers cover only the layers it holds, and a slot load
fills them with exactly what the whole model's wrappers of those layers get; a base model
saved alone (Qwen3-Embedding's names, no `model.`) loads stage by stage.
On the shared Ray cluster (fractional CPUs): a batch mixing base rows and three adapters over
two slots gives the greedy tokens of transformers with each adapter merged by peft (the LoRA
tests' oracle) and of the same batch at pp 1, at pp 2 x tp 1 and pp 2 x tp 2; embeddings at
pp 2 equal pp 1's to fp32 tolerance and sentence-transformers' (the pooling tests' oracle),
with chunked prefill, also with mean pooling; the reranker's scores equal the model card's
at pp 2 x tp 1 and pp 2 x tp 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import merged_greedy_by_name, mixed_prompts, three_adapters
from pooling_testlib import COS, RERANKER_OVERRIDES, SMALL, TEXTS
from pooling_testlib import cos as _cos

from cluster import LLM, LoRARequest, SamplingParams
from cluster.engine.lora import load_adapter
from scheduler.plan import LoRALoad
from workers.distributed import TensorParallelGroup
from workers.loader import load_model
from workers.lora import LoRAModel
from workers.model_config import load_model_config
from workers.pipeline import PipelineStage, get_pp_indices
from workers.qwen3 import Qwen3ForCausalLM
from workers.tiny_model import resolve_model

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
NAMES = ["a", None, "b", "c"]  # each prompt under each: every step mixes them


_prompts = mixed_prompts


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return three_adapters(tiny_model_path, tmp_path_factory.mktemp("pp_adapters"))


@pytest.fixture(scope="module")
def oracle(tiny_model_path: str, adapters: dict) -> dict:
    """name (None: the base model) -> peft-merged transformers' greedy tokens per prompt."""
    return merged_greedy_by_name(tiny_model_path, adapters, _prompts(), MAX_NEW)


def _run_mixed(llm: LLM, adapters: dict) -> list[list[int]]:
    requests = {name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(adapters.items())}
    prompts, loras = [], []
    for p in _prompts():
        for name in NAMES:
            prompts.append({"prompt_token_ids": p})
            loras.append(None if name is None else requests[name])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks
    return [o.outputs[0].token_ids for o in outs]


def _want(oracle: dict) -> list[list[int]]:
    return [oracle[name][i] for i in range(len(_prompts())) for name in NAMES]


# ---- without processes ---------------------------------------------------------------------

def _stage_model(path: str, rank: int, size: int, partition: str | None = None
                 ) -> Qwen3ForCausalLM:
    mc = load_model_config(path, 1)
    start, end = get_pp_indices(mc.num_hidden_layers, rank, size, partition)
    stage = PipelineStage(rank, size, start, end, global_rank=rank, tp_size=1)
    model = Qwen3ForCausalLM(mc, TensorParallelGroup.single(), torch.float32, stage=stage)
    load_model(model, path)
    return model


def test_a_stage_wraps_and_loads_only_its_layers_adapter(tiny_model_path: str,
                                                         adapters: dict) -> None:
    mc = load_model_config(tiny_model_path, 1)
    weights = load_adapter(adapters["a"], mc, 8)
    whole = LoRAModel(_stage_model(tiny_model_path, 0, 1), 2, 8, 64, "torch")
    stages = [LoRAModel(_stage_model(tiny_model_path, s, 2, "3,1"), 2, 8, 64, "torch")
              for s in (0, 1)]
    assert {i for i, _ in stages[0].layers} == {0, 1, 2}
    assert {i for i, _ in stages[1].layers} == {3}
    assert sum(s.nbytes for s in stages) == whole.nbytes  # the slots split with the layers
    for lora in (whole, *stages):
        lora.load([LoRALoad(1, 7, weights)])
    by_layer = {}
    for i, w in whole.layers:
        by_layer.setdefault(i, []).append(w)
    for lora in stages:
        seen = {}
        for i, w in lora.layers:
            seen.setdefault(i, []).append(w)
        for i, wrappers in seen.items():
            for mine, ref in zip(wrappers, by_layer[i], strict=True):
                assert torch.count_nonzero(mine.lora_a[1]) > 0
                assert torch.equal(mine.lora_a[1], ref.lora_a[1])
                for b, ref_b in zip(mine.lora_b, ref.lora_b, strict=True):
                    assert torch.equal(b[1], ref_b[1])
                    assert not torch.count_nonzero(b[2])  # slot -1 stays zero


def test_a_base_model_saved_alone_loads_stage_by_stage() -> None:
    """qwen3-embedding-tiny's tensors are named as Qwen3Model's (`layers.0...`, no `model.`):
    each stage takes its layers, the first the table, the last the norm (and, tied, the
    table as its LM head), each tensor as transformers reads it."""
    from transformers import AutoModel

    path = resolve_model("qwen3-embedding-tiny")
    stage = PipelineStage(1, 2, 2, 4, global_rank=1, tp_size=1)
    assert stage.checkpoint_target("layers.1.mlp.up_proj.weight", True) is None
    assert stage.checkpoint_target("layers.3.mlp.up_proj.weight", True) == \
        "layers.3.mlp.up_proj.weight"
    assert stage.checkpoint_target("norm.weight", True) == "norm.weight"
    assert stage.checkpoint_target("embed_tokens.weight", True) == "lm_head.weight"
    assert stage.checkpoint_target("embed_tokens.weight", False) is None
    hf = dict(AutoModel.from_pretrained(path, dtype=torch.float32).named_parameters())
    hf["lm_head.weight"] = hf["embed_tokens.weight"]  # (tied)
    held = []
    for model in (_stage_model(path, 0, 2), _stage_model(path, 1, 2)):
        names = []
        for name, p in model.named_parameters():
            names.append(name)
            if "qkv_proj" in name or "gate_up_proj" in name:
                continue  # (packed: their parts are checked by the parity tests)
            assert torch.equal(p, hf[name.removeprefix("model.")]), name
        held.append({n.split(".")[2] for n in names if n.startswith("model.layers.")})
    assert held == [{"0", "1"}, {"2", "3"}]


# ---- on Ray, against the oracles ------------------------------------------------------------

@pytest.mark.slow
def test_lora_mixed_batch_at_pp2_equals_peft_and_pp1(ray_cluster: None, adapters: dict,
                                                      oracle: dict) -> None:
    """Three adapters over two slots (loads between steps) beside base rows, micro-batches."""
    for name in "abc":
        assert oracle[name] != oracle[None]  # (else this would pass without any LoRA)
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
             max_num_batched_tokens=64) as llm:
        pp1 = _run_mixed(llm, adapters)
    with LLM("qwen3-tiny", pipeline_parallel_size=2, worker_num_cpus=0.5, enable_lora=True,
             max_loras=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64) as llm:
        pp2 = _run_mixed(llm, adapters)
        assert llm.engine.metrics()["max_plans_in_flight"] == 2
    assert pp2 == pp1 == _want(oracle)


@pytest.mark.slow
def test_lora_mixed_batch_at_pp2_tp2_equals_peft(ray_cluster: None, adapters: dict,
                                                  oracle: dict) -> None:
    """Each stage's column-parallel B and row-parallel A sharded over its two ranks."""
    with LLM("qwen3-tiny", pipeline_parallel_size=2, tensor_parallel_size=2,
             pp_layer_partition="3,1", worker_num_cpus=0.5, enable_lora=True, max_loras=2,
             max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64) as llm:
        assert _run_mixed(llm, adapters) == _want(oracle)


@pytest.mark.slow
def test_embeddings_at_pp2_equal_pp1_and_sentence_transformers(ray_cluster: None) -> None:
    from sentence_transformers import SentenceTransformer

    path = resolve_model("qwen3-embedding-tiny")
    ref = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_tensor=True)
    with LLM("qwen3-embedding-tiny", **SMALL) as llm:
        pp1 = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    with LLM("qwen3-embedding-tiny", pipeline_parallel_size=2, worker_num_cpus=0.5,
             **SMALL) as llm:
        assert llm.engine.pooling.pooler.normalize
        outs = llm.embed(TEXTS, use_tqdm=False)
    assert len(outs[2].prompt_token_ids) > 2 * SMALL["max_num_batched_tokens"]  # 3 chunks
    for out, mine, want in zip(outs, pp1, ref, strict=True):
        vec = out.outputs.embedding
        assert vec == pytest.approx(mine, abs=1e-5)
        assert _cos(vec, want) > COS
        assert abs(float(torch.tensor(vec).norm()) - 1.0) < 1e-5


@pytest.mark.slow
def test_mean_pooling_at_pp2_sums_chunks_on_the_last_stage(ray_cluster: None,
                                                           tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = tmp_path / "mean"
    shutil.copytree(resolve_model("qwen3-embedding-tiny"), path)
    pooling = path / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update({"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True})
    pooling.write_text(json.dumps(config))
    with LLM(str(path), pipeline_parallel_size=2, worker_num_cpus=0.5, **SMALL) as llm:
        assert llm.engine.pooling.pooler.pooling_type == "MEAN"
        outs = llm.embed(TEXTS, use_tqdm=False)
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path))
    for text, out in zip(TEXTS, outs, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0]
        assert _cos(out.outputs.embedding, hidden.mean(0)) > COS


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_reranker_scores_at_pp2_equal_the_model_card(ray_cluster: None, tp: int,
                                                     rerank_card_scores: Any) -> None:
    """The yes/no logits come from the last stage's LM head (at tp 2 its vocabulary shards
    gathered within the last stage's group)."""
    query = "What is the capital of China?"
    docs = ["The capital of China is Beijing.",
            "Gravity is a force that attracts two bodies towards each other. " * 3]
    want = rerank_card_scores(resolve_model("qwen3-reranker-tiny"), [(query, d) for d in docs])
    with LLM("qwen3-reranker-tiny", pipeline_parallel_size=2, tensor_parallel_size=tp,
             worker_num_cpus=0.5, hf_overrides=RERANKER_OVERRIDES, **SMALL) as llm:
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
