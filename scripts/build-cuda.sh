#!/usr/bin/env bash
# Builds lora-train with CUDA (and NCCL) for an H100 / H200, on a machine with or without a GPU.
#
#   bash scripts/build-cuda.sh                      # --features cuda,nccl, release, sm_90a
#   CUDA_COMPUTE_CAP=89 bash scripts/build-cuda.sh  # another GPU: 80 A100, 86 RTX 30xx, 89 RTX 40xx
#   STAGE_DIR=.devbuild bash scripts/build-cuda.sh --features cuda,nccl --bin lora-train
#
# With a system CUDA toolkit (nvcc on PATH, or CUDA_HOME set) it is used as it is. Without one,
# NVIDIA's CUDA 13.0 wheels from PyPI serve as the toolkit: nvcc, the headers, and the runtime
# libraries to link against, installed once into $CUDA_PIP_DIR (about 1.4 GB). The binary links
# dynamically (candle's cuda feature asks for it) against libcuda.so.1, libcudart.so.13,
# libcublas(Lt).so.13, libcurand.so.10, libnvrtc.so.13 (and libnccl.so.2): at run time those come
# from the driver and the CUDA 13 libraries of the machine that runs it (docs/gpu.md: the search,
# and scripts/device-env.sh for pip-installed ones). Needs an NVIDIA driver >= 580 to run.
# A cold build takes about 10 minutes on 2 cores.
#
# Arguments are cargo build's (default: --features cuda,nccl). STAGE_DIR copies the stripped
# executables there, with scripts/device-env.sh beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
[ $# -gt 0 ] || set -- --features cuda,nccl

if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
  CUDA_PIP_DIR=${CUDA_PIP_DIR:-/opt/cuda-13.0-pip}
  CU=$CUDA_PIP_DIR/nvidia/cu13
  # 13.0: the version of the drivers we run on (580.xx); a newer nvcc writes PTX they refuse.
  wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
          nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
          nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-nccl-cu13==2.28.9)
  if [ ! -x "$CU/bin/nvcc" ] || [ ! -e "$CU/lib/libcublas.so.13" ] \
     || [ ! -e "$CUDA_PIP_DIR/nvidia/nccl/lib/libnccl.so.2" ]; then
    echo "build-cuda: installing the CUDA 13.0 wheels into $CUDA_PIP_DIR" >&2
    python3 -m pip install -q --no-deps --no-compile --disable-pip-version-check \
      --target "$CUDA_PIP_DIR" --upgrade "${wheels[@]}"
  fi
  # The linker wants unversioned names, and a libcuda.so: the wheels ship no driver, so a stub
  # of empty functions stands in (its SONAME makes the binary load the real one at run time).
  stubs=$CU/lib/stubs
  mkdir -p "$stubs"
  for l in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
    ln -sf "../lib$l" "$stubs/lib${l%.so.*}.so"
  done
  ln -sf ../../../nccl/lib/libnccl.so.2 "$stubs/libnccl.so"
  if [ ! -e "$stubs/libcuda.so" ]; then
    grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$CU/include/cuda.h" "$CU/include/cudaTypedefs.h" \
      | sed -E 's/_pt(ds|sz)$//' | sort -u | sed -E 'p; s/$/_ptds/p; s/_ptds$/_ptsz/' | sort -u \
      | sed -E 's/.*/void &(void){}/' > "$stubs/libcuda_stub.c"
    cc -shared -fPIC -w -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda_stub.c"
  fi
  export PATH=$CU/bin:$PATH CUDA_ROOT=$CU CUDA_HOME=$CU CUDA_PATH=$CU
  export CUDARC_CUDA_VERSION=13000 # cudarc's bindings for CUDA 13.0, whatever nvcc says
fi

echo "build-cuda: $(nvcc --version | tail -1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP; cargo build --release $*" >&2
start=$(date +%s)
cargo build --release --locked "$@"
echo "build-cuda: built in $(( $(date +%s) - start )) s" >&2

target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
for b in lora-train; do
  f=$target/release/$b
  [ -x "$f" ] || continue
  strip "$f" 2>/dev/null || true
  echo "build-cuda: $f ($(du -h "$f" | cut -f1))" >&2
  if [ -n "${STAGE_DIR:-}" ]; then
    mkdir -p "$STAGE_DIR" && cp -f "$f" "$STAGE_DIR/" && cp -f scripts/device-env.sh "$STAGE_DIR/"
  fi
done
