#!/usr/bin/env bash
# The one command a session with a lent GPU runs, unedited, in its first device call:
#
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_run.sh     (device run, carry .whl)
#
# 1. installs what the GPU box lacks from the wheels carried in .whl/ (made here, where pip
#    reaches PyPI, by `bash bench/gpu_wheels.sh`; the box has torch, triton and transformers
#    but no registry), into /tmp/site on PYTHONPATH;
# 2. runs bench/gpu_report.py (the gpu-marked tests and every benchmark, most wanted first,
#    each with a time budget of its own and none past the run's deadline, GPU_RUN_DEADLINE_S,
#    480 s; its docstring has the arithmetic);
# 3. leaves under $OUT: report.md, report.json and gpu-report.tgz (every step's log and JSON),
#    three files, within what the device tool brings back.
# GPU_REPORT_ONLY (step names, comma-separated) reruns some steps (report.md names the ones the
# deadline left out); GPU_REPORT_HF=0 leaves out the transformers comparison.
# Without CUDA it says so and exits 0 at once: nothing here is measured on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu}"
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
  echo "gpu_run: no CUDA device visible to $PY: nothing to measure on this machine (run it on a lent GPU)"
  exit 0
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_run: installing .whl/ failed"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
report=/tmp/gpu-report
rm -rf "$report"
only=()  # GPU_REPORT_ONLY="gpu tests,kernels": a rerun of some steps, by name
if [[ -n "${GPU_REPORT_ONLY:-}" ]]; then IFS=, read -ra names <<< "$GPU_REPORT_ONLY"; only=(--only "${names[@]}"); fi
timeout -k 10 "$(( ${GPU_RUN_DEADLINE_S:-480} + 40 ))" \
  "$PY" bench/gpu_report.py --out "$report" --deadline-s "${GPU_RUN_DEADLINE_S:-480}" "${only[@]}"
rc=$?
cp "$report/report.md" "$report/report.json" "$OUT/" 2>/dev/null
mv "$OUT/nvidia-smi.txt" "$report/" 2>/dev/null
tar -czf "$OUT/gpu-report.tgz" -C /tmp gpu-report
exit $rc
