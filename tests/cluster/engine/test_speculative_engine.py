"""Speculative decoding (n-gram) on qwen3-tiny, CPU: exactly the tokens of speculation off.

Greedy tokens, seeded sampled tokens and their logprobs (to fp32 rounding) are those of the
same engine without speculation (a sampled position draws with the random stream of its own output index, so a
verify row draws what a plain decode draws), with n = 2, chunked prefill beside verify rows,
preemption (a KV cache too small for the batch), max_tokens and stop strings inside an
accepted run."""

from __future__ import annotations

import random

import pytest

from cluster import LLM, SamplingParams

# small cache (12 blocks of 16) and a 48-token step budget: prompts are chunked beside verify
# rows and sequences are preempted
ENGINE = dict(model="qwen3-tiny", device="cpu", executor="inprocess", num_gpu_blocks_override=12,
              max_num_batched_tokens=48, max_num_seqs=8, max_model_len=256)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "disable_by_batch_size": 16}


def _prompts() -> list[dict]:
    rng = random.Random(3)
    motif = [rng.randrange(100, 150000) for _ in range(5)]
    return [{"prompt_token_ids": motif * 4 + [rng.randrange(100, 150000) for _ in range(k)]}
            for k in (1, 30, 6)] + [{"prompt_token_ids": [rng.randrange(100, 150000)
                                                          for _ in range(70)]}]


class Perturbed:
    """The n-gram proposer, with every other proposal's last token made wrong: qwen3-tiny's
    random weights repeat tokens, so n-gram lookup alone is always right on them."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        out = self.inner.propose(token_ids, k)
        self.calls += 1
        if out and self.calls % 2:
            out[-1] = out[-1] + 1
        return out


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    on = LLM(**ENGINE, speculative_config=SPEC)
    on.engine.scheduler.spec.proposer = Perturbed(on.engine.scheduler.spec.proposer)
    return LLM(**ENGINE), on


def _run(llm: LLM, params: list[SamplingParams]) -> list:
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_greedy_tokens_equal_off_with_n2_chunks_and_preemption(engines) -> None:
    off, on = engines
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
              for m, n in ((22, 1), (7, 2), (30, 1), (13, 1))]
    before = on.engine.scheduler.spec.num_accepted_tokens
    assert _run(on, params) == _run(off, params)
    spec = on.engine.scheduler.spec
    assert spec.num_accepted_tokens - before > 10  # it did speculate, and was right
    assert spec.num_accepted_tokens < spec.num_draft_tokens  # and wrong
    m = on.engine.metrics()
    assert (m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"],
            m["spec_decode_num_accepted_tokens"]) == (
        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert sum(m["spec_decode_num_accepted_tokens_per_pos"]) == spec.num_accepted_tokens
    stats = on.engine.scheduler.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    kv = on.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def test_seeded_sampling_and_logprobs_equal_off(engines) -> None:
    off, on = engines
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=16, ignore_eos=True,
                             logprobs=2)
              for t, p, s in ((1.0, 1.0, 1), (0.8, 0.9, 2), (0.0, 1.0, None), (1.0, 0.9, 4))]
    got, want = _run(on, params), _run(off, params)
    assert [[c[:3] for c in o] for o in got] == [[c[:3] for c in o] for o in want]
    # the same top tokens; values to fp32 rounding (a verify row is computed as a chunk)
    for o, w in zip(got, want):
        for g, e in zip(o[0][3], w[0][3]):
            assert list(g) == list(e)
            assert list(g.values()) == pytest.approx(list(e.values()), abs=1e-4)


def test_stop_string_and_max_tokens_inside_an_accepted_run(engines) -> None:
    off, on = engines
    base = _run(off, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4)
    text = base[0][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop=[stop],
                             include_stop_str_in_output=True),
              # its text repeats from the start: min_tokens decides where it stops
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             stop=[base[3][0][1][:2]], min_tokens=6)]
    got = _run(on, params)
    assert got == _run(off, params)
    assert got[0][0][2] == "stop" and got[1][0][2] == "length"
    assert got[3][0][2] == "stop" and len(got[3][0][0]) == 7


@pytest.mark.slow
def test_greedy_tokens_equal_off_at_tp2_on_ray(ray_cluster: None, engines) -> None:
    """tp = 2 (gloo): verify rows run on both ranks, rank 0 accepts; async scheduling, asked
    for, is turned off."""
    off, _ = engines
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
              for m, n in ((20, 1), (9, 2), (14, 1), (6, 1))]
    cfg = {k: v for k, v in ENGINE.items() if k != "executor"}
    with LLM(**cfg, tensor_parallel_size=2, worker_num_cpus=0.5, async_scheduling=True,
             speculative_config=SPEC) as tp2:
        assert not tp2.engine.async_scheduling
        spec = tp2.engine.scheduler.spec
        spec.proposer = Perturbed(spec.proposer)
        assert _run(tp2, params) == _run(off, params)
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("cfg", [{"method": "ngram", "num_speculative_tokens": 0},
                                 {"method": "ngram", "num_speculative_tokens": 17},
                                 {"method": "medusa", "num_speculative_tokens": 2},
                                 {"model": "/ckpt/qwen3-0.6b", "num_speculative_tokens": 0},
                                 {"model": "/ckpt/qwen3-0.6b", "method": "ngram",
                                  "num_speculative_tokens": 2},
                                 {"method": "draft_model", "num_speculative_tokens": 2},
                                 "ngram"])
def test_engine_config_refuses_a_bad_speculative_config_at_start(cfg) -> None:
    from cluster.engine.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config=cfg)


def test_verify_rows_beside_constrained_and_penalized_rows(engines) -> None:
    """Structured outputs and penalties do not speculate, but share steps with verify rows
    (the bitmask's rows and the penalties' rows are remapped past the verify rows)."""
    from cluster import StructuredOutputsParams

    off, on = engines
    params = [SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=(
                  StructuredOutputsParams(regex="[a-c]{4,8}"))),
              SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True,
                             repetition_penalty=1.3, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    before = on.engine.scheduler.spec.num_drafts
    got = _run(on, params)
    assert got == _run(off, params)
    assert on.engine.scheduler.spec.num_drafts > before
    assert all(ch in "abc" for ch in got[1][0][1]) and len(got[1][0][1]) >= 4
