"""Gateway limits and security settings (one place, documented defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GatewaySettings:
    # admission control
    max_waiting: int = 256  # requests accepted but without a first token yet; more -> overloaded (429)
    max_generations_per_connection: int = 32  # concurrent ids on one WebSocket
    # input size limits
    max_frame_bytes: int = 1 << 20  # WebSocket text frame
    max_body_bytes: int = 1 << 20  # HTTP request body
    # streaming
    stream_queue_frames: int = 64  # per-request queue; beyond it tokens coalesce into one frame
    slow_consumer_s: float = 30.0  # a stream with unread tokens this old is cancelled (slow_consumer)
    # security
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # WebSocket Origin allow-list; empty: same host and localhost only
    # shutdown
    drain_timeout_s: float = 10.0  # on SIGTERM/SIGINT, in-flight requests get this long to finish
    model_name: str = "stallfree"  # the id /v1/models reports
