#!/usr/bin/env bash
# The peers' Python packages the device lacks, downloaded here (the device has no internet) into
# .devbuild/ to be carried: bitsandbytes 0.50.2 (scripts/bench_peft.py --load-in-4bit, the
# QLoRA baseline; 43 MB) and liger-kernel 0.8.5 (--liger; 1 MB). The device's scripts install
# them with `pip install --no-deps --no-index --target`.
#
#   bash scripts/fetch-wheels.sh [bitsandbytes] [liger]     # default: both
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devbuild
want=" ${*:-bitsandbytes liger} "
pip=${PIP:-pip}
[[ $want == *" bitsandbytes "* ]] && $pip download bitsandbytes==0.50.2 --no-deps -d .devbuild
[[ $want == *" liger "* ]] && $pip download liger-kernel==0.8.5 --no-deps -d .devbuild
ls -la .devbuild/*.whl

# bitsandbytes ships a library per CUDA and ROCm release (43 MB); the device's torch is CUDA 13,
# so only libbitsandbytes_cuda13*.so and the CPU one are kept (and their RECORD lines), which
# leaves room in the 64 MiB the device tool carries for the lora-train binary beside it.
for w in .devbuild/bitsandbytes-*.whl; do
  [ -f "$w" ] || continue
  python3 - "$w" <<'PY'
import os, re, sys, zipfile
src = sys.argv[1]
keep = lambda n: not re.search(r"libbitsandbytes_(cuda(?!13)\d+|rocm\d+)", n)
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    for i in zi.infolist():
        if not keep(i.filename):
            continue
        data = zi.read(i)
        if i.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if keep(l.decode()))
        zo.writestr(i, data)
os.replace(tmp, src)
print(src, os.path.getsize(src) // 2**20, "MiB")
PY
done
