"""Gateway limits and security settings (one place, documented defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.gateway.edge.grants import Grant


@dataclass(slots=True)
class GatewaySettings:
    # admission control
    max_waiting: int = 256  # requests accepted but without a first token yet; more -> overloaded (429)
    max_waiting_per_key: int = 128  # one API key's share of max_waiting (0: no share); more -> overloaded (429)
    max_generations_per_connection: int = 32  # concurrent ids on one WebSocket
    tokenizer_threads: int = 1  # chat templates and tokenization running at once (the rest wait, counted as waiting)
    key_token_rate: float = 0.0  # tokens/s each API key may use (prompt + generated); 0: no limit
    key_token_burst_s: float = 10.0  # a key's bucket holds this many seconds of its rate
    # a request the queue forecast says cannot meet its TTFT target (only because of the
    # queue ahead) is refused at once (429 overloaded, Retry-After from the forecast) instead
    # of being admitted best-effort; changeable live (PUT /api/config {"shed_load": ...})
    shed_load: bool = False
    # input size limits
    max_frame_bytes: int = 1 << 20  # WebSocket text frame
    max_body_bytes: int = 1 << 20  # HTTP request body
    body_timeout_s: float = 30.0  # the whole HTTP request body must arrive within this (else 408 timeout)
    # connections (gateway/edge/connections.py), checked before the app sees a request
    max_header_bytes: int = 32 * 1024  # request line + headers; more -> 431
    max_headers: int = 100  # header fields; more -> 431
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this (else 408, closed)
    max_connections: int = 8192  # open HTTP + WebSocket connections in all (at most the file limit - 64); more -> 503
    max_connections_per_client: int = 2048  # from one client address; more -> 503
    # streaming
    stream_queue_frames: int = 64  # per-request queue; beyond it tokens coalesce into one frame
    slow_consumer_s: float = 30.0  # a stream with unread tokens this old is cancelled (slow_consumer)
    # a connection whose client reads nothing of what it is sent for this long is aborted
    # (after slow_consumer_s, so a stalled reader can still take its error frames first)
    stalled_connection_s: float = 60.0
    # security
    api_keys: tuple[str, ...] = ()  # keys that generate; a request's tenant is key-<n>
    # operator keys: they alone change live settings (PUT /api/config) once any key is set,
    # and they generate unbounded by grants; a request's tenant is admin-<n>
    admin_keys: tuple[str, ...] = ()
    # what each API key (by tenant id) may ask beyond the server's defaults (gateway.edge.grants)
    key_grants: dict[str, Grant] = field(default_factory=dict)
    # one prefix cache for every API key. Off: each key's prompts hit only its own
    # cached blocks (Request.cache_salt), else a key could recover another key's
    # prompt block by block from cached_tokens or the time to first token. Turn
    # it on only when all keys belong to one tenant.
    share_prefix_cache: bool = False
    auth_timeout_s: float = 10.0  # with keys set, a socket without one is closed after this
    # browser origins allowed to open sockets and send POST/PUT; empty: localhost and host_names only
    allowed_origins: tuple[str, ...] = ()
    host_names: tuple[str, ...] = ()  # the names this server is configured to answer as (--host)
    # health: an engine that has answered no command for stall_grace_s beyond
    # STALL_FACTOR x its running iteration's predicted time is stalled (/readyz false,
    # streams told, new requests 503); stalled for hung_engine_s, it is hung (exit non-zero)
    stall_grace_s: float = 2.0
    hung_engine_s: float = 300.0
    fatal_exit_delay_s: float = 2.0  # a failed engine's server answers 503 this long, then exits non-zero
    # shutdown
    drain_timeout_s: float = 10.0  # on SIGTERM/SIGINT, in-flight requests get this long to finish
    model_name: str = "stallfree"  # the id /v1/models reports
