"""Speculative decoding's scheduler side: verify rows, rollback, the config, n-gram lookup.

The fake worker (scheduler_harness.py) verifies proposals against its fake model exactly as
a greedy target would; a proposer that replays the model's true next tokens with a set
probability (and a wrong token otherwise) makes every acceptance length happen."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    VOCAB,
    Collected,
    check_consistency,
    collect,
    make,
    next_token,
    reference_tokens,
    step,
)

from scheduler import SamplingParams
from scheduler.ngram import NgramProposer
from scheduler.speculative import SpeculativeConfig

BS = 4
GPU_BLOCKS = 14
MAX_MODEL_LEN = 48


class ReplayProposer:
    """Proposes the fake model's true next tokens (as sample 0 sees them), each right with
    probability `p` (then the rest of the proposal is wrong too, since it follows a
    different context)."""

    def __init__(self, p: float, seed: int) -> None:
        self.p = p
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        out, ctx = [], list(token_ids)
        for _ in range(self.rng.randint(0, k)):
            t = next_token(ctx, 0)
            if self.rng.random() >= self.p:
                t = 2 + (t + 1) % (VOCAB - 2)
            out.append(t)
            ctx.append(t)
        return out


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    cfg = {
        "mode": draw(st.sampled_from(["swap", "recompute"])),
        "chunked": draw(st.booleans()),
        "prefix_caching": draw(st.booleans()),
        "k": draw(st.integers(1, 6)),
        "p": draw(st.sampled_from([0.0, 0.7, 1.0])),
        "seed": draw(st.integers(0, 1000)),
        "max_num_seqs": draw(st.integers(2, 6)),
        # the batch off switch (and the decode lane, which runs when it is off)
        "disable_by_batch_size": draw(st.sampled_from([1, 3, 100])),
    }
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=14))
        n = draw(st.integers(1, 2))
        max_tokens = draw(st.integers(1, 24))
        # every request must fit the cache alone (else it ends early with "length")
        if n * -(-(len(prompt) + max_tokens - 1) // BS) > GPU_BLOCKS:
            n = 1
        sp = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens,
                            min_tokens=draw(st.integers(0, min(2, max_tokens))),
                            ignore_eos=draw(st.booleans()),
                            stop_token_ids=draw(st.lists(st.integers(2, VOCAB - 1), max_size=3)))
        reqs.append((f"r{i}", prompt, sp, draw(st.integers(0, 6)),
                     draw(st.one_of(st.none(), st.integers(0, 40)))))
    return {"cfg": cfg, "reqs": reqs}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_verify_rows_match_reference_roll_back_and_free_everything(w: dict) -> None:
    cfg = w["cfg"]
    num_cpu = 16 if cfg["mode"] == "swap" else 0
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": cfg["k"],
                                        "disable_by_batch_size": cfg["disable_by_batch_size"]})
    sched, kv, worker = make(
        num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=num_cpu, block_size=BS,
        enable_prefix_caching=cfg["prefix_caching"], max_num_seqs=cfg["max_num_seqs"],
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=12 if cfg["chunked"] else MAX_MODEL_LEN,
        enable_chunked_prefill=cfg["chunked"], preemption_mode=cfg["mode"], speculative=spec)
    sched.spec.proposer = ReplayProposer(cfg["p"], cfg["seed"])
    got: dict[tuple[str, int], Collected] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    pending = sorted(w["reqs"], key=lambda r: r[3])
    for t in range(2000):
        while pending and pending[0][3] <= t:
            rid, prompt, sp, _, _ = pending.pop(0)
            sched.add_request(rid, prompt, sp)
        for rid, _, _, arrival, abort_at in w["reqs"]:
            if abort_at == t and arrival <= t:
                out = sched.abort(rid)
                if out is not None:
                    aborted.add(rid)
                    collect([out], got, finished)
        if not pending and not sched.has_unfinished():
            break
        collect(step(sched, worker)[1], got, finished)
        check_consistency(sched, kv, worker)
    else:
        raise AssertionError(f"still running after 2000 steps: {sched.requests}")
    for rid, prompt, sp, _, _ in w["reqs"]:
        assert rid in finished
        for j in range(sp.n):
            ref = reference_tokens(prompt, sp, j, MAX_MODEL_LEN)
            c = got.get((rid, j), Collected())
            if rid in aborted and c.finish_reason in ("abort", None):
                assert c.token_ids == ref[:len(c.token_ids)], (rid, j)
            else:
                assert c.token_ids == ref, (rid, j)
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == GPU_BLOCKS
    assert kv.num_free_cpu_blocks == num_cpu
    s = sched.spec
    assert s.num_accepted_tokens <= s.num_draft_tokens
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    if cfg["p"] == 1.0 and all(sp.n == 1 for _, _, sp, _, _ in w["reqs"]):
        assert s.num_accepted_tokens == s.num_draft_tokens
    event(f"lane steps {sched.lane.steps > 0}")
    event(f"p={cfg['p']}: verified {worker.num_verified > 0}, "
          f"rejected {s.num_accepted_tokens < s.num_draft_tokens}")
    stats = sched.stats()
    event(f"preempted {stats.preemptions_swap + stats.preemptions_recompute > 0}")


def test_a_verify_row_reserves_lookahead_then_gives_back_rejected_blocks() -> None:
    spec = SpeculativeConfig.from_dict({"num_speculative_tokens": 8})
    sched, kv, worker = make(num_gpu_blocks=16, block_size=BS, speculative=spec,
                             max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
    sched.spec.proposer = ReplayProposer(0.0, 0)  # every proposal wrong
    sched.spec.proposer.rng.randint = lambda a, b: b  # always k tokens
    sched.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=30,
                                                            ignore_eos=True))
    step(sched, worker)  # prefill: 5 tokens, 2 blocks, first token sampled
    seq = sched.requests["r"].seqs[0]
    assert (seq.num_computed, kv.num_slots(seq.seq_id)) == (5, 5)
    plan = sched.schedule()
    assert plan.num_draft_tokens.tolist() == [8] and plan.query_lens.tolist() == [9]
    assert kv.num_slots(seq.seq_id) == 14 and len(kv.block_table(seq.seq_id)) == 4
    free_during = kv.num_free_gpu_blocks
    sched.apply_result(plan, worker.execute(plan))
    # nothing accepted: the target's token only, and the two blocks only proposals filled
    # are free again
    assert len(seq.token_ids) == 7 and seq.num_computed == 6
    assert kv.num_slots(seq.seq_id) == 6 and len(kv.block_table(seq.seq_id)) == 2
    assert kv.num_free_gpu_blocks == free_during + 2
    assert (sched.spec.num_drafts, sched.spec.num_draft_tokens,
            sched.spec.num_accepted_tokens) == (1, 8, 0)
    check_consistency(sched, kv, worker)


@pytest.mark.parametrize("cfg, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method 'eagle3' is unknown"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"model": "/some/draft", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"model": "/some/draft", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"model": "/some/draft", "method": "ngram", "num_speculative_tokens": 2}, "draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model"),
    ({"model": "", "num_speculative_tokens": 2}, "checkpoint directory"),
])
def test_bad_speculative_config_is_a_clear_error(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(cfg)


def test_ngram_lookup_proposes_what_followed_the_tail_before() -> None:
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert p.propose([1, 2, 3], 2) == []  # no n-gram of the tail recurs
    assert p.propose([9, 9, 9, 9, 9, 9], 2) == [9, 9]
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # the tokens there are
    assert p.propose([1, 2, 3, 4, 1, 2], 0) == []


def test_a_draft_model_config_proposes_placeholders_the_workers_fill() -> None:
    from scheduler.draft_proposer import DraftModelProposer
    from scheduler.plan import DRAFT_TOKEN
    from scheduler.speculative import Speculator

    cfg = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    spec = Speculator(cfg)
    assert isinstance(spec.proposer, DraftModelProposer)
    assert spec.proposer.propose([1, 2, 3], 3) == [DRAFT_TOKEN] * 3
    assert spec.proposer.propose([1, 2, 3], 0) == []
