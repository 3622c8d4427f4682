"""Who may drive the server, and from where, as llama-server and vLLM decide it.

    llgraph serve MODEL --api-key KEY          # or --api-key-file PATH (not in `ps`), or LLGRAPH_API_KEY=KEY
    llgraph serve MODEL --allowed-hosts my.lan # Host names accepted beyond loopback's (default: loopback's only)
    llgraph serve MODEL --cors-origins https://app.example   # browsers on that origin may call (default: none)

One ASGI layer (`Guard`) sees every request before a route does:
- **Host.** A server bound to loopback answers only `Host: localhost`, `127.0.0.1` or `[::1]` (any port), else a
  421: a page on attacker.example whose DNS is rebound to 127.0.0.1 is same-origin with the server and would pass
  any CORS rule, but its requests carry `Host: attacker.example`. `--allowed-hosts` adds names (`*`: any). Bound
  beyond loopback, any Host is answered unless --allowed-hosts names them.
- **Key.** With a key every route but /health and the chat page at / (static; it sends the key itself) wants
  `Authorization: Bearer KEY` or `X-Api-Key: KEY` — completions, embeddings, tokenize, the chat template
  (/tokenizer_info), the API docs, and /metrics unless `--open-metrics`
  (a scraper without credentials). Compared in constant time; a 401 in OpenAI's shape (`invalid_api_key`) before
  the body is read. A key that no header could carry (surrounding whitespace, a character outside printable ASCII)
  is refused at startup in one line.
- **Browsers.** A request whose `Origin` is neither the server's own (its Host) nor one `--cors-origins` lists is a
  403, whatever its method and content type: a page elsewhere can send a CORS-simple POST (`text/plain`, no
  preflight), and gets no answer. No CORS headers unless `--cors-origins` lists origins (Starlette's CORSMiddleware
  answers their preflights). A body without `Origin` (curl, SDKs: no browser) may be sent untyped, as `curl -d`
  does; with one it must be `application/json` (request.read_json).
A server that listens beyond loopback without a key says at startup what anyone who reaches it can do.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
from pathlib import Path

KEY_ENV = "LLGRAPH_API_KEY"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
OPEN_PATHS = ("/health", "/")  # probes; the chat page (static: it asks for the key and sends it itself)


def api_key(flag: str | None, file: str | None = None) -> str | None:
    """--api-key, else --api-key-file's first line, else $LLGRAPH_API_KEY, else None (no key asked for). A key no
    header can carry is refused in one line."""
    from llgraph.errors import LlgraphError

    if flag is not None and file is not None:
        raise LlgraphError("give --api-key or --api-key-file, not both")
    where = "--api-key" if flag is not None else f"--api-key-file {file}" if file is not None else "$" + KEY_ENV
    key = flag if flag is not None else os.environ.get(KEY_ENV)
    if file is not None:
        try:
            key = Path(file).read_text(encoding="utf-8").removesuffix("\n").removesuffix("\r")
        except (OSError, UnicodeDecodeError) as e:
            raise LlgraphError(f"--api-key-file {file}: {getattr(e, 'strerror', None) or e}; give a readable UTF-8 "
                               "file holding the key") from None
    if key is None:
        return None
    if not key.strip():
        raise LlgraphError(f"the API key is empty ({where}); give a non-empty key, or none to serve without one")
    if key != key.strip() or not re.fullmatch(r"[\x20-\x7e]+", key):
        raise LlgraphError(f"the API key ({where}) has surrounding whitespace or a character outside printable ASCII, "
                           "which no client's header can match; give a key of printable ASCII without leading or "
                           "trailing spaces")
    return key


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header without its port: `[::1]:8000` -> `[::1]`, `localhost:8000` -> `localhost`; "" for one that
    is no host[:port] (`localhost:evil`, `[::1]evil:80`, `127.0.0.1:80 evil`), which no allowed name matches."""
    header = header.strip(" \t").lower()
    if header.startswith("["):
        name, _, port = header.partition("]")
        name, port = name + "]", port
    elif header.count(":") == 1:
        name, port = header.split(":")
        port = ":" + port
    else:
        name, port = header, ""
    return name if port == "" or re.fullmatch(r":[0-9]{1,5}", port) else ""


class Guard:
    """The ASGI layer that checks Host and key of every HTTP request before any route (see the module)."""

    def __init__(self, app, *, key: str | None, bound: str, allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), open_metrics: bool = False):
        self.app, self.key, self.origins = app, key, {o.rstrip("/").lower() for o in cors_origins}
        self.open = OPEN_PATHS + (("/metrics",) if open_metrics else ())
        hosts = {h.lower() for h in allowed_hosts}
        if loopback(bound):
            hosts |= set(LOOPBACK_HOSTS)
        self.hosts = None if "*" in hosts or not hosts else hosts  # None: any Host

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.hosts is not None and host_name(headers.get("host", "")) not in self.hosts:
            return await _refuse(send, 421, f"this server answers Host {', '.join(sorted(self.hosts))}, not "
                                 f"{headers.get('host', '(none)')[:100]!r}; start it with --allowed-hosts NAME to "
                                 "serve that name", "misdirected_request")
        origin = headers.get("origin")
        scheme, _, site = (origin or "").lower().partition("://")
        if origin is not None and origin.rstrip("/").lower() not in self.origins and \
                (scheme not in ("http", "https") or site.rstrip("/") != headers.get("host", "").lower()):
            return await _refuse(send, 403, f"a request from the web page at {origin[:100]!r} is refused: start the "
                                 "server with --cors-origins ORIGIN to let pages of that origin call it",
                                 "cross_origin_refused")
        if self.key is not None and scope["path"] not in self.open and scope["method"] != "OPTIONS":
            scheme, _, given = headers.get("authorization", "").partition(" ")
            # HTTP's optional whitespace is spaces and tabs only: a key followed by a non-breaking space is another key
            given = given.strip(" \t") if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip(" \t")
            if not hmac.compare_digest(given.encode("latin-1"), self.key.encode()):
                return await _refuse(send, 401, "a valid API key is needed: send `Authorization: Bearer KEY` or "
                                     "`X-Api-Key: KEY` (llgraph serve --api-key)", "invalid_api_key")
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def warning(host: str, key: str | None) -> str | None:
    """The startup warning for a server reachable beyond this machine without a key, else None."""
    if key is not None or loopback(host):
        return None
    return (f"llgraph serve: warning: listening on {host} without an API key — anyone who can reach this port can "
            "generate, embed, tokenize, read the chat template and the metrics; set --api-key (or --api-key-file, "
            f"${KEY_ENV})")
