"""API keys (constant-time comparison) and the WebSocket Origin allow-list."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def request_key(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (or ``X-API-Key``)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


def key_matches(given: object, keys: tuple[str, ...]) -> bool:
    """Compares against every key, in constant time for each."""
    if not isinstance(given, str):
        return False
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


def origin_allowed(headers: Mapping[str, str], allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin; other clients usually do not (allowed).

    With no allow-list, only pages served by this host or by localhost may
    open a socket, so a random web page cannot drive a local server.
    """
    origin = headers.get("origin")
    if origin is None:
        return True
    if allowed:
        return origin in allowed or "*" in allowed
    host = urlsplit(origin).hostname or ""
    return host in LOCAL_HOSTS or origin.split("://", 1)[-1] == headers.get("host", "")
