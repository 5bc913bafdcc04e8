"""The gateway: HTTP and WebSocket in, tokens out, the engine behind one seam.

A request's way through it, folder by folder:

- ``edge/``: what a client meets before any handler: connection and frame
  limits (``connections``; the WebSocket protocol under uvicorn, ``ws_protocol``),
  API keys and origins, per-tenant token rates.
- ``inputs/``: a client's JSON checked into one ``GenerateRequest`` (prompt,
  sampling, tools, ``response_format``), whichever protocol it came by.
- ``engine/``: the seam to the engine: admission (where a request is let in
  or refused), the client that submits it and fans the engine's outputs out
  to one stream per request, the engine process, and the text pieces made
  from a stream's tokens.
- ``openai/``: the OpenAI-compatible API: its fields, its replies (``api.py``
  writes them to the socket, whole or as SSE events), chat, completions,
  logprobs, tokenize.
- ``websocket.py``: ``GET /v1/stream``, the WebSocket protocol (writes each
  piece as a frame).
- ``observe/``: everything that watches: the observer interface, Prometheus
  metrics, OpenTelemetry spans, the dashboard's telemetry, the logs.
- ``app.py`` (routes), ``server.py`` (``stallfree serve``: uvicorn with
  those protocols, draining on shutdown), ``settings.py`` (limits and security settings).
"""
