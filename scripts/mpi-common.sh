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
# MESHTRAIN_MPI_BIN: an MPI-enabled binary built already (e.g. a debug build while working).
BIN="$OUT/meshtrain-mpi"
if [ -n "${MESHTRAIN_MPI_BIN:-}" ]; then
    cp "$MESHTRAIN_MPI_BIN" "$BIN"
else
    # The same build as crates/comm/scripts/mpi-tests.sh (so in CI nothing compiles here).
    cargo build --release -p meshtrain -p meshtrain-comm --features meshtrain/mpi \
        --bin meshtrain --example mpi_collectives
    cp "${CARGO_TARGET_DIR:-target}/release/meshtrain" "$BIN"
fi

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

# whole_checkpoint CHECKPOINT (a file, or a sharded checkpoint's directory): a whole file of it.
whole_checkpoint() {
    if [ -d "$1" ]; then
        "$BIN" checkpoint consolidate "$1" "$1.whole.safetensors" >/dev/null
        echo "$1.whole.safetensors"
    else
        echo "$1"
    fi
}

# same_checkpoint A B [TOLERANCE] (two checkpoint.safetensors files): their tensors are
# bit-identical, or within a relative L2 distance of TOLERANCE (default 0).
same_checkpoint() {
    python3 - "$1" "$2" "${3:-0}" <<'EOF'
import json, struct, sys, math, array
def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: array.array("f", data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}
a, b, tol = tensors(sys.argv[1]), tensors(sys.argv[2]), float(sys.argv[3])
assert a.keys() == b.keys()
diff = sum((x - y) ** 2 for k in a for x, y in zip(a[k], b[k]))
norm = sum(y * y for k in b for y in b[k])
rel = math.sqrt(diff / norm)
identical = all(a[k].tobytes() == b[k].tobytes() for k in a)
print(f"  final parameters and optimizer state: {'bit-identical' if identical else f'relative L2 distance {rel:.2e}'}")
sys.exit(0 if identical or rel <= tol else 1)
EOF
}
