"""Load a benchmark script as another checkout has it, for interleaved A/B runs in one process.

This VM's speed drifts by up to 2x within minutes, so two trees compare only when their runs
alternate in one process. `load_bench(root, name)` imports `root/bench/<name>` with that
checkout's packages (scheduler, kvcache, cluster, workers, kernels); this tree's modules stay
loaded and in use by everything else. (Process-wide settings, such as the garbage collector's,
are shared by both trees.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

_PACKAGES = ("scheduler", "kvcache", "cluster", "workers", "kernels")


def load_bench(root: str, name: str) -> ModuleType:
    """The module `root/bench/<name>`, importing root's own packages."""
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] in _PACKAGES}
    for k in saved:
        del sys.modules[k]
    path = os.path.join(root, "bench", name)
    if not os.path.exists(path):
        raise SystemExit(f"--against {root}: there is no {path}")
    spec = importlib.util.spec_from_file_location(f"other_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, root)
    try:
        spec.loader.exec_module(module)
        for pkg in ("scheduler", "kvcache"):
            loaded = sys.modules.get(pkg)
            if loaded is not None and not loaded.__file__.startswith(os.path.abspath(root)):
                raise SystemExit(f"--against {root}: its {pkg} package did not load")
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if k.split(".")[0] in _PACKAGES]:
            del sys.modules[k]
        sys.modules.update(saved)
    return module
