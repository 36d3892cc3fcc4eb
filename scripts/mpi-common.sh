# Shared setup of the end-to-end mpirun training tests (sourced, not run): OpenMPI over
# shared memory and loopback TCP only, a scratch folder removed on exit, the MPI-enabled
# binary copied there (a later plain build replaces target/release/meshtrain), and helpers to
# read and compare the final training loss of two runs.
#
# Needs: apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMPI_MCA_btl="self,vader,tcp"
export OMPI_MCA_btl_tcp_if_include="lo"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# Same target dir as the tests (CARGO_TARGET_DIR if set), so only the crates behind the
# feature rebuild.
cargo build --release -p meshtrain --features mpi
BIN="$OUT/meshtrain-mpi"
cp "${CARGO_TARGET_DIR:-target}/release/meshtrain" "$BIN"

final_loss() { grep -o 'final train loss [0-9.]*' "$1" | awk '{print $4}'; }

# same_final_loss NAME LOG_A LOG_B: the two runs' final losses agree to 1e-3 (only the order
# of additions inside the all-reduce differs between the backends).
same_final_loss() {
    local a b
    a=$(final_loss "$2")
    b=$(final_loss "$3")
    echo "$1: final loss MPI $a, threads $b"
    python3 -c "import sys; a, b = float('$a'), float('$b'); sys.exit(0 if abs(a - b) < 1e-3 else 1)" \
        || { echo "$1: FAILED: losses differ"; exit 1; }
}
