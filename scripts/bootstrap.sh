#!/usr/bin/env bash
# Creates .venv and installs the project (editable, with dev extras) on a fresh clone.
# Idempotent: a second run with nothing changed takes a second.
# Then builds the C++ CPU ops (kernels/cpu_extension.py) if these sources and torch lack them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No NVIDIA GPU: the pinned CPU wheel keeps pip from pulling several GB of CUDA packages.
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
# The C++ CPU paged attention and sampling, into build/cpu_ops/ (~20 s once per source and torch
# version; a no-op after). Where they cannot be built: one warning, and the CPU path stays on
# torch's SDPA and the sampling twin.
.venv/bin/python kernels/cpu_extension.py
