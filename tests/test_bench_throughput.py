"""bench/throughput.py's passes: every timed pass sends prompts of its own, so the prefix cache
cannot serve a later pass from an earlier one's blocks (the H100's second pass of 2026-11-27 did)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import throughput  # noqa: E402


def test_fresh_prompts_keep_the_lengths_and_share_no_prefix() -> None:
    reqs = throughput.make_requests(throughput.WORKLOADS["offline-gpu"], seed=0)
    passes = [reqs] + [throughput.fresh_prompts(reqs, k) for k in (1, 2, 3)]
    for other in passes[1:]:
        assert [(len(p), o) for p, o in other] == [(len(p), o) for p, o in reqs]
        assert all(100 <= t < 150000 for p, _ in other for t in p)
    # no two passes (nor two requests of all of them) begin with the same 16-token block
    firsts = [tuple(p[:16]) for run in passes for p, _ in run]
    assert len(set(firsts)) == len(firsts)
    assert throughput.fresh_prompts(reqs, 2) == throughput.fresh_prompts(reqs, 2)
