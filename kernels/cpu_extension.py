"""The C++ CPU ops (`kernels/csrc/`: paged attention, token sampling): their build and loading.

`scripts/bootstrap.sh` runs this file (`python kernels/cpu_extension.py`), which compiles the
sources with the host's compiler into one library in `build/cpu_ops/` under the repository
(git-ignored), named by a digest of the sources, the torch version and the flags, so a changed
source or another torch is never loaded stale. A build that cannot happen (no compiler, no
headers) prints one line and leaves the CPU path on its torch fallbacks; nothing else fails.

`paged_attention_rows()` and `sample_rows()` are the loaded ops (`torch.ops.qwen3_cpu.*`) or None
when the library is not built; the first process to find it missing says so once, on stderr.
Loading never compiles: a Ray rank or a Serve replica must not start a compiler on the hot path.

Invariants:
- The library is compiled for the machine that builds it (`-march=native`): its vector loops
  use the instructions that machine has, and its name carries a digest of that CPU's feature
  flags too, so a host with other features sharing the build directory never loads it (it
  builds its own).
- OpenMP: the library links the `libgomp` torch ships and loads, so `at::parallel_for` runs on
  torch's own intra-op threads (`torch.set_num_threads` applies).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "sample_cpu.cpp")
HEADERS = (CSRC / "cpu_vec.h",)
BUILD_DIR = Path(os.environ.get("QWEN3_SERVE_CPU_OPS_DIR",
                                Path(__file__).resolve().parents[1] / "build" / "cpu_ops"))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp")

_loaded: dict[str, object] = {}


def library_path() -> Path:
    """Where these sources', torch version's and flag set's library is (built or not)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(importlib.metadata.version("torch").encode())
    digest.update(" ".join(FLAGS).encode())
    digest.update(_cpu_flags().encode())  # (-march=native: another CPU, another library)
    return BUILD_DIR / f"qwen3_cpu_ops-{digest.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """This machine's CPU features as the kernel lists them ('' where there is no
    /proc/cpuinfo): what `-march=native` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(quiet: bool = False) -> Path:
    """Compile the library if it is not there yet; returns its path. Raises RuntimeError with
    the compiler's message when it cannot be built."""
    target = library_path()
    if target.exists():
        return target
    import torch
    from torch.utils import cpp_extension  # torch's include and library directories
    compiler = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *map(str, SOURCES), "-o"]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    full = [*cmd, str(partial), *includes, *libs, *rpath, "-lc10", "-ltorch_cpu"]
    if not quiet:
        print(f"building {target.name} (C++ paged attention and sampling for CPU) ...",
              file=sys.stderr)
    try:
        done = subprocess.run(full, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(f"no C++ compiler ({compiler}): {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed:\n{done.stderr[-4000:]}")
    partial.replace(target)  # atomic: a concurrent loader sees the whole library or none
    for stale in BUILD_DIR.glob("qwen3_cpu_ops-*.so"):  # an older source's or torch's
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _op(name: str) -> Callable | None:
    """`torch.ops.qwen3_cpu.<name>`, looked up once per process (the library loaded with the
    first); None (and one line on stderr, once) when the library is not built."""
    if name not in _loaded:
        if "library" not in _loaded:
            target = library_path()
            if target.exists():
                import torch
                torch.ops.load_library(str(target))
            else:
                print(f"kernels: the C++ CPU ops are not built ({target} missing; "
                      "scripts/bootstrap.sh builds them): decode attention runs on torch's "
                      "SDPA and sampling on its torch twin", file=sys.stderr)
            _loaded["library"] = target.exists()
        if _loaded["library"]:
            import torch
            _loaded[name] = getattr(torch.ops.qwen3_cpu, name)
        else:
            _loaded[name] = None
    return _loaded[name]


def paged_attention_rows() -> Callable | None:
    """The paged attention op (kernels/cpu_attention.py), or None when not built."""
    return _op("paged_attention_rows")


def sample_rows() -> Callable | None:
    """The sampling op (kernels/ops.py's sample_tokens on CPU), or None when not built."""
    return _op("sample_rows")


if __name__ == "__main__":  # scripts/bootstrap.sh
    try:
        build()
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        print(f"warning: the C++ CPU ops were not built ({first}); the CPU path runs decode "
              "attention on torch's SDPA and sampling on its torch twin instead",
              file=sys.stderr)
