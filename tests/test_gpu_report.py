"""The GPU run's logic, checked where there is no GPU, so a lent GPU's minutes go to measuring.

`bench/gpu_run.sh` must exit at once without CUDA; every step of `bench/gpu_report.py` must
name a script that accepts its arguments, and the gpu tests it runs must be the gpu-marked
files; the report's tables must render from the results the benchmarks write.
"""

from __future__ import annotations

import argparse
import ast
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_report  # noqa: E402


class _Parsed(Exception):
    pass


def test_gpu_run_exits_at_once_without_cuda(tmp_path: Path) -> None:
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh")], capture_output=True,
                          text=True, env=dict(os.environ, OUT=str(tmp_path / "out")), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "out").exists()


def test_gpu_tests_step_runs_every_gpu_marked_file(tmp_path: Path) -> None:
    step = next(s for s in gpu_report.steps(tmp_path) if s.name == "gpu tests")
    files = {a for a in step.argv if a.startswith("tests/")}
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "@pytest.mark.gpu" in p.read_text() or "pytestmark = pytest.mark.gpu" in p.read_text()}
    assert marked <= files
    assert "tests/workers/test_cuda_step_loop.py" in files
    assert all((ROOT / f).is_file() for f in files)


def test_engines_the_gpu_tests_build_on_cuda_size_their_cache() -> None:
    """The gpu tests run on six xdist workers sharing one GPU (tests/conftest.py): an engine a
    gpu test starts on CUDA names its cache's size, or a share of the device of at most 0.1,
    never the default 0.9 (which took 69 GiB of an H100 for qwen3-tiny)."""
    unsized = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("LLM", "EngineConfig")):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if getattr(kw.get("device"), "value", None) != "cuda":
                continue
            share = getattr(kw.get("gpu_memory_utilization"), "value", 1.0)
            if "num_gpu_blocks_override" not in kw and not share <= 0.1:
                unsized.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unsized == []


@pytest.mark.parametrize("name", [s.name for s in gpu_report.steps(Path("out"))
                                  if s.argv[1].startswith("bench/")])
def test_each_benchmark_step_accepts_its_arguments(name: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    step = next(s for s in gpu_report.steps(tmp_path) if s.name == name)
    script = ROOT / step.argv[1]
    if step.script and not script.exists():
        pytest.skip(f"{step.script} is not in this tree yet; the report marks the step absent")
    parsed: list[argparse.Namespace] = []
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # noqa: ANN001
        parsed.append(original(self, args, namespace))
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *step.argv[2:]])
    monkeypatch.chdir(ROOT)
    with pytest.raises(_Parsed):
        runpy.run_path(str(script), run_name="__main__")
    assert parsed and getattr(parsed[0], "json", None) is not None


def test_models_step_is_valid_python(tmp_path: Path) -> None:
    step = next(s for s in gpu_report.steps(tmp_path) if s.name == "models")
    compile(step.argv[2], "<models>", "exec")


def test_budgets_fit_the_run_in_priority_order(tmp_path: Path) -> None:
    names = [s.name for s in gpu_report.steps(tmp_path)]
    assert names[:3] == ["models", "gpu tests", "offline-gpu"]
    # the issue's own list before the probes of earlier runs' faults and other issues' steps
    assert names.index("spec-decode graphs") < names.index("attention bounds")
    assert names[-1] == "prompt logprobs 8b"
    assert len(names) == len(set(names))
    assert all(s.budget_s > 0 for s in gpu_report.steps(tmp_path))


def test_report_tables_render_from_benchmark_results() -> None:
    report = {
        "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26 12:00 UTC", "commit": "abc1234",
        "driver": "580.159.04", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
        "steps": {"gpu tests": {"status": "ok", "seconds": 90.0},
                  "fp8": {"status": "absent (bench/fp8_bench.py not in this tree)", "seconds": 0}},
        "tests": {"tests": 80, "failures": 1, "errors": 0, "skipped": 2,
                  "failed": ["tests.kernels::test_x"]},
        "results": {
            "offline-gpu": {"rows": {"engine tp=1, async on": {
                "tok_per_s": 12000.4, "passes_tok_per_s": {"seeded": [11000.0, 12000.4]}},
                "hf continuous, exact lengths": {"error": "OutOfMemoryError: x"}}},
            "decode anatomy": {"rows": [{"batch": 32, "wall_ms": 4.37, "kernel_ms": 3.03,
                                         "gpu_busy": 0.69, "kernels_per_step": 400}]},
            "kernels": {"copy_bandwidth_GBps": 3000.0,
                        "decode": [{"batch": 32, "ctx": 4096, "ms": 0.5, "frac_copy_bw": 0.9}],
                        "decode_split_sweep": [{"batch": 32, "ctx": 1024, "ms": 0.0629,
                                                "frac_copy_bw": 0.71, "num_segments": 2}],
                        "prefill": [{"prefix": 0, "chunk": 1024, "ms_triton": 0.2,
                                     "ms_sdpa": 0.1, "speed_vs_sdpa": 0.5}],
                        "decode_step": [{"batch": 1, "graph_ms": 1.5, "kernel_ms": 1.2,
                                         "kernels_per_step": 300}]},
            "spec-decode eager": {"rows": [{"acceptance": 1.0, "batch": 1, "tok_s_off": 100,
                                            "tok_s_on": 300, "speedup": 3.0,
                                            "acceptance_length": 5.0}]},
            "moe": {"rows": [{"tokens": 32, "fused_ms": 0.1, "loop_ms": 1.0, "dense_ms": 0.05,
                              "fused_GBps": 2000.0},
                             {"tokens": 512, "fused_ms": 0.4, "loop_ms": 2.0, "dense_ms": 0.2,
                              "fused_GBps": 2500.0, "fp8_ms": 0.25, "fp8_speedup": 1.6,
                              "fp8_max_abs_diff_vs_twin": 0.002}]},
            "offload copies": {"copies": {"gib": 0.5, "offload_gb_s": 20.5}},
            "embed": {"rows": [{"batch": 64, "system": "engine", "inputs_per_s": 105.5,
                                "tokens_per_s": 26158.2, "seconds": 0.6}]},
            "prompt logprobs 8b": {"rows": [{"prompt_tokens": 512, "prefill_ms": 40.0,
                                             "loglikelihood_ms": 44.0, "ratio": 1.1}]},
        }}
    md = gpu_report._markdown(report)
    assert md.startswith("# GPU report: NVIDIA H100 80GB HBM3, 2026-11-26 12:00 UTC, commit abc1234")
    assert "| fp8 | absent (bench/fp8_bench.py not in this tree) | 0 |" in md
    assert "- FAILED tests.kernels::test_x" in md
    assert "| engine tp=1, async on | 12000 | seeded: 11000, 12000 |" in md
    assert "| hf continuous, exact lengths | OutOfMemoryError: x |  |" in md
    assert "| 32 | 4.37 | 3.03 | 69% | 400 |" in md
    assert "| 32 | 4096 | 500.0 | 0.90 |" in md
    assert "| 2 | 62.9 | 0.71 |" in md  # the split-K sweep at the decode step's shape
    assert "| 0 | 1024 | 0.200 | 0.100 | 0.50 |" in md
    assert "| eager | 1.0 | 1 | 100 | 300 | 3.0 | 5.0 |" in md
    assert "| 32 | 0.1 | 1.0 | 0.05 | 2000.0 | - | - | - |" in md
    assert "| 512 | 0.4 | 2.0 | 0.2 | 2500.0 | 0.25 | 1.6 | 0.002 |" in md  # FP8 experts
    assert "offload copies: gib 0.50, offload_gb_s 20.50" in md
    assert "| 64 | engine | 105.5 | 26158 |" in md
    assert "| 512 | 40.0 | 44.0 | 1.10 |" in md


def test_report_compares_the_fp8_decode_step_with_bf16s() -> None:
    rows = [{"batch": 256, "decode_step_ms": 20.0}]
    report = {"device": "H100", "date": "d", "commit": "c", "driver": "x", "torch": "t",
              "triton": "t", "transformers": "t", "steps": {}, "tests": {},
              "results": {"decode bf16": {"rows": rows},
                          "decode fp8": {"rows": [{"batch": 256, "decode_step_ms": 12.0}]},
                          "offline-gpu fp8": {"rows": {"engine tp=1": {"tok_per_s": 9.0}}}}}
    md = gpu_report._markdown(report)
    assert "| 256 | 20.00 | 12.00 | 0.60x |" in md
    assert "offline-gpu fp8: `" in md


def test_offline_gpu_measures_the_engines_alone_and_transformers_runs_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' passes are the step's result whatever transformers does: it is a step of
    its own at the end (today's run lost every engine figure to its comparison's timeout)."""
    named = {s.name: s for s in gpu_report.steps(tmp_path)}
    assert "--skip-hf" in named["offline-gpu"].argv
    hf = named["offline-gpu transformers"]
    assert {"--skip-engine", "--hf-continuous-only"} <= set(hf.argv)
    assert list(named).index("offline-gpu transformers") > list(named).index("offline-gpu fp8")
    monkeypatch.setenv("GPU_REPORT_HF", "0")
    assert "offline-gpu transformers" not in {s.name for s in gpu_report.steps(tmp_path)}


def test_a_step_past_its_budget_is_stopped_with_every_process_it_started(
        tmp_path: Path) -> None:
    """(pytest's xdist workers are the step's grandchildren: one left behind would hold the
    GPU through the next steps)"""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
              "time.sleep(60)")
    step = gpu_report.Step("sleeper", [sys.executable, "-c", script], 60)
    start = time.perf_counter()
    result = gpu_report._run(step, 2, tmp_path)
    assert result["status"] == "timed out after 2 s"
    assert time.perf_counter() - start < 15
    assert "started" in result["tail"]
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_a_step_that_exits_leaves_no_process_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid))")
    result = gpu_report._run(gpu_report.Step("leaver", [sys.executable, "-c", script], 30),
                             30, tmp_path)
    assert result["status"] == "ok" and result["seconds"] < 15
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_gpu_tests_are_counted_from_the_log_when_pytest_was_stopped(tmp_path: Path) -> None:
    log = tmp_path / "gpu_tests.log"
    log.write_text(
        "tests/kernels/test_a.py::test_x[1] \n"
        "[gw0] [  1%] PASSED tests/kernels/test_a.py::test_x[1] \n"
        "[gw1] [  2%] FAILED tests/workers/test_b.py::test_y[True] \n"
        "[gw2] [  3%] SKIPPED tests/workers/test_b.py::test_z \n"
        "[gw0] [  4%] PASSED tests/workers/test_b.py::test_w \n"
        "[gw0] [  4%] ERROR tests/workers/test_b.py::test_w \n"
        "FAILED tests/workers/test_b.py::test_y[True] - torch.OutOfMemoryError: x\n")
    summary = gpu_report._tests_summary(tmp_path / "absent.xml", log)
    assert summary == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1, "partial": True,
                       "failed": ["tests/workers/test_b.py::test_y[True]",
                                  "tests/workers/test_b.py::test_w"]}
    assert gpu_report._tests_summary(tmp_path / "absent.xml", tmp_path / "no.log") == {}


def test_report_names_the_steps_the_deadline_left_out_and_merges_transformers_rows() -> None:
    report = {"device": "H100", "date": "d", "commit": "c", "driver": "x", "torch": "t",
              "triton": "t", "transformers": "t",
              "steps": {"gpu tests": {"status": "timed out after 180 s", "seconds": 180},
                        "embed": {"status": "skipped: the run's deadline passed", "seconds": 0},
                        "prompt logprobs 8b": {"status": "skipped: the run's deadline passed",
                                               "seconds": 0}},
              "tests": {"tests": 3, "failures": 0, "errors": 0, "skipped": 0, "failed": [],
                        "partial": True},
              "results": {"offline-gpu": {"rows": {"engine tp=1, async on": {
                  "tok_per_s": 19524.0, "passes_tok_per_s": {"seeded": [9073.0, 19524.0]}}}},
                  "offline-gpu transformers": {"rows": {"hf continuous, exact lengths": {
                      "tok_per_s": 210.4}}}}}
    report["rerun"] = gpu_report._rerun_line(report["steps"])
    md = gpu_report._markdown(report)
    assert "`GPU_REPORT_ONLY='models,embed,prompt logprobs 8b' bash bench/gpu_run.sh`" in md
    assert "(from the log: pytest was stopped before its summary)" in md
    assert "| engine tp=1, async on | 19524 | seeded: 9073, 19524 |" in md
    assert "| hf continuous, exact lengths | 210 |  |" in md
    assert gpu_report._rerun_line({"embed": {"status": "ok", "seconds": 3}}) is None
