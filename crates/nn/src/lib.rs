//! meshtrain-nn
