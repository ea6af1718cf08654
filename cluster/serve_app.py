"""The `serve run` import path from before the engine/API split, `cluster.serve_app:build_app`.

Existing Serve configs and `serve run cluster.serve_app:build_app ...` command lines keep
working; the application itself lives in `cluster.api.serve_app` (the manifests name that).
This module owns nothing: it re-exports the one name Serve resolves.
"""

from __future__ import annotations

from cluster.api.serve_app import build_app

__all__ = ["build_app"]
