"""bench/peer_vllm.py's set-up step that gives the `vllm` command the distribution it asks for."""

from __future__ import annotations

import csv
import importlib.metadata
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from peer_vllm import _OURS_OFFLINE, _PEER_OFFLINE, OFFLINE, write_vllm_dist_info  # noqa: E402


def test_vllm_dist_info_is_found_by_importlib_metadata(tmp_path: Path) -> None:
    write_vllm_dist_info(tmp_path, "0.32.0")
    found = [d for d in importlib.metadata.distributions(path=[str(tmp_path)])
             if d.metadata["Name"] == "vllm"]
    assert [d.version for d in found] == ["0.32.0"]
    rows = list(csv.reader((tmp_path / "vllm-0.32.0.dist-info" / "RECORD").open()))
    assert sorted(r[0] for r in rows) == sorted(f"vllm-0.32.0.dist-info/{n}"
                                                for n in ("INSTALLER", "METADATA", "RECORD"))
    assert {str(f) for f in found[0].files} == {r[0] for r in rows}


def test_offline_workloads_are_the_issues() -> None:
    assert OFFLINE["offline-cpu"] == ("qwen3-tiny", "float32", 64, (32, 256), (32, 128))
    assert OFFLINE["qwen3-0.6b-bf16"] == ("qwen3-0.6b-random", "bfloat16", 16, (32, 128), (32, 64))


def test_both_sides_run_the_workloads_dtype() -> None:
    # This project's side once ran the bf16 workload in fp32 (dtype "auto" is fp32 on CPU):
    # both child scripts must hand the job's dtype to their engine.
    assert 'dtype=job["dtype"]' in _PEER_OFFLINE
    assert 'dtype=job["dtype"]' in _OURS_OFFLINE
