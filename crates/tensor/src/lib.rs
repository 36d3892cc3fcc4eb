//! meshtrain-tensor
