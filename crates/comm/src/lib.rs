//! meshtrain-comm
