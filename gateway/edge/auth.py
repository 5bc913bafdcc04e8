"""API keys (constant-time comparison) and the Origin allow-list (WebSockets and browser HTTP)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from stallfree.gateway.edge.grants import ADMIN_PREFIX

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listen addresses that name no host


def request_key(headers: Headers) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (or ``X-API-Key``). None
    when either header comes twice: which copy a server reads differs between
    servers and proxies, so neither counts."""
    auth, api = headers.getlist("authorization"), headers.getlist("x-api-key")
    if len(auth) > 1 or len(api) > 1:
        return None
    if auth and auth[0][:7].lower() == "bearer ":
        return auth[0][7:].strip()
    return api[0] if api else None


def tenant_of(given: object, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> str | None:
    """Which configured key this is, as ``key-<n>`` (the n-th API key) or
    ``admin-<n>`` (the n-th operator key): never the key itself, so it can be
    logged and used for fair sharing; None for no configured key. Compares
    against every key, in constant time for each."""
    if not isinstance(given, str):
        return None
    found = None
    for prefix, listed in (("key-", keys), (ADMIN_PREFIX, admin_keys)):
        for n, key in enumerate(listed, 1):
            if hmac.compare_digest(given.encode(), key.encode()):
                found = f"{prefix}{n}"
    return found


def key_matches(given: object, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> bool:
    return tenant_of(given, keys, admin_keys) is not None


def origin_allowed(origin: str | None, allowed: tuple[str, ...], host_names: tuple[str, ...] = ()) -> bool:
    """May a browser page from ``origin`` use this server? Non-browser clients
    send no Origin (allowed).

    With an allow-list, only its origins (``*``: any). Without one, pages
    served from localhost or from the server's own configured host names:
    never whatever the request's Host header says, which a DNS-rebinding page
    controls.
    """
    if origin is None:
        return True
    if allowed:
        return origin in allowed or "*" in allowed
    host = urlsplit(origin).hostname or ""
    return host in LOCAL_HOSTS or host in host_names


def cross_origin_refusal(headers: Mapping[str, str], allowed: tuple[str, ...], host_names: tuple[str, ...]) -> str:
    """Why a state-changing browser request must be refused ("" if it may go on).

    Browsers send Origin with every POST/PUT, so a page elsewhere cannot drive
    this server with a "simple" request (``text/plain`` needs no preflight);
    ``Sec-Fetch-Site: cross-site`` without an Origin is refused too.
    """
    origin = headers.get("origin")
    if origin is not None and origin != "null":
        if origin_allowed(origin, allowed, host_names):
            return ""
        return f"origin {origin} is not allowed (serve with --allowed-origin {origin} to allow it)"
    if origin == "null" or headers.get("sec-fetch-site") == "cross-site":
        return "cross-site requests are not allowed"
    return ""
