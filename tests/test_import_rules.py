"""The import rules of ../shared/ARCHITECTURE.md, checked on the source: every `import` and
`from ... import` in every module (at the top or inside a function alike), read from its AST.

A package may import the standard library, its own modules and what its rule lists (a module
or anything under it); the serving layer's two halves have a rule the other way round: the
engine may import anything except the API and the HTTP stack it is built on.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Rule:
    allowed: tuple[str, ...] | None  # None: anything not forbidden
    forbidden: tuple[str, ...] = ()


RULES: dict[str, Rule] = {
    "kvcache": Rule(allowed=("kvcache", "xxhash", "numpy")),
    "scheduler": Rule(allowed=("scheduler", "kvcache", "numpy")),
    "kernels": Rule(allowed=("kernels", "torch", "triton", "flash_attn")),
    # The scheduler's data types only (the plan a worker executes, the sampling parameters
    # it samples by), never its logic; nothing of the KV cache manager or the engine.
    "workers": Rule(allowed=("workers", "kernels", "torch", "numpy", "safetensors",
                             "scheduler.plan", "scheduler.sampling_params")),
    "cluster.engine": Rule(allowed=None, forbidden=("cluster.api", "fastapi", "starlette",
                                                    "ray.serve")),
    # The request router hashes prompts as the KV cache does and reads the block pools' event
    # format: kvcache.hashing and kvcache.events only, never the pools or the manager.
    "cluster.api": Rule(allowed=None, forbidden=("kvcache.block_pool", "kvcache.manager",
                                                 "kvcache.prefix", "kvcache.swap",
                                                 "kvcache.tables", "kvcache.invariants")),
    # Batch jobs are built on the engine, never on the HTTP front: of cluster/api they read a
    # request as the API does (its request models and prompt checks), nothing that serves HTTP.
    "cluster.batch": Rule(allowed=None, forbidden=("cluster.api.openai_api",
                                                   "cluster.api.openai_responses",
                                                   "cluster.api.openai_errors",
                                                   "cluster.api.responses_api",
                                                   "cluster.api.serve_app", "fastapi",
                                                   "starlette", "ray.serve")),
    "cluster": Rule(allowed=None),  # cluster/__init__.py: the lazy facade
}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def package_of(path: Path, root: Path) -> str:
    """The rule a module falls under: its top-level package, or cluster's subpackage."""
    parts = path.relative_to(root).parts
    if parts[0] == "cluster" and len(parts) > 2:
        return f"cluster.{parts[1]}"
    return parts[0]


def imports_of(path: Path, root: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, [module.name for each name of a `from` import]) for every import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parts[:-1])  # a module's, or an __init__'s own
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base, [f"{base}.{a.name}" for a in node.names]))
    return sorted(found)


def violations(root: Path, packages: list[str]) -> list[str]:
    """'path:line imports module (rule)' for every import a package's rule does not allow."""
    out = []
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            rule = RULES[package_of(path, root)]
            for line, module, names in imports_of(path, root):
                where = f"{path.relative_to(root)}:{line} imports {module}"
                if module.split(".")[0] in sys.stdlib_module_names:
                    continue
                if rule.allowed is not None and not _within(module, rule.allowed):
                    out.append(f"{where} (not in {package_of(path, root)}'s rule)")
                for name in [module, *names]:
                    if _within(name, rule.forbidden):
                        out.append(f"{where} ({name} is forbidden in {package_of(path, root)})")
                        break
    return out


PACKAGES = ["kvcache", "scheduler", "kernels", "workers", "cluster"]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_follow_the_architecture(package: str) -> None:
    assert violations(ROOT, [package]) == []


def test_every_package_has_a_rule() -> None:
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == sorted(PACKAGES)
    subpackages = sorted(p.parent.name for p in (ROOT / "cluster").glob("*/__init__.py"))
    assert subpackages == ["api", "batch", "engine"]


def test_a_violation_is_found_wherever_it_hides(tmp_path: Path) -> None:
    """The checker itself: lazy imports, `from package import submodule`, relative imports."""
    files = {
        "cluster/engine/bad.py": ("def f():\n    from cluster.api.protocol import RequestError\n"
                                  "from cluster import api\nfrom ..api import serve_app\n"
                                  "import fastapi.responses\nfrom cluster.engine import config\n"
                                  "import ray\n"),
        "workers/bad.py": ("from scheduler.plan import StepPlan\nimport kvcache\n"
                           "from scheduler.scheduler import Scheduler\nimport os, ray\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path, ["cluster", "workers"]) == [
        "cluster/engine/bad.py:2 imports cluster.api.protocol "
        "(cluster.api.protocol is forbidden in cluster.engine)",
        "cluster/engine/bad.py:3 imports cluster (cluster.api is forbidden in cluster.engine)",
        "cluster/engine/bad.py:4 imports cluster.api (cluster.api is forbidden in cluster.engine)",
        "cluster/engine/bad.py:5 imports fastapi.responses "
        "(fastapi.responses is forbidden in cluster.engine)",
        "workers/bad.py:2 imports kvcache (not in workers's rule)",
        "workers/bad.py:3 imports scheduler.scheduler (not in workers's rule)",
        "workers/bad.py:4 imports ray (not in workers's rule)",
    ]
