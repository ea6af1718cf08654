#!/usr/bin/env bash
# What `./dev serve [manifest]` runs once .venv is set up: `serve run` (through
# scripts/serve_run.py) with the settings the app is tuned for (cluster/api/serve_env.py; Serve
# reads them only from the environment of the process that starts Ray): HAProxy in front, gRPC
# to the ingress, and, unless RAY_ADDRESS names a cluster to join, a Ray cluster that listens on
# 127.0.0.1 only. Ray's token authentication stays on (Ray's default): `serve status` and `ray`
# commands run by the same user find the token in ~/.ray/auth_token; the dashboard asks for it
# (`ray get-auth-token`).
# Before Ray starts, the manifest is checked with the app builder's own validation: a bad one
# exits with status 2 and the message. Ctrl-C, SIGINT or SIGTERM (also to a server started in
# the background) stops the app and the cluster. QWEN3_SERVE_PORT overrides the manifest's
# HTTP port.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
eval "$(python -m cluster.api.serve_env)"
exec python scripts/serve_run.py "${1:-manifests/qwen3-tiny.yaml}"
