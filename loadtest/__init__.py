"""The load generator ``stallfree bench`` runs: ``workloads`` (what is sent and
when), ``clients`` (the WebSocket and OpenAI SSE protocols, per-token timing),
``runner`` (jobs sent at their times; the Prometheus queue-wait probe),
``stats`` (summaries, goodput) and ``report`` (tables, markdown, plots).
Product code: typed, checked by mypy, shipped in the wheel; the benchmarks
under ``bench/`` use it too."""
