"""bench/peer_vllm.py: the set-up step that gives the `vllm` command the distribution it asks
for, the workloads, and the served load client's CPU priority."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import peer_vllm  # noqa: E402
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


_REPORT = ("import os, sys; ag = open('/proc/self/autogroup').read().split()[-1] "
           "if os.path.exists('/proc/self/autogroup') else 'none'; "
           "open(sys.argv[1], 'w').write(f'{os.getpriority(os.PRIO_PROCESS, 0)} {ag} "
           "{os.getsid(0) == os.getpid()}')")


def _client_sees(tmp_path: Path, priority: str) -> tuple[str, int, str, str]:
    """(how `run_load_client` says it ran, then the client's nice, its autogroup's nice and
    whether it leads its own session, as the client itself read them)."""
    out = tmp_path / "prio"
    how = peer_vllm.run_load_client([sys.executable, "-c", _REPORT, str(out)], dict(os.environ),
                                    60, priority)
    nice, autogroup, own_session = out.read_text().split()
    return how, int(nice), autogroup, own_session


def test_the_load_client_runs_in_its_own_session_at_top_priority(tmp_path: Path) -> None:
    how, nice, autogroup, own_session = _client_sees(tmp_path, "top")
    assert own_session == "True"
    if os.geteuid() != 0:
        assert how == "default (not root: no lower nice)"
        assert nice == os.getpriority(os.PRIO_PROCESS, 0)
        return
    assert nice == peer_vllm.CLIENT_NICE == -20
    if autogroup == "none":  # a kernel without autogroups
        assert how.startswith("nice -20, autogroup not set")
    else:
        assert (how, autogroup) == ("nice -20, autogroup -20", "-20")


def test_the_load_client_at_default_priority_its_failure_and_a_bad_priority(
        tmp_path: Path) -> None:
    how, nice, autogroup, own_session = _client_sees(tmp_path, "default")
    assert (how, own_session) == ("default", "True")
    assert nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert autogroup in ("0", "none")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        peer_vllm.run_load_client([sys.executable, "-c", "import sys; sys.exit(3)"],
                                  dict(os.environ), 60, "top")
    assert failed.value.returncode == 3
    with pytest.raises(ValueError, match="'top' or 'default'; got 'high'"):
        peer_vllm.run_load_client([sys.executable, "-c", "pass"], dict(os.environ), 60, "high")


def test_markdown_has_the_command_machine_and_each_rows_ratios_to_vllm() -> None:
    def row(server: str, c: int, req_s: float, ttft: float, itl: float) -> dict:
        return {"server": server, "concurrency": c, "req_s": req_s, "ttft_median_ms": ttft,
                "ttft_p99_ms": 2 * ttft, "itl_median_ms": itl, "itl_p99_ms": 3 * itl}

    result = {"machine": {"cpu": "AMD EPYC x2", "threads": "2", "python": "3.11.7",
                          "torch": "2.13.0+cpu", "transformers": "5.24.0"},
              "peer": peer_vllm.PEER,
              "offline": [{"workload": "offline-cpu", "runs": {"vllm": [1000.0, 1100.0],
                                                                "ours": [1800.0, 1900.0]},
                           "ratio": 1850 / 1050}],
              "served": [row("vllm", 1, 1.5, 22.0, 10.0), row("vllm", 8, 6.0, 70.0, 19.0),
                         row("manifests/qwen3-tiny-direct.yaml", 1, 1.8, 19.8, 7.5),
                         row("manifests/qwen3-tiny-direct.yaml", 8, 8.4, 49.0, 12.35)]}
    lines = peer_vllm.markdown(result, "bench/peer_vllm.py --served 1 8").splitlines()
    assert lines[0] == ("`bench/peer_vllm.py --served 1 8`; AMD EPYC x2, 2 threads, Python "
                        "3.11.7, torch 2.13.0+cpu, transformers 5.24.0; peer "
                        f"{peer_vllm.PEER}.")
    assert "| `offline-cpu` | 1000.0, 1100.0 | 1800.0, 1900.0 | **1.76x** |" in lines
    assert "| vLLM CPU 0.32.0 | 8 | 6.00 | 70.0 / 140.0 | 19.00 / 57.0 |  |  |  | 3.0x |" in lines
    assert ("| `qwen3-tiny-direct.yaml` | 1 | 1.80 | 19.8 / 39.6 | 7.50 / 22.5 | 1.20x | 0.75x "
            "| 0.90x | 3.0x |") in lines
    assert ("| `qwen3-tiny-direct.yaml` | 8 | 8.40 | 49.0 / 98.0 | 12.35 / 37.0 | 1.40x | 0.65x "
            "| 0.70x | 3.0x |") in lines
    assert all(line.count("|") == 10 for line in lines if line.startswith("| ") and "C |" in line)
