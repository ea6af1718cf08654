"""bench/worker_step.py --host-overhead, issue #43's host-time figure: it runs a worker's real
decode steps with the model stubbed out (its stub must keep up with the paths a step takes,
e.g. the all-greedy LM head over the vocabulary shards), and writes one row per batch size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_host_overhead_runs_every_batch(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "bench/worker_step.py", "--host-overhead",
                           "--batches", "1,4", "--steps", "3", "--threads", "1",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["host_us_per_step"] > 0 and r["launch_us"] > 0 and r["collect_us"] >= 0
        assert r["pending_tokens"] is True
