//! Measurements (filled in below).
