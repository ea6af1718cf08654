"""Every GPU check and benchmark of the project in one command, written to one report.

    python bench/gpu_report.py --out gpu-report [--deadline-s 480] [--only NAME ...]
    python bench/gpu_report.py --list      # the steps and their argv as JSON (no CUDA needed)

`bench/gpu_run.sh` is the one command a session with a lent GPU runs: it installs what the GPU
box lacks and calls this. Each step runs as its own process group with its own time budget, in
priority order; a step never runs past the run's deadline (the rest are reported as skipped,
with the GPU_REPORT_ONLY line that reruns them), and a step past its budget is killed with
every process it started (pytest's xdist workers too: none may hold the GPU into the next
step). Each step keeps what it measured so far: the benchmarks rewrite their JSON after every
row or system, and the gpu tests' results are read from their log when pytest was stopped
before its XML. In-process engines only (the GPU box has no Ray). The steps, in order:
  models          write the random-weight Qwen3-0.6B checkpoint the benchmarks share;
  attention bounds  bench/attention_bounds.py: decode attention where the cache passes 2 GiB,
                  each case in its own process, against a float32 reference;
  gpu tests       every gpu-marked test file (greedy parity with transformers at Qwen3-0.6B's
                  shapes, graphs on and off; the decode loop under sync debug mode "error";
                  verify graphs; the copy stream; MoE; the Triton kernels), on six xdist workers
                  sharing the GPU (tests/conftest.py: what each test may take of it);
  offline-gpu     bench/throughput.py, the engine alone: async scheduling on and off, a seed per
                  request, the first pass after start-up and the second;
  decode anatomy  bench/worker_step.py --anatomy: wall and GPU-kernel ms per decode step at ctx
                  1024, the GPU-busy fraction, kernels per step;
  kernels         bench/kernels_bench.py: the copy bandwidth, prefill vs SDPA with and without a
                  prefix, the layer ops, the decode step, decode attention against copy bandwidth;
  offload copies  bench/offload_bench.py --only copies: the CPU tier's copy bandwidth and
                  whether the forward slows while the copy stream works;
  sampler         bench/sampler_bench.py --device cuda;
  host overhead   bench/worker_step.py --host-overhead;
  lora, fp8       bench/lora_bench.py / bench/fp8_bench.py --device cuda, when the tree has them;
  moe             bench/moe_bench.py --device cuda --fp8 at Qwen3-30B-A3B's expert shapes:
                  the bf16 experts and the same in Qwen's FP8 format (W8A8 fused kernels);
  decode bf16 / decode fp8   bench/worker_step.py at Qwen3-0.6B shapes (batch 1, 32, 256 at ctx
                  1024), the model's dtype, then FP8 weights (quantized at load) and FP8 KV;
  spec-decode graphs / eager   bench/spec_decode.py at Qwen3-0.6B shapes, with and without
                  CUDA graphs (the verify graphs' gain is the ratio of the two `tok_s_on`);
  offline-gpu fp8  offline-gpu's engine with FP8 weights and FP8 KV;
  embed           bench/embed_bench.py --device cuda (pooling runner vs sentence-transformers);
  offline-gpu transformers  transformers' continuous batching on offline-gpu's first 4 requests
                  (GPU_REPORT_HF=0 leaves it out): a reference, not a target, hence late;
  prompt logprobs 8b  bench/prompt_logprobs_bench.py --qwen3 8b --device cuda (bf16).
Writes `<out>/report.md` (tables), `<out>/report.json` (everything) and each step's log and
JSON beside them.

Budgets (H100, seconds: what the step took on 2026-11-27, docs/gpu/2026-11-27-h100/, and its
budget, about 1.1-1.25x that; `cum` adds the expected times):

    step                      took                          budget   cum
    models                      8 (+3 for the spec draft)      25     11
    gpu tests                 200 at 98% (see below)          180    ~160
    offline-gpu                93 (engines; H200 87)          105    253
    decode anatomy             21                              25    274
    kernels                  ~55 (30 s reached 3 of 4 decode-step rows)   65    329
    offload copies              6                              10    335
    sampler, host overhead    7, 7                          10, 10   349
    lora, fp8                8, 10                          12, 15   367
    moe                        26                              30    393
    decode bf16                10                              15    403
    decode fp8               >40 (empty log; see below)        45    ~448
    spec-decode graphs       ~30 (failed at 26)                35    ~478
    ---------------------------------------------------------------- 480: the deadline
    spec-decode eager        ~30 (failed at 30)                35
    attention bounds           31 (all four cases passed)      40
    offline-gpu fp8          ~55 (one engine, two passes)      70
    embed                    ~25 (never reached)               40
    offline-gpu transformers  ?  (16 requests: not done in ~37 s)  50
    prompt logprobs 8b       ? (load_format dummy: no 16 GB write; 20-40 guessed)  60

The gpu tests: 176 tests took 200 s to reach 98 %, but one worker spent up to its 100 s
pytest-timeout inside one engine test whose KV cache took 0.9 of the GPU (69 GiB), and 19 tests
failed fast of out-of-memory around it; with every test's share small, 150-180 s is expected.
The FP8 decode step left no output in 40 s: it printed only at the end; on a CPU its path runs
(quantizing 0.6B at load adds 2 s), so the time is the start-up's Triton compiles of the FP8
variants (attention over an FP8 cache, the KV write, the W8A8 GEMM), 2.7 s each where logged.
So the steps above the line fit 480 s when their times are today's; the six below it (~260 s)
run when the earlier steps finish under their budgets, else in a second call: the report
names them and the GPU_REPORT_ONLY line. A step that ends under its budget gives the rest
to the steps after it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    budget_s: int
    result: str | None = None  # the JSON file (under out) the step writes
    script: str | None = None  # a bench script the tree may not have yet: skipped without it
    env: dict[str, str] | None = None  # set for this step's process, over the run's


def random_06b_path() -> Path:
    from workers.tiny_model import cache_root

    return cache_root() / "qwen3-0.6b-random"


def steps(out: Path) -> list[Step]:
    """The steps, most wanted first (a run that reaches its deadline drops the last)."""
    py = sys.executable
    gpu_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                       if "mark.gpu" in p.read_text())
    m06 = str(random_06b_path())
    # pytest-timeout (on the GPU box's image): one stuck test must not take the step's budget
    timeout = ["--timeout", "100"] if importlib.util.find_spec("pytest_timeout") else []
    # pytest-xdist (also there): Triton compiles on 6 host cores at once; tests share the GPU,
    # each test a small part of it (tests/conftest.py). Torch's CPU threads split the host's
    # cores among the workers instead of each taking all of them.
    n_workers = 6
    workers = ["-n", str(n_workers)] if importlib.util.find_spec("xdist") else []
    test_env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or n_workers) // n_workers))}
    spec = [py, "bench/spec_decode.py", "--device", "cuda", "--model", m06, "--rows",
            "1.0:1,0.7:32,draft:1", "--tokens", "128", "--batch-tokens", "32", "--repeats", "1"]
    offline = [py, "bench/throughput.py", "--workload", "offline-gpu", "--runs", "1"]
    # transformers' continuous batching on 4 requests (their longest output 759 tokens; 16 did
    # not finish in the ~37 s the engines left them): GPU_REPORT_HF=0 leaves it out
    hf = ([Step("offline-gpu transformers", [*offline, "--skip-engine", "--hf-continuous-only",
                                             "--hf-subset", "4", "--json",
                                             str(out / "offline_gpu_hf.json")], 50,
                "offline_gpu_hf.json")]
          if os.environ.get("GPU_REPORT_HF", "1") != "0" else [])
    return [
        Step("models", [py, "-c", "import sys; sys.path[:0] = ['bench', '.']; "
                        "from throughput import model_path; from spec_decode import draft_model; "
                        "draft_model(model_path('qwen3-0.6b-random')); "
                        "from workers.tiny_model import resolve_model; "
                        "[resolve_model(m) for m in ('qwen3-tiny', 'qwen3-tiny-draft')]"], 25),
        Step("gpu tests", [py, "-m", "pytest", "-m", "gpu", "-v", "-rfE", "--tb=short",
                           "--durations=15", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", *gpu_files, *timeout, *workers,
                           f"--junitxml={out / 'gpu_tests.xml'}"], 180, env=test_env),
        Step("offline-gpu", [*offline, "--compare-async", "--seeds", "on", "--passes", "2",
                             "--skip-hf", "--json", str(out / "offline_gpu.json")], 105,
             "offline_gpu.json"),
        Step("decode anatomy", [py, "bench/worker_step.py", "--device", "cuda", "--anatomy",
                                "--model", "qwen3-0.6b-random", "--batches", "1,32,128,256",
                                "--context", "1024", "--json", str(out / "anatomy.json")],
             25, "anatomy.json"),
        Step("kernels", [py, "bench/kernels_bench.py", "--json", str(out / "kernels.json")], 65,
             "kernels.json"),
        Step("offload copies", [py, "bench/offload_bench.py", "--only", "copies", "--device",
                                "cuda", "--json", str(out / "offload.json")], 10, "offload.json"),
        Step("sampler", [py, "bench/sampler_bench.py", "--device", "cuda", "--reps", "5",
                         "--json", str(out / "sampler.json")], 10, "sampler.json"),
        Step("host overhead", [py, "bench/worker_step.py", "--device", "cuda", "--host-overhead",
                               "--batches", "1,32,256", "--json",
                               str(out / "host_overhead.json")], 10, "host_overhead.json"),
        Step("lora", [py, "bench/lora_bench.py", "--device", "cuda", "--json",
                      str(out / "lora.json")], 12, "lora.json", "bench/lora_bench.py"),
        Step("fp8", [py, "bench/fp8_bench.py", "--device", "cuda", "--json",
                     str(out / "fp8.json")], 15, "fp8.json", "bench/fp8_bench.py"),
        Step("moe", [py, "bench/moe_bench.py", "--device", "cuda", "--fp8", "--tokens", "1",
                     "32", "512", "4096", "--json", str(out / "moe.json")], 30, "moe.json"),
        # FP8 weights + FP8 KV against the model's dtype on the same device (issue 39's targets:
        # decode step at batch 256, ctx 1024 <= 0.65x; offline-gpu's tok/s against its row above)
        *[Step(f"decode {name}", [py, "bench/worker_step.py", "--device", "cuda", "--model",
                                  m06, "--batches", "1,32,256", "--context", "1024", *fp8,
                                  "--json", str(out / f"decode_{name}.json")], budget,
               f"decode_{name}.json")
          for name, fp8, budget in (("bf16", [], 15),
                                    ("fp8", ["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
                                     45))],
        Step("spec-decode graphs", [*spec, "--json", str(out / "spec_graphs.json")], 35,
             "spec_graphs.json"),
        # ---- 480 s: what follows runs on what the steps above left (see the docstring) ----
        Step("spec-decode eager", [*spec, "--enforce-eager", "--json",
                                   str(out / "spec_eager.json")], 35, "spec_eager.json"),
        # (the 2026-11-26 fault at batch 32, ctx 32k: gone on 2026-11-27, so a late check)
        Step("attention bounds", [py, "bench/attention_bounds.py", "--json",
                                  str(out / "attention_bounds.json")], 40,
             "attention_bounds.json"),
        Step("offline-gpu fp8", [*offline, "--passes", "2", "--skip-hf", "--quantization",
                                 "fp8", "--kv-cache-dtype", "fp8", "--json",
                                 str(out / "offline_gpu_fp8.json")], 70, "offline_gpu_fp8.json"),
        # (the embedding toy: the engine's pooling runner against sentence-transformers)
        Step("embed", [py, "bench/embed_bench.py", "--device", "cuda", "--repeats", "3",
                       "--json", str(out / "embed.json")], 40, "embed.json"),
        *hf,
        # a loglikelihood request against a prefill where the LM head is ~8% of the weights
        # (issue 38's <= 1.2x; config.json alone, load_format "dummy": no 16 GB checkpoint)
        Step("prompt logprobs 8b", [py, "bench/prompt_logprobs_bench.py", "--qwen3", "8b",
                                    "--device", "cuda", "--lengths", "512,2048", "--repeats",
                                    "3", "--batch-tokens", "2048", "--json",
                                    str(out / "prompt_logprobs_8b.json")], 60,
             "prompt_logprobs_8b.json"),
    ]


def _run(step: Step, budget: float, out: Path) -> dict:
    """Run the step in a process group of its own; past its budget the whole group is
    stopped (SIGTERM, then SIGKILL): pytest's xdist workers are its grandchildren, and one
    left running would hold the GPU through the next steps' timings."""
    log = out / _log_name(step)
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTEST_FAILURE_LOG=str(out / "gpu_test_failures.log"),
               **(step.env or {}))
    with log.open("w") as f:
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {budget:.0f} s"
        _stop_group(proc)
    return {"status": status, "seconds": round(time.perf_counter() - start, 1),
            "log": log.name, "tail": log.read_text(errors="replace")[-2000:]}


def _log_name(step: Step) -> str:
    return step.name.replace(" ", "_") + ".log"


def _stop_group(proc: subprocess.Popen, grace_s: float = 5) -> None:
    """End what is left of `proc`'s process group (the step's own process, or what it left
    behind when it exited): SIGTERM, and SIGKILL to whatever outlives `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # none is left
        if _group_gone(proc, grace_s):
            break
    proc.wait()


def _group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        proc.poll()  # (reaps the leader: until then it counts as the group's, a zombie)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


_RESULT = re.compile(r"^(?:\[gw\d+\] \[ *\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) "
                     r"(\S+::\S+)|^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def _tests_summary(xml_path: Path, log_path: Path | None = None) -> dict:
    """The gpu tests' counts and failures: from pytest's JUnit XML, or, where pytest was
    stopped before writing it (its budget), from the `-v` log's lines so far (`partial`)."""
    if not xml_path.exists():
        return _tests_from_log(log_path) if log_path and log_path.exists() else {}
    suite = ET.parse(xml_path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed}


def _tests_from_log(log_path: Path) -> dict:
    outcome: dict[str, str] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if m := _RESULT.match(line.strip()):
            word, nodeid = (m[1], m[2]) if m[1] else (m[4], m[3])
            # (a test's last word wins: an error at teardown after a pass)
            outcome[nodeid] = "FAILED" if outcome.get(nodeid) == "FAILED" else word
    words = list(outcome.values())
    return {"tests": len(words), "failures": words.count("FAILED"),
            "errors": words.count("ERROR"), "skipped": words.count("SKIPPED"),
            "failed": [n for n, w in outcome.items() if w in ("FAILED", "ERROR")],
            "partial": True}


def _rerun_line(step_status: dict[str, dict]) -> str | None:
    """The command that runs the steps the deadline left out, in a call of their own."""
    skipped = [n for n, s in step_status.items() if s["status"].startswith("skipped")]
    if not skipped:
        return None
    # (on a fresh machine the benchmarks need the models step's checkpoints; it is quick)
    return f"GPU_REPORT_ONLY='{','.join(['models', *skipped])}' bash bench/gpu_run.sh"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _markdown(report: dict) -> str:
    res = report["results"]
    lines = [f"# GPU report: {report['device']}, {report['date']}, commit {report['commit']}",
             "", f"driver {report['driver']}; torch {report['torch']}, triton "
             f"{report['triton']}, transformers {report['transformers']}"]
    lines += _table(["step", "status", "seconds"],
                    [[n, s["status"], s["seconds"]] for n, s in report["steps"].items()])
    if report.get("rerun"):
        lines += ["", f"The deadline left steps out; they run in a call of their own: "
                      f"`{report['rerun']}`"]
    tests = report.get("tests")
    if tests:
        lines += ["", f"gpu tests: {tests['tests']} run, {tests['failures']} failed, "
                      f"{tests['errors']} errors, {tests['skipped']} skipped"
                      + (" (from the log: pytest was stopped before its summary)"
                         if tests.get("partial") else "")]
        lines += [f"- FAILED {t}" for t in tests["failed"]]
    offline = {**res.get("offline-gpu", {}).get("rows", {}),
               **res.get("offline-gpu transformers", {}).get("rows", {})}
    if offline:
        lines += _table(["offline-gpu system", "tok/s (last pass)", "every pass"], [
            [name, r.get("error") or f"{r['tok_per_s']:.0f}",
             "; ".join(f"{k}: " + ", ".join(f"{x:.0f}" for x in v)
                       for k, v in r.get("passes_tok_per_s", {}).items())]
            for name, r in offline.items()])
    if an := res.get("decode anatomy"):
        lines += _table(["batch", "wall ms/step", "GPU kernels ms", "GPU busy", "kernels/step"], [
            [r["batch"], f"{r['wall_ms']:.2f}", f"{r['kernel_ms']:.2f}",
             f"{100 * r['gpu_busy']:.0f}%", f"{r['kernels_per_step']:.0f}"] for r in an["rows"]])
    if k := res.get("kernels"):
        lines += ["", f"copy bandwidth {k['copy_bandwidth_GBps']:.0f} GB/s"]
        lines += _table(["decode attn batch", "ctx", "us", "frac copy bw"], [
            [r["batch"], r["ctx"], f"{1e3 * r['ms']:.1f}", f"{r['frac_copy_bw']:.2f}"]
            for r in k.get("decode", [])])
        lines += _table(["split-K at batch 32, ctx 1024", "us", "frac copy bw"], [
            [r["num_segments"], f"{1e3 * r['ms']:.1f}", f"{r['frac_copy_bw']:.2f}"]
            for r in k.get("decode_split_sweep", [])])
        lines += _table(["prefill prefix", "chunk", "triton ms", "sdpa ms", "x sdpa"], [
            [r["prefix"], r["chunk"], f"{r['ms_triton']:.3f}", f"{r['ms_sdpa']:.3f}",
             f"{r['speed_vs_sdpa']:.2f}"] for r in k.get("prefill", [])])
        lines += _table(["decode step batch", "graph ms", "kernel ms", "kernels/step"], [
            [r["batch"], f"{r['graph_ms']:.3f}", f"{r['kernel_ms']:.3f}",
             f"{r['kernels_per_step']:.0f}"] for r in k.get("decode_step", [])])
    spec_rows = [(mode, r) for mode in ("graphs", "eager")
                 for r in res.get(f"spec-decode {mode}", {}).get("rows", [])]
    if spec_rows:
        lines += _table(["spec-decode", "acceptance", "batch", "tok/s off", "tok/s on",
                         "speedup", "accept len"], [
            [m, r["acceptance"], r["batch"], r["tok_s_off"], r["tok_s_on"], r["speedup"],
             r["acceptance_length"]] for m, r in spec_rows])
    if moe := res.get("moe"):
        lines += _table(["moe tokens", "fused ms", "loop ms", "dense ms", "fused GB/s",
                         "fp8 ms", "fp8 speedup", "fp8 vs twin"], [
            [r["tokens"], r["fused_ms"], r["loop_ms"], r["dense_ms"], r["fused_GBps"],
             r.get("fp8_ms", "-"), r.get("fp8_speedup", "-"),
             r.get("fp8_max_abs_diff_vs_twin", "-")] for r in moe["rows"]])
    if cp := res.get("offload copies", {}).get("copies"):
        lines += ["", "offload copies: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in cp.items())]
    if host := res.get("host overhead"):
        lines += _table(["batch", "host us/step"],
                        [[r["batch"], f"{r['host_us_per_step']:.0f}"] for r in host["rows"]])
    if bounds := res.get("attention bounds"):
        lines += _table(["attention bounds case", "result"], [
            [r["case"], r.get("error") or f"max rel err {r['max_rel_err']:.2e}"]
            for r in bounds["rows"]])
    if sampler := res.get("sampler"):
        lines += _table(["sampler rows", "mode", "ms", "vs unseeded"], [
            [r["rows"], r["mode"], f"{r['ms']:.3f}", f"{r['vs_unseeded']:.2f}x"]
            for r in sampler["results"]])
    if (bf16 := res.get("decode bf16")) and (fp8 := res.get("decode fp8")):
        fp8_ms = {r["batch"]: r["decode_step_ms"] for r in fp8["rows"]}
        lines += _table(["batch (ctx 1024)", "bf16 ms/step", "fp8 w+kv ms/step", "fp8 / bf16"], [
            [r["batch"], f"{r['decode_step_ms']:.2f}", f"{fp8_ms[r['batch']]:.2f}",
             f"{fp8_ms[r['batch']] / r['decode_step_ms']:.2f}x"] for r in bf16["rows"]])
    if embed := res.get("embed"):
        lines += _table(["embed batch", "system", "inputs/s", "tokens/s"], [
            [r["batch"], r["system"], f"{r['inputs_per_s']:.1f}", f"{r['tokens_per_s']:.0f}"]
            for r in embed["rows"]])
    if plp := res.get("prompt logprobs 8b"):
        lines += _table(["prompt tokens (8B)", "prefill ms", "loglikelihood ms", "ratio"], [
            [r["prompt_tokens"], f"{r['prefill_ms']:.1f}", f"{r['loglikelihood_ms']:.1f}",
             f"{r['ratio']:.2f}"] for r in plp["rows"]])
    for name in ("lora", "fp8", "offline-gpu fp8"):
        if name in res:
            lines += ["", f"{name}: `{json.dumps(res[name])[:1500]}`"]
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    import torch

    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = "absent"
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = "unknown"
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
        commit = git.stdout.strip() if git.returncode == 0 else "unknown"
    return info | {"commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-report"))
    ap.add_argument("--only", nargs="*", help="run only these steps (by name)")
    ap.add_argument("--deadline-s", type=float, default=480,
                    help="no step runs past this many seconds from the start")
    ap.add_argument("--list", action="store_true", help="print the steps as JSON and exit")
    args = ap.parse_args()
    if args.list:
        print(json.dumps([s.__dict__ for s in steps(args.out)], indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu_report: torch sees no CUDA device, so there is nothing to measure here; "
              "run it on a machine with an NVIDIA GPU", file=sys.stderr)
        sys.exit(2)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = _versions() | {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  "steps": {}, "results": {}}
    for step in steps(args.out):
        if args.only and step.name not in args.only:
            continue
        left = args.deadline_s - (time.perf_counter() - t0)
        if step.script and not (ROOT / step.script).exists():
            report["steps"][step.name] = {"status": f"absent ({step.script} not in this tree)",
                                          "seconds": 0}
            continue
        if left < 5:
            report["steps"][step.name] = {"status": "skipped: the run's deadline passed",
                                          "seconds": 0}
            continue
        print(f"gpu_report: {step.name} (budget {min(step.budget_s, left):.0f} s) ...",
              flush=True)
        report["steps"][step.name] = _run(step, min(step.budget_s, left), args.out)
        print(f"gpu_report: {step.name}: {report['steps'][step.name]['status']} in "
              f"{report['steps'][step.name]['seconds']} s", flush=True)
        if step.result and (args.out / step.result).exists():
            try:
                report["results"][step.name] = json.loads((args.out / step.result).read_text())
            except json.JSONDecodeError:  # (stopped while writing it)
                report["steps"][step.name]["status"] += f"; {step.result} unreadable"
        (args.out / "report.json").write_text(json.dumps(report, indent=2))
    report["tests"] = _tests_summary(args.out / "gpu_tests.xml",
                                     args.out / _log_name(Step("gpu tests", [], 0)))
    report["rerun"] = _rerun_line(report["steps"])
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
