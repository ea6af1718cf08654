"""Without a GPU, the Triton kernels still compile for real hardware (sm_90 cubin via ptxas),
and every configuration fits an H100's shared memory: compiling does not check that, a launch
does (Triton's OutOfResources). fp32's tiles are the largest (the long-chunk attention tile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sm90_compile_moe import H100_SHARED_BYTES

REPO = Path(__file__).resolve().parents[2]

# sm90_compile.py's jobs, compiled by its pool; then one line per job: its shared memory in
# bytes and what it is
_COMPILE = """
import sm90_compile
jobs = sm90_compile.jobs()
for (fn, ptrs, constexprs, _, _, options), shared in zip(jobs, sm90_compile.compile_all(jobs)):
    print(shared, fn.__name__, sorted(set(ptrs.values())), constexprs, options)
"""


@pytest.mark.slow
def test_every_kernel_configuration_compiles_for_h100(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a warm cache
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent)])
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary, *jobs = result.stdout.strip().splitlines()
    assert summary.endswith("configurations compiled for sm_90")
    over = [line for line in jobs if int(line.split()[0]) > H100_SHARED_BYTES]
    assert not over, f"over an H100's {H100_SHARED_BYTES} B of shared memory:\n" + "\n".join(over)
