#!/usr/bin/env bash
# The GPU checks as one script, for a lent GPU machine (the device tool's `run`):
#   bash bench/gpu_session.sh        # with .whl/ carried (pydantic & co. for that machine's Python)
# Writes what it measured under $OUT (or ./gpu-out): environment, NCCL probe, bench/gpu.py.
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; nproc; free -g; python3 -V; } > "$out/env.txt" 2>&1
timeout 240 python3 bench/nccl_probe.py --out "$out" > "$out/nccl_probe.log" 2>&1; echo "nccl_probe rc=$?"
timeout 300 python3 bench/gpu.py --state-gb "${STATE_GB:-10}" --runs "${RUNS:-3}" > "$out/gpu.txt" 2>&1; echo "gpu rc=$?"
tail -c 1500 "$out/nccl_probe.json"; tail -n 40 "$out/gpu.txt"
