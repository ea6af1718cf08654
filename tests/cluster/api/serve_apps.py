"""Serve apps for the HTTP tests: one app started from a manifest's args on the shared cluster,
at a free HTTP port, and stopped with Serve after the module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from session_ports import free_port


@contextmanager
def serve_app(args: dict[str, Any], name: str) -> Iterator[str]:
    """The app `build_app(args)` under `name` at route /; yields its base URL."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.api.serve_app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # (Serve may already run with its own)
    serve.run(build_app(args), name=name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(name)
        serve.shutdown()  # the next module starts Serve with its own HTTP port
