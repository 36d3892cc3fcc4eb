//! meshtrain-chart: PNG charts (training curves, scaling bars, pipeline timelines).
