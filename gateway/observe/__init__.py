"""Everything that watches requests and iterations: metrics, spans, the dashboard's telemetry, logs."""
