//! MPI backend.
