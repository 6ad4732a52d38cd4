#!/usr/bin/env bash
# Installs the peer contenders for the issue-4 benchmarks into their own venv,
# bench/.peers-venv (gitignored), so baton's .venv stays untouched.
#
#   bash bench/peers/setup.sh          # idempotent: skips what is already installed
#
# torch first, at the same version as baton's venv (pip takes the local CPU
# wheel), then TorchFT at a pinned nightly: the stable torchft 0.2.0 crashes the
# surviving replica on a kill (see /work/shared/DESIGN.md).
set -euo pipefail

TORCH_VERSION=2.13.0
TORCHFT_NIGHTLY=2026.10.26   # newest torchft-nightly pip could see on 2026-11-21

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$(cd "$here/.." && pwd)/.peers-venv"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip="$venv/bin/pip"

have() { "$venv/bin/python" - "$1" "$2" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PY
}

have torch "$TORCH_VERSION" || "$pip" install --quiet "torch==$TORCH_VERSION"
"$venv/bin/python" -c "import numpy" 2>/dev/null || "$pip" install --quiet numpy  # silences torch's numpy warning
have torchft-nightly "$TORCHFT_NIGHTLY" || "$pip" install --quiet "torchft-nightly==$TORCHFT_NIGHTLY"

"$venv/bin/python" - <<PY
import torch, torchft
from importlib.metadata import version
print("peers venv ready:", "$venv")
print("  torch", torch.__version__, "| torchft-nightly", version("torchft-nightly"))
PY
