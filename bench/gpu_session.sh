#!/usr/bin/env bash
# The GPU checks as one script, for a lent GPU machine (the device tool's `run`):
#   bash bench/gpu_session.sh        # with .whl/ carried (pydantic & co. for that machine's Python)
# Writes what it measured under $OUT (or ./gpu-out): environment, NCCL probe, bench/gpu.py.
# ONLY=cuda runs tests/test_cuda.py alone (a GPU model's moves under `baton run`, bitwise).
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  # the tests' jobs set PYTHONPATH themselves (fault injection): a .pth keeps both importable
  printf '/tmp/site\n%s\n' "$PWD" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/baton-device.pth"
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; nproc; free -g; python3 -V; } > "$out/env.txt" 2>&1
if [ "${ONLY:-}" = cuda ] || [ "${CUDA_TESTS:-}" = 1 ]; then
  timeout 420 python3 -m pytest -q -x tests/test_cuda.py -p no:cacheprovider -s --timeout 400 > "$out/test_cuda.txt" 2>&1
  echo "test_cuda rc=$?"; tail -c 6000 "$out/test_cuda.txt"
  log=$(find /tmp/pytest-of-* -path '*baton/stderr.log' 2>/dev/null | head -1); [ -n "$log" ] && cp "$log" "$out/job_stderr.log"
  [ "${ONLY:-}" = cuda ] && exit 0
fi
timeout 240 python3 bench/nccl_probe.py --out "$out" > "$out/nccl_probe.log" 2>&1; echo "nccl_probe rc=$?"
timeout 300 python3 bench/gpu.py --state-gb "${STATE_GB:-10}" --runs "${RUNS:-3}" > "$out/gpu.txt" 2>&1; echo "gpu rc=$?"
tail -c 1500 "$out/nccl_probe.json"; tail -n 40 "$out/gpu.txt"
