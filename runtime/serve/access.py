"""Who may drive the server, as llama-server and vLLM decide it.

    llgraph serve MODEL --api-key KEY    # or LLGRAPH_API_KEY=KEY: each /v1/* route wants `Authorization: Bearer KEY`

The key is compared in constant time (hmac.compare_digest); a missing or wrong one is a 401 in OpenAI's error shape
(`invalid_api_key`), before the body is read. /health and /metrics stay open, for probes and scrapers. A server that
listens beyond loopback without a key says so at startup. Whatever the key: a POST body that is not
`application/json` is a 415 (request.read_json) — a web page can send a `text/plain` POST to a local server without
a CORS preflight, and must not get an answer.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

KEY_ENV = "LLGRAPH_API_KEY"


def api_key(flag: str | None) -> str | None:
    """--api-key, else $LLGRAPH_API_KEY, else None (no key asked for). An empty key is refused in one line."""
    key = flag if flag is not None else os.environ.get(KEY_ENV)
    if key is not None and not key.strip():
        from llgraph.errors import LlgraphError

        raise LlgraphError(f"the API key is empty ({'--api-key' if flag is not None else '$' + KEY_ENV}); give a "
                           "non-empty key, or none to serve without one")
    return key


def check_key(authorization: str | None, key: str | None) -> None:
    """A request's Authorization header against the server's key; ApiError 401 unless it is `Bearer KEY`."""
    if key is None:
        return
    from llgraph.runtime.serve.request import ApiError  # (this module loads without the serve extra: api_key)

    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "a valid API key is needed: send `Authorization: Bearer KEY` (llgraph serve --api-key)",
                       code="invalid_api_key")


def warning(host: str, key: str | None) -> str | None:
    """The startup warning for a server reachable beyond this machine without a key, else None."""
    if key is not None:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"llgraph serve: warning: listening on {host} without an API key — anyone who can reach this port can "
            f"use the model; set --api-key or ${KEY_ENV}")
