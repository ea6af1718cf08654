"""`serve run MANIFEST` as `./dev serve` runs it (through scripts/serve.sh), with three things
plain `serve run` does not do:

1. It checks the manifest before Ray starts: Serve's own schema, then every application's
   `args` with its app builder's checks (`import_path`; cluster.api.serve_app:build_app's are
   `check_args` in that module, for any other builder the build itself, the call Serve's
   controller makes). A bad manifest (an unknown key, a wrong value) exits
   with status 2 and the builder's message in about a second; plain `serve run` starts Ray,
   retries the build, logs the error (the app DEPLOY_FAILED) and runs on until Ctrl-C.
2. SIGINT and SIGTERM both stop it the way Ctrl-C stops `serve run` (Serve shut down, then the
   Ray cluster it started), also when it was started in the background, where the shell
   starts it with SIGINT ignored and `serve run` would ignore Ctrl-C and `kill -INT`.
3. QWEN3_SERVE_PORT, when set, replaces the manifest's `http_options.port` (so two servers
   can run on one machine without editing a manifest).

Usage: python scripts/serve_run.py [manifest]   (default: manifests/qwen3-tiny.yaml)
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import yaml

DEFAULT_MANIFEST = "manifests/qwen3-tiny.yaml"
PORT_ENV = "QWEN3_SERVE_PORT"


class ManifestError(ValueError):
    """A manifest that cannot deploy; the message says where and why."""


def load_manifest(path: str) -> dict[str, Any]:
    """The manifest as a dict, with PORT_ENV applied; ManifestError when unreadable."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ManifestError(f"{path}: cannot read it as YAML: {e}") from None
    if not isinstance(config, dict):
        raise ManifestError(f"{path}: a Serve config file is a mapping with `applications`")
    port = os.environ.get(PORT_ENV)
    if port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ManifestError(f"{PORT_ENV}={port!r} is not a TCP port number")
        config.setdefault("http_options", {})["port"] = int(port)
    return config


def check_manifest(path: str, config: dict[str, Any]) -> None:
    """Serve's schema, then each application's builder on its args; ManifestError naming the
    application and the builder's message (which names the bad key) on the first failure."""
    from pydantic import ValidationError
    from ray._common.utils import import_attr
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        raise ManifestError(f"{path}: not a valid Serve config: {e}") from None
    for app in schema.applications:
        try:
            builder = import_attr(app.import_path)
            # The builder's own checks without the build, where its module offers them
            # (cluster.api.serve_app does: building would import torch, seconds here).
            check = getattr(inspect.getmodule(builder), "check_args", None)
            if callable(check):
                check(app.args or {})
            else:
                serve_api.call_user_app_builder_with_args_if_necessary(builder, app.args or {})
        except Exception as e:  # noqa: BLE001 - whatever the builder raises is the message
            raise ManifestError(f"{path}: application {app.name!r} ({app.import_path}) "
                                f"cannot deploy: {e}") from None


def _interrupt(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str]) -> int:
    path = argv[0] if argv else DEFAULT_MANIFEST
    # `serve run` stops on KeyboardInterrupt: Serve's shutdown, then Ray's at exit. A shell
    # starts a background job with SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        config = load_manifest(path)
        check_manifest(path, config)
    except ManifestError as e:
        print(f"./dev serve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    run_path = path
    if os.environ.get(PORT_ENV):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="serve-", delete=False) as f:
            yaml.safe_dump(config, f)
        run_path = f.name
    # A Ray cluster of its own (or RAY_ADDRESS's, to join one), started here so that the
    # SIGTERM handler can be put back after it: ray.init replaces it with one that exits
    # without shutting Serve down, and its C++ core installs a crash handler that dumps a
    # stack. "local", not None: None would join whatever cluster this machine's Ray temp dir
    # names as the latest (another app's, a test session's), and shut its Serve down on exit.
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.scripts import cli

    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", namespace=SERVE_NAMESPACE)
    except KeyboardInterrupt:
        return 130
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cli.main(["run", run_path], prog_name="serve", standalone_mode=True)
    finally:
        if run_path != path:
            os.unlink(run_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
