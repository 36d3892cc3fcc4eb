#!/usr/bin/env bash
# Compiles and runs the CPU-emulator tests of the CUDA kernels (see cuda_emu.h):
# selftest_main.cpp (the emulator's own tests) and every *_test.cpp in this folder.
#
# Convention: `<kernelfile>_test.cpp` tests `crates/tensor/src/cuda/kernels/<kernelfile>.cu`.
# A test program includes, in this order:
#     #include "cuda_emu.h"
#     #include "common.cuh"
#     #include "<kernelfile>.cu"
# (this script puts this folder and the kernels folder on the include path), then defines
# main(), which launches kernels with emu::launch, compares with a reference and returns
# emu::finish("<name>") (non-zero on failure). Keep them small: the whole run should take
# well under a minute.
#
# Each program runs twice, with EMU_SCHEDULE=forward and EMU_SCHEDULE=reverse: a kernel
# without data races gives the same results under both, so a missing barrier shows up as a
# failure under one of them.
#
# Usage: run_emu_tests.sh [NAME...]   (NAME: a file name or its stem, e.g. bias_test)
# Environment: CXX (default g++), EMU_CXXFLAGS (extra flags, e.g. -fsanitize=undefined),
#              EMU_SCHEDULES (default "forward reverse"), EMU_JOBS (default: CPU count),
#              EMU_TIMEOUT (seconds per run, default 300), EMU_KEEP=1 keeps the build folder.
# Prints PASS/FAIL per program; exits non-zero if anything failed or nothing was found.
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kernels=$(cd "$here/../../src/cuda/kernels" && pwd)
cxx=${CXX:-g++}
schedules=${EMU_SCHEDULES:-forward reverse}
jobs=${EMU_JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}
limit=${EMU_TIMEOUT:-300}
# -fno-strict-aliasing: kernels pun through reinterpret_cast (float4, uint4, ...), which nvcc
# tolerates and g++ -O2 may miscompile. -ffp-contract=off: no fused multiply-adds behind the
# kernels' back on any host architecture (results do not depend on the host). -rdynamic: the
# emulator names kernels in its messages through dladdr.
flags=(-std=c++17 -O2 -g -Wall -Wno-unused -Wno-unknown-pragmas -pthread -fno-strict-aliasing
       -ffp-contract=off -rdynamic "-I$here" "-I$kernels")
# shellcheck disable=SC2206
extra=(${EMU_CXXFLAGS:-})

if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "run_emu_tests.sh: $cxx not found" >&2
    exit 2
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuda_emu.XXXXXX")
if [ "${EMU_KEEP:-0}" = 1 ]; then
    echo "build folder: $tmp"
else
    trap 'rm -rf "$tmp"' EXIT
fi

# The programs: the selftest, then the kernel tests in name order.
programs=("$here/selftest_main.cpp")
for f in "$here"/*_test.cpp; do
    [ -e "$f" ] && programs+=("$f")
done
if [ $# -gt 0 ]; then
    selected=()
    for p in "${programs[@]}"; do
        b=$(basename "$p")
        for want in "$@"; do
            if [ "$b" = "$want" ] || [ "$b" = "$want.cpp" ]; then selected+=("$p"); fi
        done
    done
    programs=("${selected[@]+"${selected[@]}"}")
fi
if [ ${#programs[@]} -eq 0 ]; then
    echo "run_emu_tests.sh: no test programs selected" >&2
    exit 2
fi

run_with_timeout() {
    if command -v timeout >/dev/null 2>&1; then
        timeout "$limit" "$@"
    else
        "$@"
    fi
}

# Builds and runs one program; writes its log and its status ("PASS", "FAIL (reason)").
one() {
    local src=$1 name
    name=$(basename "$src" .cpp)
    local log="$tmp/$name.log" status="$tmp/$name.status" start=$SECONDS
    {
        echo "== $name: $cxx ${flags[*]} ${extra[*]+"${extra[*]}"}"
        if ! "$cxx" "${flags[@]}" ${extra[@]+"${extra[@]}"} "$src" -o "$tmp/$name" 2>&1; then
            echo "FAIL (does not compile)" >"$status"
            return
        fi
        for s in $schedules; do
            echo "== $name, EMU_SCHEDULE=$s"
            EMU_SCHEDULE=$s run_with_timeout "$tmp/$name" 2>&1
            local rc=$?
            if [ $rc -ne 0 ]; then
                if [ $rc -eq 124 ]; then
                    echo "FAIL (timed out after ${limit}s, schedule $s)" >"$status"
                elif [ $rc -gt 128 ]; then
                    echo "FAIL (killed by signal $((rc - 128)), schedule $s)" >"$status"
                else
                    echo "FAIL (exit status $rc, schedule $s)" >"$status"
                fi
                return
            fi
        done
        echo "PASS ($((SECONDS - start))s)" >"$status"
    } >"$log" 2>&1
}

# Run the programs, up to $jobs at a time.
running=0
for p in "${programs[@]}"; do
    one "$p" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n 2>/dev/null || wait
        running=$((running - 1))
    fi
done
wait

failed=0
for p in "${programs[@]}"; do
    name=$(basename "$p" .cpp)
    status=$(cat "$tmp/$name.status" 2>/dev/null || echo "FAIL (no status)")
    printf '%-40s %s\n' "$name" "$status"
    case $status in
    PASS*) ;;
    *)
        failed=$((failed + 1))
        echo "---- output of $name (last 150 lines) ----"
        tail -n 150 "$tmp/$name.log"
        echo "---- end of $name ----"
        ;;
    esac
done
echo "cuda_emu: ${#programs[@]} program(s), $failed failed"
[ "$failed" -eq 0 ]
