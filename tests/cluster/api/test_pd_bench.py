"""bench/pd_bench.py without Ray: its arguments, both modes' manifests (the same CPUs, and
`./dev serve`'s checks pass), the burst window's latencies and the transfer figures it reads
from /metrics."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cluster.api.serve_app import check_args

_PATH = Path(__file__).resolve().parents[3] / "bench" / "pd_bench.py"
_spec = importlib.util.spec_from_file_location("pd_bench", _PATH)
pd_bench = importlib.util.module_from_spec(_spec)
sys.modules["pd_bench"] = pd_bench  # (its dataclass looks its module up)
_spec.loader.exec_module(pd_bench)


def test_arguments_and_modes() -> None:
    args = pd_bench.parse_args(["--json", "x.json", "--burst", "3"])
    assert (args.burst, args.json, args.modes) == (3, "x.json", "colocated,disaggregated")
    with pytest.raises(SystemExit):
        pd_bench.parse_args(["--modes", "colocated,both"])


def test_both_modes_use_the_same_cpus_and_pass_the_manifest_checks() -> None:
    colo, pd = (pd_bench.app_args(m, 0.8) for m in pd_bench.MODES)
    check_args(colo)
    check_args(pd)
    assert colo["num_replicas"] * colo["replica_num_cpus"] == 2 * pd["replica_num_cpus"]
    assert set(pd["pd"]) == {"prefill", "decode"}
    # the prefill role at manifests/qwen3-pd.yaml's lower CPU priority unless told otherwise
    assert pd["pd"]["prefill"]["cpu_nice"] == pd_bench.parse_args([]).prefill_nice == 10
    assert pd_bench.app_args("disaggregated", 0.8, 512, 0)["pd"]["prefill"]["cpu_nice"] == 0


def test_the_load_runs_with_the_start_up_heap_frozen() -> None:
    """A collection during the load scans only what the load made, not the client's start-up
    heap (Ray, Serve, the app's modules): its pause would count as the server's."""
    import gc

    start_up = [[] for _ in range(100)]
    with pd_bench.frozen_heap():
        assert gc.get_freeze_count() >= len(start_up)
        scanned = {id(o) for o in gc.get_objects()}
        assert id(start_up) not in scanned and id(start_up[0]) not in scanned
        during = [[]]
        assert id(during) in {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() == 0
    assert id(start_up) in {id(o) for o in gc.get_objects()}


def test_itl_counts_the_gaps_that_overlap_the_burst_window() -> None:
    s = pd_bench.Stream(0.0, [1.0, 1.1, 1.2, 2.2, 2.3, 4.0])
    ended = pd_bench.Stream(0.0, [1.0, 1.2, 1.3])
    burst = [pd_bench.Stream(1.15, [2.25, 2.4]), pd_bench.Stream(1.5, [2.35, 2.5])]
    row = pd_bench.summarize("colocated", [s, ended], burst, wall=4.0)
    # gaps overlapping [1.15, 2.35]: 1.1-1.2 (0.1), 1.2-2.2 (1.0), 2.2-2.3 (0.1), and the stall
    # 2.3-4.0 (1.7) still going on when the window closed; `ended`'s 1.0-1.2 (0.2), 1.2-1.3 (0.1)
    assert row["itl_samples"] == 6 and row["itl_p99_s"] == pytest.approx(1.7)
    assert row["itl_p50_s"] == pytest.approx(0.1)
    assert row["streams_past_window"] == 1  # `ended` stopped inside the window
    assert row["ttft_p50_s"] == pytest.approx((1.1 + 0.85) / 2)
    assert row["output_tok_s"] == pytest.approx(13 / 4.0)


def test_transfer_figures_come_from_the_metrics_text() -> None:
    text = ('qwen3_serve:kv_transfer_imports_total{model_name="m"} 4\n'
            'qwen3_serve:kv_transfer_bytes_in_total{model_name="m"} 2097152\n'
            'qwen3_serve:kv_transfer_seconds_sum{model_name="m"} 0.2\n'
            'qwen3_serve:kv_transfer_seconds_count{model_name="m"} 8\n')
    assert pd_bench.transfer_stats(text) == {"transfers": 4.0, "fallbacks": 0.0,
                                             "transfer_mib": 2.0, "transfer_mean_s": 0.025}


def test_transfer_figures_are_the_decode_roles_when_the_series_carry_roles() -> None:
    """(/metrics labels the transfer series by role; the prefill side's come first.)"""
    text = ('qwen3_serve:kv_transfer_seconds_sum{model_name="m",role="colocated"} 0.0\n'
            'qwen3_serve:kv_transfer_seconds_sum{model_name="m",role="prefill"} 9.0\n'
            'qwen3_serve:kv_transfer_seconds_sum{model_name="m",role="decode"} 0.3\n'
            'qwen3_serve:kv_transfer_seconds_count{model_name="m",role="prefill"} 3\n'
            'qwen3_serve:kv_transfer_seconds_count{model_name="m",role="decode"} 3\n'
            'qwen3_serve:kv_transfer_imports_total{model_name="m",role="prefill"} 0\n'
            'qwen3_serve:kv_transfer_imports_total{model_name="m",role="decode"} 3\n'
            'qwen3_serve:kv_transfer_fallbacks_total{model_name="m",role="decode"} 1\n'
            'qwen3_serve:kv_transfer_bytes_in_total{model_name="m",role="decode"} 1048576\n')
    assert pd_bench.transfer_stats(text) == {"transfers": 3.0, "fallbacks": 1.0,
                                             "transfer_mib": 1.0,
                                             "transfer_mean_s": pytest.approx(0.1)}
