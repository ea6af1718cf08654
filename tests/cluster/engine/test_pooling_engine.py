"""The pooling runner offline (`LLM(model, runner=...).embed / .score`) against its oracles in
fp32: sentence-transformers on the same checkpoint for embeddings (last-token pooling +
Normalize, as qwen3-embedding-tiny ships), mean and CLS pooling by hand over transformers'
last hidden state, and Qwen3-Reranker's model-card reference computation (the yes/no logits
of AutoModelForCausalLM at the last position) for scores. Long inputs run in several prefill
chunks; a shared prefix is served by the prefix cache; tp = 2 runs on Ray.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pooling_testlib import COS, RERANKER_OVERRIDES, SMALL, TEXTS
from pooling_testlib import cos as _cos

from cluster import LLM
from workers.tiny_model import resolve_model


@pytest.fixture(scope="module")
def embed_path() -> str:
    return resolve_model("qwen3-embedding-tiny")


@pytest.fixture(scope="module")
def st_reference(embed_path: str) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(embed_path, device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True)


@pytest.fixture(scope="module")
def embedder() -> Any:
    with LLM("qwen3-embedding-tiny", **SMALL) as llm:
        yield llm


def test_auto_runner_picks_pooling_for_sentence_transformers_files(embedder: LLM) -> None:
    info = embedder.engine.pooling
    assert info is not None and info.task == "embed"
    assert (info.pooler.pooling_type, info.pooler.normalize) == ("LAST", True)
    assert info.matryoshka == ()  # the toy's config.json: is_matryoshka


def test_embeddings_match_sentence_transformers(embedder: LLM,
                                                st_reference: torch.Tensor) -> None:
    outs = embedder.embed(TEXTS, use_tqdm=False)
    assert len(outs[2].prompt_token_ids) > 2 * SMALL["max_num_batched_tokens"]  # 3 chunks
    for out, ref in zip(outs, st_reference):
        vec = out.outputs.embedding
        assert len(vec) == 128
        assert _cos(vec, ref) > COS
        assert abs(float(torch.tensor(vec).norm()) - 1.0) < 1e-5


def test_token_id_prompts_and_dimensions(embedder: LLM, st_reference: torch.Tensor) -> None:
    ids = embedder.get_tokenizer()(TEXTS[3])["input_ids"]
    out = embedder.embed([{"prompt_token_ids": ids}], use_tqdm=False, dimensions=32)[0]
    ref = st_reference[3][:32]
    assert len(out.outputs.embedding) == 32
    assert _cos(out.outputs.embedding, ref) > COS
    assert abs(float(torch.tensor(out.outputs.embedding).norm()) - 1.0) < 1e-5
    for bad in (0, 129):
        with pytest.raises(ValueError, match="dimensions"):
            embedder.embed(TEXTS[:1], use_tqdm=False, dimensions=bad)


def test_shared_prefix_hits_the_prefix_cache(embedder: LLM, embed_path: str) -> None:
    from sentence_transformers import SentenceTransformer

    prefix = "Instruct: Given a web search query, retrieve relevant passages. " * 4
    texts = [prefix + "Query: what is paged attention?", prefix + "Query: who wrote vLLM?"]
    first = embedder.embed(texts[:1], use_tqdm=False)[0]
    second = embedder.embed(texts[1:], use_tqdm=False)[0]
    assert second.num_cached_tokens >= 32  # the shared instruction's full blocks
    again = embedder.embed(texts[1:], use_tqdm=False)[0]  # all of it cached but the last token
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert _cos(again.outputs.embedding, torch.tensor(second.outputs.embedding)) > 0.999999
    ref = SentenceTransformer(embed_path, device="cpu").encode(texts, convert_to_tensor=True)
    assert _cos(first.outputs.embedding, ref[0]) > COS
    assert _cos(second.outputs.embedding, ref[1]) > COS


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_from_the_pooling_config(mode: str, embed_path: str,
                                                      tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = tmp_path / mode
    shutil.copytree(embed_path, path)
    pooling = path / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update({"pooling_mode_lasttoken": False,
                   f"pooling_mode_{'mean_tokens' if mode == 'mean' else 'cls_token'}": True})
    pooling.write_text(json.dumps(config))
    with LLM(str(path), **SMALL) as llm:
        assert llm.engine.pooling.pooler.pooling_type == mode.upper()
        assert not llm.engine.scheduler.kv.enable_prefix_caching  # needs every position
        outs = llm.embed(TEXTS, use_tqdm=False)
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path))
    for text, out in zip(TEXTS, outs):
        with torch.no_grad():
            hidden = model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0]
        ref = hidden.mean(0) if mode == "mean" else hidden[0]
        assert _cos(out.outputs.embedding, ref) > COS


def test_reranker_scores_equal_the_model_card_reference(rerank_card_scores: Any) -> None:
    query = "What is the capital of China?"
    docs = ["The capital of China is Beijing.",
            "Gravity is a force that attracts two bodies towards each other. " * 3]
    path = resolve_model("qwen3-reranker-tiny")
    want = rerank_card_scores(path, [(query, d) for d in docs])
    with LLM("qwen3-reranker-tiny", hf_overrides=RERANKER_OVERRIDES, **SMALL) as llm:
        assert llm.engine.pooling.task == "score"
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        pairwise = llm.score([query, query], docs, use_tqdm=False)
        task = "Judge whether the document names a city"
        custom = [o.outputs.score for o in llm.score(query, docs, instruction=task,
                                                     use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
    assert custom == pytest.approx(rerank_card_scores(path, [(query, d) for d in docs], task),
                                   abs=1e-5)
    assert custom != pytest.approx(got, abs=1e-5)  # the instruction is in the prompt
    assert [o.outputs.score for o in pairwise] == pytest.approx(want, abs=1e-5)


def test_pooling_misuse_is_a_clear_error(embedder: LLM) -> None:
    with pytest.raises(ValueError, match="embed\\(\\) or score\\(\\)"):
        embedder.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="task is 'score'"):
        embedder.score("q", ["d"], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        embedder.embed([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: an input has 513 tokens; this server's "
                                         "max_model_len is 512, so a pooling input may hold 512"):
        embedder.embed([{"prompt_token_ids": [100] * 513}], use_tqdm=False)


def test_an_input_of_exactly_max_model_len_tokens_is_embedded(embedder: LLM,
                                                              embed_path: str) -> None:
    from sentence_transformers import SentenceTransformer

    ids = [100 + (7919 * i) % 150000 for i in range(SMALL["max_model_len"])]
    out = embedder.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    model = SentenceTransformer(embed_path, device="cpu")
    with torch.no_grad():
        ref = model({"input_ids": torch.tensor([ids]),
                     "attention_mask": torch.ones(1, len(ids), dtype=torch.long)})
    assert len(out.prompt_token_ids) == 512
    assert _cos(out.outputs.embedding, ref["sentence_embedding"][0]) > COS


def test_runner_choice_and_bad_reranker_overrides() -> None:
    with LLM("qwen3-tiny", max_num_seqs=4) as llm:
        assert llm.engine.pooling is None
        with pytest.raises(ValueError, match="task is 'embed'"):
            llm.embed(["hi"], use_tqdm=False)
    with LLM("qwen3-tiny", runner="pooling", max_num_seqs=4) as llm:  # vLLM's default pooler
        info = llm.engine.pooling
        assert (info.pooler.pooling_type, info.pooler.normalize, info.matryoshka) == (
            "LAST", True, None)
        with pytest.raises(ValueError, match="does not declare Matryoshka"):
            llm.embed(["hi"], use_tqdm=False, dimensions=8)
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM("qwen3-reranker-tiny", hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"]})
    with pytest.raises(ValueError, match="runner 'pooling'"):
        LLM("qwen3-reranker-tiny", runner="generate", hf_overrides=RERANKER_OVERRIDES)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM("qwen3-tiny", runner="embed")
    with pytest.raises(ValueError, match="speculative_config acts only on generation"):
        LLM("qwen3-embedding-tiny", speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tool_call_parser acts only on generation"):
        LLM("qwen3-embedding-tiny", tool_call_parser="hermes")


def test_tp2_on_ray_matches_sentence_transformers(ray_cluster: None,
                                                  st_reference: torch.Tensor) -> None:
    with LLM("qwen3-embedding-tiny", tensor_parallel_size=2, worker_num_cpus=0.5,
             **SMALL) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    for out, ref in zip(outs, st_reference):
        assert _cos(out.outputs.embedding, ref) > COS


def test_tp2_reranker_on_ray(ray_cluster: None, rerank_card_scores: Any) -> None:
    query, docs = "capital of France", ["Paris is the capital of France.", "Bananas are yellow."]
    want = rerank_card_scores(resolve_model("qwen3-reranker-tiny"), [(query, d) for d in docs])
    with LLM("qwen3-reranker-tiny", tensor_parallel_size=2, worker_num_cpus=0.5,
             hf_overrides=RERANKER_OVERRIDES, **SMALL) as llm:
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
