"""`serve run` import paths: the manifests' and the one from before the engine/API split both
resolve, through Serve's own resolver, to the same application builder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve", reason="Serve's import resolver needs Ray")
from ray._common.utils import import_attr  # noqa: E402

from cluster.api.serve_app import build_app  # noqa: E402

MANIFESTS = sorted((Path(__file__).resolve().parents[3] / "manifests").glob("*.yaml"))


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_import_path_resolves_to_build_app(manifest: Path):
    apps = yaml.safe_load(manifest.read_text())["applications"]
    assert apps, f"{manifest.name} has no application"
    for app in apps:
        assert import_attr(app["import_path"]) is build_app


def test_pre_split_import_path_still_resolves():
    assert import_attr("cluster.serve_app:build_app") is build_app
