#!/usr/bin/env bash
# The peers' Python packages the device lacks, downloaded here (the device has no internet) into
# .devbuild/ to be carried: bitsandbytes 0.50.2 (scripts/bench_peft.py --load-in-4bit, the
# QLoRA baseline; 43 MB) and liger-kernel 0.8.5 (--liger; 1 MB). The device's scripts install
# them with `pip install --no-deps --no-index --target`.
#
# unsloth: Unsloth 2026.10.9 and unsloth_zoo 2026.10.9 (scripts/bench_unsloth.py; the newest
# release, and one whose pins admit the device's transformers 5.17.0: `transformers<=5.17.0`)
# into .devbuild/unsloth/, with only the dependencies the device's image lacks that Unsloth
# imports on its GPU path: trl 1.15.0 (its pin: <=1.15.0), datasets 4.8.5 with dill 0.4.1 and
# multiprocess 0.70.19 (Python 3.12's wheel, the device's Python), and cut_cross_entropy 25.1.1
# (optional there; its fused linear cross entropy, as an Unsloth install has it). It also needs
# bitsandbytes (imported unconditionally), so `unsloth` fetches that too. Left out, as Unsloth
# imports them only inside try or not at all on this path: xformers (optional: Unsloth then
# runs torch's SDPA; its wheel alone would not fit the carry), torchao, tyro, hf_transfer,
# diffusers, msgspec (vLLM only), pydantic (a warnings filter). The unsloth wheel is repacked
# without studio/ (the web UI, 82 MB of its 91 MB unpacked) and unsloth_cli/ (the CLI, which
# imports studio/): 28.6 -> 1.9 MB; .devbuild/unsloth holds 6.6 MB in all.
#
# trl: TRL 1.16.0 (scripts/bench_peft.py --objective dpo, scripts/check_trl_pref.py; issue 65)
# into .devbuild/trl/, with the dependencies the device's image lacks: datasets 4.8.5, dill
# 0.4.1, multiprocess 0.70.19 (Python 3.12's wheel), as for Unsloth (the image has accelerate,
# pyarrow, pandas and xxhash: Unsloth's TRL imported with them). 1.7 MB.
#
#   bash scripts/fetch-wheels.sh [bitsandbytes] [liger] [unsloth] [trl]   # default: the first two
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devbuild
want=" ${*:-bitsandbytes liger} "
[[ $want == *" unsloth "* ]] && want="$want bitsandbytes "
pip=${PIP:-pip}
[[ $want == *" bitsandbytes "* ]] && $pip download bitsandbytes==0.50.2 --no-deps -d .devbuild
[[ $want == *" liger "* ]] && $pip download liger-kernel==0.8.5 --no-deps -d .devbuild
if [[ $want == *" unsloth "* ]]; then
  mkdir -p .devbuild/unsloth
  # the device's Python is 3.12: multiprocess ships a wheel per Python version
  $pip download --no-deps --only-binary=:all: --python-version 3.12 -d .devbuild/unsloth \
    unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 \
    multiprocess==0.70.19 cut_cross_entropy==25.1.1
fi
if [[ $want == *" trl "* ]]; then
  mkdir -p .devbuild/trl
  $pip download --no-deps --only-binary=:all: --python-version 3.12 -d .devbuild/trl \
    trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
fi
ls -la .devbuild/*.whl .devbuild/unsloth/*.whl .devbuild/trl/*.whl 2>/dev/null || true

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

# Unsloth's wheel is mostly its web UI (studio/) and the CLI that needs it (unsloth_cli/): both
# are dropped (and their RECORD lines), the library under unsloth/ kept whole.
for w in .devbuild/unsloth/unsloth-*.whl; do
  [ -f "$w" ] || continue
  python3 - "$w" <<'PY'
import os, sys, zipfile
src = sys.argv[1]
keep = lambda n: not n.startswith(("studio/", "unsloth_cli/"))
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    for i in zi.infolist():
        if not keep(i.filename):
            continue
        data = zi.read(i)
        if i.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if keep(l.decode()))
        elif i.filename.endswith(".dist-info/entry_points.txt"):
            data = b"".join(l for l in data.splitlines(True) if b"unsloth_cli" not in l)
        zo.writestr(i, data)
os.replace(tmp, src)
print(src, round(os.path.getsize(src) / 2**20, 1), "MiB")
PY
done
[ -d .devbuild/unsloth ] && du -ch .devbuild/unsloth/*.whl | tail -1 | sed 's/total/.devbuild\/unsloth in all/'
[ -d .devbuild/trl ] && du -ch .devbuild/trl/*.whl | tail -1 | sed 's/total/.devbuild\/trl in all/'
exit 0
