#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine whose image has torch, triton and transformers but reaches no package index.
#
# Here:   make gpu-wheels                       (the missing packages as wheels for its Python 3.12, into .whl/)
# There:  bash bench/gpu_check_device.sh [--only NAME,...]   (from the repository root, with .whl/ carried along)
#
# Installs the wheels and SmartGen itself (editable, no dependencies) into the image's Python, says what it runs on,
# then runs every check; the JSON, the table and the whole log land in $OUT (the device tool's folder) or in
# gpu-check-results/. Exits with the check's status: 0 when every line passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-check-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check_device: no wheels in .whl/: run 'make gpu-wheels' where pip reaches an index, and carry .whl" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . || exit 2
python3 - <<'EOF' | tee "$out/versions.txt"
import torch, transformers, triton
print(f"python torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}; devices: "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
EOF
python3 -m smartgen.apps.gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
