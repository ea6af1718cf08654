"""The README and docs/ say what the repository has: every relative link names a file in it,
and docs/architecture.md's import table says what tests/test_import_rules.py checks. (The
README's `bash` blocks are run against a server in tests/cluster/api/test_dev_serve.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_import_rules import RULES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_name_files_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (doc.parent / path).resolve().is_relative_to(ROOT), target
            assert (doc.parent / path).exists(), f"{doc.name} links to missing {target}"
        else:
            assert anchor in anchors, f"{doc.name} links to missing anchor #{anchor}"


def _table() -> dict[str, str]:
    """docs/architecture.md's import table: package -> its 'may import' cell."""
    rows = {}
    text = (ROOT / "docs" / "architecture.md").read_text()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[2] not in ("—", "not a package"):
            name = cells[0].strip("`").removesuffix("/").removesuffix("/__init__.py")
            rows[name.replace("/", ".")] = cells[2]
    return rows


def test_architecture_table_says_what_the_import_rules_check() -> None:
    table = _table()
    assert set(table) == set(RULES)
    for package, rule in RULES.items():
        named = set(re.findall(r"`([\w.]+)`", table[package]))
        if rule.allowed is None:
            assert table[package].startswith("anything"), package
            assert named == set(rule.forbidden), package
        else:
            assert named == set(rule.allowed) - {package}, package
