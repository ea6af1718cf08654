"""Idle Ray workers, parked or spinning: CPU burnt while idle, and what parking costs a step.

Starts the tiny model with tp 2 on Ray (a compiled graph), then
  - idle CPU: each worker's CPU seconds over `--idle` seconds with no request, with the
    engine parking its workers (cluster/engine/wakeup.py) and with parking turned off;
  - resume cost: the wall time of a one-token request right after the workers were parked
    (woken by that request's first submit) against the same request while they were not
    parked, `--trials` times each, interleaved; medians;
  - wake latency: what parking adds to the first step after it, alone: a process blocked in
    `WakeReader.wait()` (as a parked rank is) is woken by `WakeSockets.wake()` and wakes the
    sender back the same way; half the round trip, median of `--trials` × 20.

    .venv/bin/python bench/idle_park.py --json idle.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wake_latency_us(n: int) -> float:
    """Half the round trip of a wake-up between two processes that block as parked ranks do."""
    from cluster.engine.wakeup import WakeReader, WakeSockets

    to_child, to_parent = WakeSockets(1), WakeSockets(1)
    pid = os.fork()
    if pid == 0:  # the parked rank: wait, then wake the engine back
        reader = WakeReader(to_child.paths[0])
        for _ in range(n + 1):
            reader.wait()
            to_parent.wake()
        os._exit(0)
    reader = WakeReader(to_parent.paths[0])
    while not os.path.exists(to_child.paths[0]):
        time.sleep(0.001)
    times = []
    for i in range(n + 1):
        time.sleep(0.002)  # the rank is blocked again, as after a park
        t = time.perf_counter()
        to_child.wake()
        reader.wait()
        if i:  # the first includes the child's start
            times.append((time.perf_counter() - t) / 2 * 1e6)
    os.waitpid(pid, 0)
    reader.close()
    to_child.close()
    to_parent.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=float, default=10.0, help="seconds idle per measurement")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import ray

    from cluster import LLM, SamplingParams

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    llm = LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5)
    executor = llm.engine.executor
    pids = ray.get([w.pid.remote() for w in executor.workers])
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt, one, use_tqdm=False)
    park = executor.park

    def idle_cpu(parking: bool) -> list[float]:
        executor.park = park if parking else (lambda: None)
        llm.generate(prompt, one, use_tqdm=False)  # ends with engine.park()
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(args.idle)
        return [round(_cpu_seconds(p) - b, 3) for p, b in zip(pids, before)]

    def request_ms(parked: bool) -> float:
        executor.park = park if parked else (lambda: None)
        llm.generate(prompt, one, use_tqdm=False)
        time.sleep(0.05)
        t = time.perf_counter()
        llm.generate(prompt, one, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    rows = {"idle_cpu_s_parked": idle_cpu(True), "idle_cpu_s_spinning": idle_cpu(False),
            "wake_latency_us": round(wake_latency_us(args.trials * 20), 1)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.trials):
        for parked in (True, False):
            times[parked].append(request_ms(parked))
    rows["request_ms_after_park"] = round(statistics.median(times[True]), 3)
    rows["request_ms_not_parked"] = round(statistics.median(times[False]), 3)
    rows["idle_s"] = args.idle
    executor.park = park
    print(json.dumps(rows, indent=2))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    llm.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
