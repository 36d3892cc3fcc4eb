//! Data parallelism: every worker holds a full replica and averages gradients.
