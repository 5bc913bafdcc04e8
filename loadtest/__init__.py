"""The load generator ``stallfree bench`` runs (``generator``: workloads, the
WebSocket and OpenAI SSE clients, per-token timing, summaries) and its report
(``report``: tables, markdown, plots). Product code: typed, checked by mypy,
shipped in the wheel; the benchmarks under ``bench/`` use it too."""
