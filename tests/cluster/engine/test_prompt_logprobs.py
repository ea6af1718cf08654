"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against the oracle, Hugging Face
transformers' log-softmax of the same checkpoint in fp32: text and token-id prompts, chunked
prefill, a prompt whose prefix is in the prefix cache, recompute preemption, async
scheduling, n > 1, speculative verify rows in the same steps, and tp = 2 on Ray.

Tolerance: 2e-3 on every value (observed differences ~3e-6: fp32 summation order); a rank is
checked against the oracle's ranks of every value within 1e-4 of the token's (near-ties
may swap).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from cluster import LLM, SamplingParams
from scheduler import Logprob

ATOL = 2e-3
TIE = 1e-4
TEXT = ("The quick brown fox jumps over the lazy dog while the sleepy cat watches from the "
        "warm windowsill, wondering why anyone would run that fast on a Sunday morning.")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150000) for _ in range(n)]


@pytest.fixture(scope="module")
def hf(tiny_model_path: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def oracle(hf: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of the model's logits at each prompt position."""
    with torch.no_grad():
        return hf[0](torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check(hf: Any, prompt: list[int], got: list[dict[int, Logprob] | None] | None,
          k: int) -> None:
    """`got` is vLLM's shape and holds the oracle's values, ranks, top k and token texts."""
    ref = oracle(hf, prompt)
    tokenizer = hf[1]
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, token, entry = ref[j - 1], prompt[j], got[j]
        assert entry is not None and token in entry
        mine = entry[token]
        want = row[token].item()
        assert abs(mine.logprob - want) <= ATOL, (j, mine, want)
        assert (int((row > want + TIE).sum()) + 1 <= mine.rank
                <= int((row > want - TIE).sum()) + 1), (j, mine.rank)
        assert mine.decoded_token == tokenizer.decode([token])
        top = sorted((lp for t, lp in entry.items() if lp.rank <= k and lp.rank is not None),
                     key=lambda lp: lp.rank)
        kth = row.topk(k).values[-1].item() if k else float("inf")
        others = {t: lp for t, lp in entry.items() if t != token}
        assert len(others) <= k and len(entry) in (k, k + 1)
        for t, lp in others.items():
            assert abs(lp.logprob - row[t].item()) <= ATOL and row[t].item() >= kth - TIE
            assert lp.decoded_token == tokenizer.decode([t])
        assert [lp.rank for lp in top] == list(range(1, len(top) + 1))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_text_and_token_prompts_match_transformers_chunked(hf: Any,
                                                           async_scheduling: bool) -> None:
    """A 24-token budget spreads the prompts over several steps (chunked prefill); a plain
    request and one with logprobs share the steps."""
    ids = _ids(70, 1)
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=24,
             async_scheduling=async_scheduling) as llm:
        outs = llm.generate(
            [TEXT, {"prompt_token_ids": ids}, {"prompt_token_ids": _ids(40, 2)}],
            [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5),
             SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=2),
             SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
        text_ids = hf[1].encode(TEXT, add_special_tokens=False)
        assert len(text_ids) > 24 and outs[0].prompt_token_ids == text_ids
        check(hf, text_ids, outs[0].prompt_logprobs, 5)
        check(hf, ids, outs[1].prompt_logprobs, 0)
        assert outs[2].prompt_logprobs is None
        # the completion's own logprobs are unaffected
        assert len(outs[1].outputs[0].logprobs) == 3


def test_a_cached_prefix_is_recomputed_and_exact(hf: Any) -> None:
    """The same prompt twice: the second request would hit the whole prefix, but a request
    with prompt logprobs reads no cached block; its blocks still serve a later request."""
    ids = _ids(60, 3)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=64) as llm:
        first = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        second = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        plain = llm.generate([{"prompt_token_ids": ids}],
                             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert plain.num_cached_tokens == 48  # three full 16-token blocks
    check(hf, ids, second.prompt_logprobs, 3)
    assert second.prompt_logprobs == first.prompt_logprobs


def test_recompute_preemption_and_n_samples_keep_them_exact(hf: Any) -> None:
    """A cache of 8 blocks preempts by recompute: a recomputed chunk's values are not
    repeated. n = 2 computes the prompt once (the parent) and both samples report it."""
    prompts = [_ids(20 + i, 10 + i) for i in range(5)]
    with LLM("qwen3-tiny", num_gpu_blocks_override=8, preemption_mode="recompute", max_num_seqs=8,
             max_num_batched_tokens=24) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=2),
                            use_tqdm=False)
        assert llm.engine.scheduler.stats().preemptions_recompute > 0
        pair = llm.generate([{"prompt_token_ids": prompts[0]}],
                            SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=4,
                                           prompt_logprobs=1), use_tqdm=False)[0]
    for p, out in zip(prompts, outs):
        check(hf, p, out.prompt_logprobs, 2)
    check(hf, prompts[0], pair.prompt_logprobs, 1)
    assert [len(c.token_ids) for c in pair.outputs] == [4, 4]


def test_prefill_chunks_beside_speculative_verify_rows(hf: Any) -> None:
    """n-gram speculation: a repetitive prompt's verify rows share steps with the chunks of a
    long prompt that computes prompt logprobs."""
    rng = random.Random(8)
    motif = [rng.randrange(100, 150000) for _ in range(5)]
    long = _ids(90, 9)
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=32,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 3}) as llm:
        outs = llm.generate([{"prompt_token_ids": motif * 4}, {"prompt_token_ids": long}],
                            [SamplingParams(temperature=0, max_tokens=24),
                             SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)],
                            use_tqdm=False)
        assert llm.engine.metrics()["spec_decode_num_drafts"] > 0
    check(hf, long, outs[1].prompt_logprobs, 2)


def test_logits_are_made_a_bounded_slice_of_rows_at_a_time(hf: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-token chunk with slices of 7 rows: the lm head never sees more than 7 prompt rows
    at once, and the slices join up exactly. (The sampled row is greedy: the LM head's
    `greedy_tokens` takes it, one row, not `compute_logits`.)"""
    import workers.prompt_logprobs as prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGPROB_ROWS", 7)
    ids = _ids(64, 6)
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=64) as llm:
        model = llm.engine.executor.worker.model
        seen: list[int] = []
        compute = model.compute_logits

        def recording(hidden: torch.Tensor) -> torch.Tensor | None:
            seen.append(hidden.shape[0])
            return compute(hidden)

        monkeypatch.setattr(model, "compute_logits", recording)
        greedy = model.lm_head.greedy_tokens

        def recording_greedy(hidden: torch.Tensor) -> torch.Tensor | None:
            seen.append(-hidden.shape[0])  # (negative: a greedy_tokens call)
            return greedy(hidden)

        monkeypatch.setattr(model.lm_head, "greedy_tokens", recording_greedy)
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0]
    assert seen == [7] * 9 + [-1]  # 63 prompt rows, then the sampled one, greedy
    check(hf, ids, out.prompt_logprobs, 2)


def test_bad_prompt_logprobs_is_a_value_error_naming_the_field() -> None:
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.slow
def test_tp2_on_ray_matches_transformers(ray_cluster: None, hf: Any) -> None:
    """Both ranks turn the chunk's hidden rows into logits (a gather to rank 0) slice by
    slice; rank 0 returns the values through the compiled graph."""
    ids = _ids(50, 4)
    with LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5, max_num_seqs=8,
             max_num_batched_tokens=24, async_scheduling=True) as llm:
        outs = llm.generate([{"prompt_token_ids": ids}, TEXT],
                            SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4),
                            use_tqdm=False)
    check(hf, ids, outs[0].prompt_logprobs, 4)
    check(hf, hf[1].encode(TEXT, add_special_tokens=False), outs[1].prompt_logprobs, 4)
