#!/usr/bin/env bash
# MPI backend tests: builds meshtrain-comm with `--features mpi` and runs the MPI
# driver under mpirun with 2 and 4 processes. Fails loudly on any failure.
#
# Needs: apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
# Usage (from the workspace root): crates/comm/scripts/mpi-tests.sh
set -euo pipefail

cd "$(dirname "$0")/../../.."
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
# Keep OpenMPI on shared memory + loopback and quiet about missing fabrics in CI.
export OMPI_MCA_btl="self,vader,tcp"
export OMPI_MCA_btl_tcp_if_include="lo"
# Containers often forbid the cross-process copies (CMA/ptrace) vader uses by default.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"

fail() {
    echo "mpi-tests: FAILED: $*" >&2
    exit 1
}

echo "mpi-tests: building (cargo build -p meshtrain-comm --features mpi --example mpi_collectives)"
cargo build -p meshtrain-comm --features mpi --example mpi_collectives
BIN=target/debug/examples/mpi_collectives
[[ -x "$BIN" ]] || fail "driver binary $BIN not built"

LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT

for NP in 2 4; do
    echo "mpi-tests: conformance suite, desync and mesh checks with $NP processes"
    if ! timeout 300 "${MPIRUN[@]}" -np "$NP" "$BIN" test >"$LOG/test.$NP" 2>&1; then
        cat "$LOG/test.$NP" >&2
        fail "conformance suite with $NP processes"
    fi
    grep -q "mpi conformance OK: $NP ranks" "$LOG/test.$NP" || {
        cat "$LOG/test.$NP" >&2
        fail "conformance suite with $NP processes did not report success"
    }
    grep "mpi conformance OK" "$LOG/test.$NP"

    # A stuck rank: the others must fail with a timeout error (2 s timeout in the
    # driver) and abort the job with a non-zero exit, in seconds.
    echo "mpi-tests: stuck worker with $NP processes"
    start=$(date +%s)
    if timeout 60 "${MPIRUN[@]}" -np "$NP" "$BIN" stuck >"$LOG/stuck.$NP" 2>&1; then
        cat "$LOG/stuck.$NP" >&2
        fail "stuck worker run exited 0 with $NP processes"
    fi
    elapsed=$(( $(date +%s) - start ))
    grep -q "all_reduce #2 on group 'world' timed out after 2s" "$LOG/stuck.$NP" || {
        cat "$LOG/stuck.$NP" >&2
        fail "stuck worker run did not report the timeout of all_reduce #2"
    }
    (( elapsed <= 10 )) || fail "stuck worker run took ${elapsed}s (timeout is 2s)"
    echo "  failed as expected in ${elapsed}s: $(grep -m1 'timed out' "$LOG/stuck.$NP")"

    # A crashing rank: the job must end non-zero, not hang.
    echo "mpi-tests: killed worker with $NP processes"
    start=$(date +%s)
    if timeout 60 "${MPIRUN[@]}" -np "$NP" "$BIN" kill >"$LOG/kill.$NP" 2>&1; then
        cat "$LOG/kill.$NP" >&2
        fail "killed worker run exited 0 with $NP processes"
    fi
    elapsed=$(( $(date +%s) - start ))
    (( elapsed <= 10 )) || fail "killed worker run took ${elapsed}s"
    echo "  failed as expected in ${elapsed}s"
done

echo "mpi-tests: all passed"
