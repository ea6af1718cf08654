"""Do this machine's CPUs compute independently? A GEMM loop timed on CPU 0 alone, then with a
busy loop on CPU 1 (pure Python, then a GEMM), the host's steal time beside each.

On a machine whose CPUs are separate cores the loop on CPU 0 takes the same time either way. On
a VM whose two vCPUs are SMT siblings of one host core (what the guest's topology does not say:
lscpu reports one thread per core), anything on CPU 1 slows CPU 0: the second vCPU is not a
free core, and a model thread shares its core's execution units with whatever runs beside it.
Steal time rising instead would mean a CPU quota on the host, not shared units.

    python bench/cpu_siblings.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

BUSY = {
    "python busy loop": "import time\nt = time.time()\nwhile time.time() - t < {s}: pass",
    "gemm loop": ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\n"
                  "t = time.time()\nwhile time.time() - t < {s}: a @ a"),
}


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def gemm_loop_ms() -> float:
    """2,000 products of [256, 128] x [128, 768] fp32 on one thread (a qwen3-tiny MLP's shape)."""
    a, w = torch.randn(256, 128), torch.randn(128, 768)
    t = time.perf_counter()
    for _ in range(2000):
        torch.mm(a, w)
    return (time.perf_counter() - t) * 1e3


def timed(reps: int) -> tuple[float, int]:
    gemm_loop_ms()
    before = steal_ticks()
    best = min(gemm_loop_ms() for _ in range(reps))
    return best, steal_ticks() - before


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        print("needs CPUs 0 and 1", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    rows = []
    alone, steal = timed(args.reps)
    rows.append({"beside": "nothing", "ms": alone, "steal_ticks": steal})
    for name, code in BUSY.items():
        busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                                 code.format(s=60)])
        try:
            time.sleep(1.0)
            ms, steal = timed(args.reps)
        finally:
            busy.kill()
            busy.wait()
        rows.append({"beside": name, "ms": ms, "steal_ticks": steal})
    alone_again, steal = timed(args.reps)
    rows.append({"beside": "nothing (again)", "ms": alone_again, "steal_ticks": steal})
    print(f"{'on CPU 1':<18} {'GEMM loop on CPU 0 (ms)':>24} {'x alone':>8} {'steal ticks':>12}")
    for r in rows:
        print(f"{r['beside']:<18} {r['ms']:>24.1f} {r['ms'] / alone:>8.2f} {r['steal_ticks']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cpu": torch.backends.cpu.get_cpu_capability()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
