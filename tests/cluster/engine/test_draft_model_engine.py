"""Speculative decoding with a draft model on qwen3-tiny, CPU: exactly the tokens of speculation off.

Two drafts: qwen3-tiny itself (its greedy proposals are the target's own tokens, so every
proposal must be accepted: this also checks that the draft's K/V, kept in the target's blocks,
is right after chunked prefill, prefix-cache hits, preemption and swap), and
`qwen3-tiny-draft` (2 layers, other random weights: proposals rarely agree). Both give
the tokens of the same engine without speculation, with n = 2, chunked prefill beside verify
rows, preemption (a KV cache too small for the batch), max_tokens and stop strings inside an
accepted run; seeded sampled tokens too (each position draws with its own output index's
stream). Bad drafts are refused at start.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from cluster import LLM, SamplingParams
from workers.tiny_model import TINY_DRAFT_CONFIG, resolve_model, write_random_qwen3

# small cache (12 blocks of 16) and a 48-token step budget: prompts are chunked beside verify
# rows and sequences are preempted
ENGINE = dict(model="qwen3-tiny", device="cpu", executor="inprocess", num_gpu_blocks_override=12,
              max_num_batched_tokens=48, max_num_seqs=8, max_model_len=256)


def _spec(draft: str, k: int = 4) -> dict:
    return {"model": draft, "num_speculative_tokens": k, "disable_by_batch_size": 16}


def _prompts() -> list[dict]:
    rng = random.Random(5)
    shared = [rng.randrange(100, 150000) for _ in range(20)]
    return [{"prompt_token_ids": shared + [rng.randrange(100, 150000) for _ in range(k)]}
            for k in (1, 30, 6)] + [{"prompt_token_ids": [rng.randrange(100, 150000)
                                                          for _ in range(70)]}]


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM, LLM]:
    # the self-draft engine also has a CPU offload tier: evicted prefix blocks (the draft's
    # K/V with the target's) go out and come back
    return (LLM(**ENGINE),
            LLM(**ENGINE, kv_offloading_size=0.01, speculative_config=_spec("qwen3-tiny")),
            LLM(**ENGINE, speculative_config=_spec("qwen3-tiny-draft")))


def _run(llm: LLM, params: list[SamplingParams]) -> list:
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def _counts(llm: LLM) -> tuple[int, int]:
    spec = llm.engine.scheduler.spec
    return spec.num_draft_tokens, spec.num_accepted_tokens


def _check_kv(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks  # no block leaked


GREEDY = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
          for m, n in ((16, 1), (6, 2), (21, 1), (9, 1))]


def test_self_draft_accepts_every_proposal_with_n2_chunks_preemption_prefix_hits_and_offload(
        engines) -> None:
    off, on, _ = engines
    want = _run(off, GREEDY)
    drafted, accepted = _counts(on)
    assert _run(on, GREEDY) == want
    # a long unrelated prompt evicts the cached blocks to the offload tier; the second run's
    # prompts then hit the GPU prefix cache and the tier (the draft's K/V with the target's)
    on.generate([{"prompt_token_ids": list(range(1000, 1170))}],
                SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert _run(on, GREEDY) == want
    new_drafted, new_accepted = _counts(on)
    assert new_drafted - drafted > 30
    assert new_accepted - accepted == new_drafted - drafted  # acceptance 100 %
    m = on.engine.metrics()
    assert (m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]) == (
        new_drafted, new_accepted)
    stats = on.engine.scheduler.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    kv_stats = on.engine.scheduler.kv.stats()
    assert kv_stats.prefix_hits > 0 and kv_stats.blocks_loaded > 0
    _check_kv(on)


def test_a_random_draft_is_mostly_rejected_and_changes_no_token(engines) -> None:
    off, _, rand = engines
    drafted, accepted = _counts(rand)
    assert _run(rand, GREEDY) == _run(off, GREEDY)
    drafted, accepted = _counts(rand)[0] - drafted, _counts(rand)[1] - accepted
    assert drafted >= 30 and accepted < 0.3 * drafted
    _check_kv(rand)


def test_seeded_sampling_equal_off(engines) -> None:
    """The draft proposes greedily, the target samples: some proposals are rejected."""
    off, on, _ = engines
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=9, ignore_eos=True,
                             logprobs=2)
              for t, p, s in ((1.0, 1.0, 1), (0.8, 0.9, 2), (0.0, 1.0, None), (1.0, 0.9, 4))]
    drafted, accepted = _counts(on)
    got, want = _run(on, params), _run(off, params)
    assert [[c[:3] for c in o] for o in got] == [[c[:3] for c in o] for o in want]
    for o, w in zip(got, want):  # the target's logprobs, to fp32 rounding
        for g, e in zip(o[0][3], w[0][3]):
            assert list(g) == list(e)
            assert list(g.values()) == pytest.approx(list(e.values()), abs=1e-4)
    drafted, accepted = _counts(on)[0] - drafted, _counts(on)[1] - accepted
    assert 0 < accepted < drafted
    _check_kv(on)


def test_stop_string_and_max_tokens_inside_an_accepted_run(engines) -> None:
    off, on, _ = engines
    base = _run(off, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 4)
    text = base[0][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop=[stop],
                             include_stop_str_in_output=True),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    got = _run(on, params)
    assert got == _run(off, params)
    assert got[0][0][2] == "stop" and got[1][0][2] == "length" and len(got[1][0][0]) == 7
    _check_kv(on)


@pytest.mark.slow
def test_self_draft_at_tp2_on_ray_accepts_everything(ray_cluster: None, engines) -> None:
    """tp = 2 (gloo): the draft is sharded like the target (its KV heads split the same way)
    and proposes on both ranks (rank 0's argmax broadcast)."""
    off = engines[0]
    params = GREEDY
    cfg = {k: v for k, v in ENGINE.items() if k != "executor"}
    with LLM(**cfg, tensor_parallel_size=2, worker_num_cpus=0.5,
             speculative_config=_spec("qwen3-tiny")) as tp2:
        assert _run(tp2, params) == _run(off, params)
        drafted, accepted = _counts(tp2)
        assert drafted > 20 and accepted == drafted
        _check_kv(tp2)


def _draft_like(tmp_path, name: str, **overrides):
    return write_random_qwen3(tmp_path / name, {**TINY_DRAFT_CONFIG, "hidden_size": 32,
                                                 "intermediate_size": 32, **overrides}, seed=2)


def test_a_draft_that_does_not_fit_is_refused_at_start(tmp_path) -> None:
    small_vocab = _draft_like(tmp_path, "vocab", vocab_size=1000)
    other_kv = _draft_like(tmp_path, "kv", num_key_value_heads=4)
    other_tok = tmp_path / "tok"
    shutil.copytree(resolve_model("qwen3-tiny-draft"), other_tok)
    tok = json.loads((other_tok / "tokenizer_config.json").read_text())
    tok["added_tokens_decoder"]["151700"] = {
        "content": "<|draft_only|>", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": True}
    (other_tok / "tokenizer_config.json").write_text(json.dumps(tok))
    for draft, message in ((small_vocab, "vocab_size 1000"), (other_kv, "KV heads"),
                           (other_tok, "another tokenizer"), (tmp_path / "none", "neither")):
        with pytest.raises(ValueError, match=f"speculative_config.model.*{message}"):
            LLM(**ENGINE, speculative_config=_spec(str(draft)))
    for k in (0, 17):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            LLM(**ENGINE, speculative_config=_spec("qwen3-tiny-draft", k))
