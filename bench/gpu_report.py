"""Every GPU check and benchmark of the project in one command, written to one report.

    python bench/gpu_report.py --out gpu-report        # needs CUDA; exits 2 without it

Runs, each as its own process with its own time budget (the whole fits in 10 minutes on one
H100), in-process engines only (the GPU box has no Ray):
  1. the gpu-marked tests of tests/kernels, tests/workers and tests/cluster/engine/test_llm.py
     (the greedy parity at Qwen3-0.6B's shapes with graphs on and off, and the decode loop
     under torch.cuda.set_sync_debug_mode("error"), among them);
  2. bench/kernels_bench.py (prefill vs SDPA with and without a prefix, decode attention, the
     fused layer ops, kernels per decoder layer);
  3. bench/worker_step.py --anatomy: decode steps of Qwen3-0.6B (random weights, bf16) at
     ctx 1024, batch 1/32/128/256, launched ahead as the engine does, under torch.profiler:
     wall and GPU-kernel ms per step, the GPU-busy fraction, kernels per step;
  4. bench/worker_step.py --host-overhead (the worker's host time per decode step);
  5. bench/sampler_bench.py --device cuda: one step's sampling at 1/32/256 rows, the Triton
     draw against its torch twin, and the masks (top-p alone sorts the vocabulary; top-k +
     top-p orders only the top k values);
  6. bench/throughput.py --workload offline-gpu: async scheduling on and off, with and
     without a seed per request, the first run after start-up and the second, against
     transformers' continuous batching on a slice of the workload.
Writes `<out>/report.md` (tables) and `<out>/report.json` (everything), plus each step's
own JSON and log beside them. A step that fails or runs out of time is reported as such and
the report goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _steps(out: Path) -> list[tuple[str, list[str], int, Path | None]]:
    """(name, argv, time budget in s, JSON it writes)."""
    py = sys.executable
    return [
        ("gpu tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                       "tests/kernels", "tests/workers", "tests/cluster/engine/test_llm.py",
                       f"--junitxml={out / 'gpu_tests.xml'}"], 180, None),
        ("kernels", [py, "bench/kernels_bench.py", "--json", str(out / "kernels.json")], 80,
         out / "kernels.json"),
        ("decode anatomy", [py, "bench/worker_step.py", "--device", "cuda", "--anatomy",
                            "--model", "qwen3-0.6b-random", "--batches", "1,32,128,256",
                            "--context", "1024", "--json", str(out / "anatomy.json")], 80,
         out / "anatomy.json"),
        ("host overhead", [py, "bench/worker_step.py", "--device", "cuda", "--host-overhead",
                           "--batches", "1,32,256", "--json", str(out / "host_overhead.json")],
         30, out / "host_overhead.json"),
        ("sampler", [py, "bench/sampler_bench.py", "--device", "cuda", "--reps", "7",
                     "--json", str(out / "sampler.json")], 30, out / "sampler.json"),
        ("offline-gpu", [py, "bench/throughput.py", "--workload", "offline-gpu", "--runs", "1",
                         "--compare-async", "--seeds", "both", "--passes", "2",
                         "--hf-continuous-only", "--hf-subset", "32",
                         "--json", str(out / "offline_gpu.json")], 200,
         out / "offline_gpu.json"),
    ]


def _run(name: str, argv: list[str], budget: int, out: Path) -> dict:
    log = out / (name.replace(" ", "_") + ".log")
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with log.open("w") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=budget)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {budget} s"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1),
            "log": str(log), "tail": log.read_text()[-2000:]}


def _tests_summary(xml_path: Path) -> dict:
    if not xml_path.exists():
        return {}
    suite = ET.parse(xml_path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed}


def _markdown(report: dict) -> str:
    lines = [f"# GPU report ({report['device']}, {report['date']})", ""]
    lines += ["| step | status | seconds |", "|---|---|---|"]
    for name, step in report["steps"].items():
        lines.append(f"| {name} | {step['status']} | {step['seconds']} |")
    tests = report.get("tests")
    if tests:
        lines += ["", f"gpu tests: {tests['tests']} run, {tests['failures']} failed, "
                      f"{tests['errors']} errors, {tests['skipped']} skipped"]
        lines += [f"- FAILED {t}" for t in tests["failed"]]
    anatomy = report["results"].get("decode anatomy")
    if anatomy:
        lines += ["", "| batch | wall ms/step | GPU kernels ms | GPU busy | kernels/step |",
                  "|---|---|---|---|---|"]
        for r in anatomy["rows"]:
            lines.append(f"| {r['batch']} | {r['wall_ms']:.2f} | {r['kernel_ms']:.2f} | "
                         f"{100 * r['gpu_busy']:.0f}% | {r['kernels_per_step']:.0f} |")
    host = report["results"].get("host overhead")
    if host:
        lines += ["", "| batch | host us/step |", "|---|---|"]
        lines += [f"| {r['batch']} | {r['host_us_per_step']:.0f} |" for r in host["rows"]]
    sampler = report["results"].get("sampler")
    if sampler:
        lines += ["", "| sampler rows | mode | ms | vs unseeded |", "|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['mode']} | {r['ms']:.3f} | {r['vs_unseeded']:.2f}x |"
                  for r in sampler["results"]]
    offline = report["results"].get("offline-gpu")
    if offline:
        lines += ["", "| offline-gpu system | tok/s |", "|---|---|"]
        for name, r in offline["rows"].items():
            value = r.get("error") or (f"{r['tok_per_s']:.0f}" + "".join(
                f"; {kind}: " + ", ".join(f"{x:.0f}" for x in runs)
                for kind, runs in r.get("passes_tok_per_s", {}).items()))
            lines.append(f"| {name} | {value} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-report"))
    ap.add_argument("--only", nargs="*", help="run only these steps (by name)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_report: torch sees no CUDA device, so there is nothing to measure here; "
              "run it on a machine with an NVIDIA GPU", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(0),
                    "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                    "steps": {}, "results": {}}
    for name, argv, budget, result_json in _steps(args.out):
        if args.only and name not in args.only:
            continue
        print(f"gpu_report: {name} ...", flush=True)
        report["steps"][name] = _run(name, argv, budget, args.out)
        if result_json is not None and result_json.exists():
            report["results"][name] = json.loads(result_json.read_text())
    report["tests"] = _tests_summary(args.out / "gpu_tests.xml")
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
