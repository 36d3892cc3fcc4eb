//! meshtrain-plan
