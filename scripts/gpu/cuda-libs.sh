#!/usr/bin/env bash
# Source this on a GPU machine before running a binary built with cudarc (dynamic loading):
#     source scripts/gpu/cuda-libs.sh && .gpu/meshtrain ...
# cudarc dlopen()s libcuda, libnvrtc, libcublas(Lt) and libnccl by the names in
# cudarc::get_lib_name_candidates (libX.so, libX.so.13, ...). On the lent H100 (2026-11-26)
# libcuda.so.1 lives in /usr/local/nvidia/lib64, the CUDA 13.0 toolkit in /usr/local/cuda,
# and NCCL only as the pip file libnccl.so.2, which cudarc does not try by itself. This links
# one real file per library under the names cudarc tries, in a temporary folder put first on
# LD_LIBRARY_PATH, and exports CUDA_INCLUDE_DIRS (NVRTC needs include/ and include/cccl for
# <cuda_bf16.h>). It prints what it found; nothing is installed.
SITE=${CUDA_LIBS_SITE_PACKAGES:-/opt/torch/.venv/lib/python3.12/site-packages}
_dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "$SITE"/nvidia/*/lib
       /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu)
_first() { local d g f; for g in "$@"; do for d in "${_dirs[@]}"; do for f in "$d"/$g; do
  case "$f" in */stubs/*|*/compat/*) continue ;; esac; [ -e "$f" ] && { readlink -f "$f"; return; }
  done; done; done; }
CUDA_LIBS_DIR=$(mktemp -d /tmp/cuda-libs.XXXXXX)
for spec in "cuda:libcuda.so.1" "nvrtc:libnvrtc.so.13 libnvrtc.so" "cublas:libcublas.so.13 libcublas.so" \
            "cublasLt:libcublasLt.so.13 libcublasLt.so" "nccl:libnccl.so.2 libnccl.so" \
            "cudnn:libcudnn.so.9 libcudnn.so"; do
  name=${spec%%:*}; real=$(_first ${spec#*:})
  if [ -n "$real" ]; then
    for alias in "lib$name.so" "lib$name.so.13" "lib$name.so.1" "lib$name.so.9"; do
      ln -sf "$real" "$CUDA_LIBS_DIR/$alias"; done
    _path=${_path:+$_path:}$(dirname "$real")
    echo "cuda-libs: $name -> $real"
  else
    echo "cuda-libs: $name not found"
  fi
done
export LD_LIBRARY_PATH=$CUDA_LIBS_DIR:$_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for inc in /usr/local/cuda/include "$SITE"/nvidia/cu13/include; do
  [ -f "$inc/cuda_bf16.h" ] && { export CUDA_INCLUDE_DIRS="$inc:$inc/cccl"; break; }
done
echo "cuda-libs: CUDA_INCLUDE_DIRS=${CUDA_INCLUDE_DIRS:-none}"
unset _dirs _path spec name real alias inc
