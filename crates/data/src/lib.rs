//! meshtrain-data
