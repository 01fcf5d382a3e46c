#!/usr/bin/env bash
# The CUDA paths, on a machine with an NVIDIA GPU (CI has none): the engine tests (their
# CUDA cases run where torch sees a device: canonical KV tensors on the GPU, multi-group
# stores and loads through pinned host memory, bytes checked after the round trip), then
# bench.cuda_check's copy sweep. Usage: scripts/cuda-check.sh OUT_DIR (python3 by default;
# PYTHON=... to choose). Needs torch with CUDA, msgspec, cbor2, pydantic, numpy, pytest,
# hypothesis and rich importable; the C extensions are optional (pure-Python fallbacks).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/cuda-check.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY' | tee "$out/gpu.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
rc=0
"$py" -m pytest -q -p no:cacheprovider -rs tests/engine_adapter 2>&1 | tee "$out/pytest.txt" || rc=$?
"$py" -m bench.cuda_check "$out" 2>&1 | tee "$out/cuda-check.log" || rc=$?
exit $rc
