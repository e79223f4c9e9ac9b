"""What a request must pass before a route parses it: the Host check, the API key, a JSON
content type and the body size limit.

The Host check stops DNS rebinding: a web page on evil.example whose name is re-pointed at
127.0.0.1 can reach a loopback server, but its requests still say `Host: evil.example`. Requiring
`application/json` on POST routes means a browser must send a CORS preflight first, which fails
unless `--allowed-origins` names the page's origin.
"""
from __future__ import annotations

import hmac
import ipaddress

from dsquant.errors import DsquantError
from dsquant.runtime.server.api_errors import ApiError, error_response

LOOPBACK_NAMES = ["localhost", "127.0.0.1", "::1"]
WILDCARD_BINDS = {"", "0.0.0.0", "::"}


def check_api_key(key: str | None) -> str | None:
    """`key`, or None for no auth; an empty or blank key is refused (it would lock every route)."""
    if key is not None and not key.strip():
        raise DsquantError("the API key is empty: give --api-key (or DSQUANT_API_KEY) a non-empty value, "
                           "or set neither to serve without auth")
    return key


def authorized(header: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, the scheme matched case-insensitively (RFC 7235)."""
    parts = header.split()
    return (len(parts) == 2 and parts[0].lower() == "bearer"
            and hmac.compare_digest(parts[1].encode("utf-8", "surrogateescape"), key.encode()))


def require_json(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the request body must be sent as Content-Type: application/json, "
                            f"got {content_type or 'no Content-Type'!r}")


async def read_body(request, limit: int) -> bytes:
    """The body, or a 413 as soon as it (or its Content-Length) is over `limit` bytes."""
    def too_large():
        return ApiError(413, f"the request body is over {limit} bytes, this server's limit "
                             f"(dsquant serve --max-request-bytes)")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def default_allowed_hosts(bound_host: str) -> list[str]:
    """The Host names to accept for a server bound to `bound_host`: the loopback names for a
    loopback address, any ("*") for a wildcard bind, else the address itself."""
    host = bound_host.strip("[]").lower()
    if host in WILDCARD_BINDS:
        return ["*"]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return sorted(set(LOOPBACK_NAMES) | {host}) if loopback else [host]


def _hostname(value: str) -> str | None:
    """The name in a Host header ("name", "name:port", "[v6]:port"), lower-cased, or None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, close, rest = value[1:].partition("]")
        if not close or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, colon, port = value.partition(":")
        if colon and not port.isdigit():
            return None
    return name.rstrip(".") or None


class HostGuard:
    """ASGI middleware: answer 400 unless the Host header names an allowed host.

    Patterns: a name or address, "*.example.com" (any subdomain) or "*" (any host).
    """

    def __init__(self, app, allowed_hosts: list[str]):
        self.app = app
        self.allowed = {h.strip().strip("[]").lower().rstrip(".") for h in allowed_hosts}
        self.any = "*" in self.allowed
        self.suffixes = tuple(h[1:] for h in self.allowed if h.startswith("*."))

    def allows(self, host_header: str | None) -> bool:
        name = _hostname(host_header) if host_header else None
        return name is not None and (name in self.allowed or any(name.endswith(s) for s in self.suffixes))

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not self.any:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.allows(host):
                response = error_response(400, f"the Host header {host!r} is not one this server answers to "
                                               f"(dsquant serve --allowed-hosts)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
