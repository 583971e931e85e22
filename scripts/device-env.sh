#!/usr/bin/env bash
# Runs a lora-train built by scripts/build-cuda.sh on a GPU machine whose CUDA libraries are
# PyTorch's pip packages rather than a system toolkit:
#
#   bash scripts/device-env.sh ./lora-train bench --shape llama2-7b
#   source scripts/device-env.sh     # only set the environment
#
# The binary needs libcuda.so.1 (the driver's), libcudart.so.13, libcublas(Lt).so.13,
# libcurand.so.10, libnvrtc.so.13 and libnccl.so.2 (docs/gpu.md). It puts on LD_LIBRARY_PATH, in
# this order, the first found first:
#   1. $NVIDIA_SITE/nvidia/*/lib, when NVIDIA_SITE is set (a site-packages directory);
#   2. $CUDA_PIP_DIR/nvidia/*/lib (default /opt/cuda-13.0-pip: what scripts/build-cuda.sh
#      installs when there is no toolkit);
#   3. nvidia/*/lib of every site-packages of python3 (PyTorch's CUDA wheels, pip's nvidia-*);
#   4. $CUDA_HOME/lib64, then /usr/local/cuda/lib64 and /usr/local/cuda/targets/x86_64-linux/lib;
#   5. the LD_LIBRARY_PATH it was given.
# It also turns NVLink multicast off (shared hosts forbid it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

__lt_libdirs() {
  local roots=() r d
  [ -n "${NVIDIA_SITE:-}" ] && roots+=("$NVIDIA_SITE")
  roots+=("${CUDA_PIP_DIR:-/opt/cuda-13.0-pip}")
  if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r r; do roots+=("$r"); done < <(python3 -c \
      'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  fi
  for r in "${roots[@]}"; do
    for d in "$r"/nvidia/cu13/lib "$r"/nvidia/*/lib; do [ -d "$d" ] && echo "$d"; done
  done
  for d in ${CUDA_HOME:+"$CUDA_HOME"/lib64} /usr/local/cuda/lib64 \
           /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && echo "$d"
  done
}
LD_LIBRARY_PATH=$( { __lt_libdirs; tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}"; } | awk 'NF && !seen[$0]++' | paste -sd: -)
export LD_LIBRARY_PATH
unset -f __lt_libdirs

(return 0 2>/dev/null) && return 0 # sourced

set -euo pipefail
bin=${1:?usage: device-env.sh BINARY [args...]}
shift
[ -x "$bin" ] || chmod +x "$bin"
if ldd "$bin" | grep -q 'not found'; then
  echo "device-env.sh: libraries not found for $bin:" >&2
  ldd "$bin" | grep 'not found' >&2
  echo "device-env.sh: install them (docs/gpu.md, \"libcublas.so.13: not found\"), or point" \
       "NVIDIA_SITE at the site-packages that holds nvidia/*/lib" >&2
  exit 127
fi
exec "$bin" "$@"
