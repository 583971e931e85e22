#!/usr/bin/env bash
# Runs a lora-train built by scripts/build-cuda.sh on a GPU machine whose CUDA libraries are
# PyTorch's pip packages rather than a system toolkit:
#
#   bash scripts/device-env.sh ./lora-train bench --shape llama2-7b
#   source scripts/device-env.sh     # only set the environment
#
# The binary needs libcuda.so.1 (the driver's), libcudart.so.13, libcublas(Lt).so.13,
# libcurand.so.10, libnvrtc.so.13 and libnccl.so.2. This puts every site-packages/nvidia/*/lib
# of the Python installations it finds (NVIDIA_SITE first, when set) and /usr/local/cuda on
# LD_LIBRARY_PATH. It also turns NVLink multicast off (shared hosts forbid it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

__lt_libdirs() {
  local roots=() r d
  [ -n "${NVIDIA_SITE:-}" ] && roots+=("$NVIDIA_SITE")
  roots+=(/opt/torch/.venv/lib/python3*/site-packages)
  if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r r; do roots+=("$r"); done < <(python3 -c \
      'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  fi
  for r in "${roots[@]}"; do
    for d in "$r"/nvidia/cu13/lib "$r"/nvidia/*/lib; do [ -d "$d" ] && echo "$d"; done
  done
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && echo "$d"; done
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
  exit 127
fi
exec "$bin" "$@"
