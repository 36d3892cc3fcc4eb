//! Pipeline parallelism: a model's blocks cut into stages on different workers.
