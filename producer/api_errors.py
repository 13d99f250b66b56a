"""Error responses of the HTTP API, the request guard that runs before routing, and how a
route reads its JSON body.

Every error is ``{"error": {"code", "message"}}`` (SPEC §7):

    400 bad_request      invalid JSON, a bad field, a bad session id or cwd
    401 unauthorized     ``api.token`` is set and the token is missing or wrong
    404 not_found        no log file for the session, an unknown job or route
    413 payload_too_large  the body is over ``limits.maxBodyBytes`` (declared or streamed)
    500 log_unreadable   the session's log is corrupt (a line that is not JSON) or cannot be read
    500 log_write_failed an append to the session's log failed (a full disk, say; nothing was written)
    500 internal_error   anything else unexpected (the traceback goes to the log)
    502 compaction_failed  a forced compaction whose job failed (the LLM call, mostly)
    503 redis_unavailable  Redis does not answer, or refuses to serve (MISCONF: its disk
                         is full; READONLY; OOM; LOADING)
    503 shard_count_mismatch  POST .../events only: the live watchers read with another
                         ``redis.shards`` (``compactor.shards.ShardGuard``); nothing published

``RequestGuard`` is pure ASGI (no BaseHTTPMiddleware): it checks the token
before anything else runs (every path but ``/healthz``, the status page and
its static files included), refuses a declared ``Content-Length`` over the
limit before the body is read, and counts the bytes actually received so a
chunked or lying body is cut off at the limit.

The token is accepted as ``Authorization: Bearer <token>`` or as HTTP Basic
with any user name and the token as password; a 401 challenges both schemes
(two ``WWW-Authenticate`` lines), so a browser opening the status page shows
its own login prompt and then sends the credentials with the page's fetches.
Either way the bytes sent are compared with the token's UTF-8 bytes, in
constant time (a header is bytes: a non-ASCII token works as sent by curl).

``JsonBodyRoute`` reads a route's body as strict JSON: sent as
``application/json`` (or ``application/*+json``; anything else is a 400, which
also keeps a browser page from posting here with a plain form), UTF-8, and
only values the log can hold as sent (``events.checks.check_json``: no
``NaN``/``Infinity``, no integer past 64 bits, no lone surrogate); each
refusal names the body or the field and why.
"""

from __future__ import annotations

import base64
import collections
import email.message
import ipaddress
import json
import logging
import secrets
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

import anyio
import redis
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compactor.redis_errors import acl_needs, is_permission_error, is_refusal
from events.errors import InvalidInput, LogCorrupted, LogWriteFailed, SessionNotFound
from events.checks import DuplicateKey, check_json, json_float, unique_keys
from events.models import json_path

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/healthz"})  # SPEC §7: the only route open without the token
CHALLENGES = ('Bearer realm="compactor"', 'Basic realm="compactor", charset="UTF-8"')
UNAUTHORIZED = ("a valid 'Authorization: Bearer <token>' header is required "
                "(in a browser: any user name, the token as password)")
STATUS_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "payload_too_large", 422: "bad_request", 502: "compaction_failed",
    503: "redis_unavailable",
}


class ApiError(Exception):
    """An error with its HTTP status, code and message, raised by handlers."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        self.status = status
        self.code = code or STATUS_CODES.get(status, "error")
        self.message = message
        super().__init__(message)


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` once the streamed body passes the limit (an HTTPException,
    so FastAPI's body parsing lets it through instead of turning it into a 400)."""

    def __init__(self, limit: int) -> None:
        self.message = f"request body is larger than limits.maxBodyBytes ({limit} bytes)"
        super().__init__(413, self.message)


class BadBody(StarletteHTTPException):
    """A 400 for a body that cannot be read as JSON, raised while FastAPI reads it (an
    HTTPException, so FastAPI lets it through instead of its generic parsing error)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def is_json_type(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` is JSON: ``application/json`` or ``application/*+json``,
    any parameters (``; charset=utf-8``)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def decode_json_body(raw: bytes) -> Any:
    """The body as JSON, UTF-8 only, holding only what the log can store; BadBody saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadBody(f"body: is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}; "
                      "send JSON as UTF-8") from e
    try:
        value = json.loads(text, object_pairs_hook=unique_keys, parse_float=json_float)
    except DuplicateKey as e:
        try:
            where = _repeated_key_at(text, e.key) or "body"
        except json.JSONDecodeError as invalid:  # (invalid after the repeated key: that is what to say)
            raise BadBody(f"body: is not valid JSON: {invalid.msg} at line {invalid.lineno}, "
                          f"column {invalid.colno}") from invalid
        raise BadBody(f"{where}: the key {e.key!r} appears twice in one object (one of its values would be "
                      "dropped)") from None
    except json.JSONDecodeError as e:
        raise BadBody(f"body: is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    except RecursionError as e:
        raise BadBody("body: is nested too deeply to be read") from e
    try:
        check_json(value)
    except InvalidInput as e:
        raise BadBody(str(e)) from e
    return value


class _Repeated(dict[str, Any]):
    """An object of the body in which a key appears twice (``_repeated_key_at``)."""

    keys_repeated: frozenset[str]
    pairs: list[tuple[str, Any]]  # as parsed, with the values the dict dropped


def _repeated_key_at(text: str, key: str) -> str | None:
    """Where in the body (``events[2].arguments``) the object repeating ``key`` is, the first to
    close as the parser met it (so the one its error named): the request's field, as every other
    400 names it (it said ``body`` whatever the depth). None: the body's top object."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) == len(pairs):
            return value
        repeated = _Repeated(value)
        counts = collections.Counter(name for name, _ in pairs)  # (``names.count`` per key: one object of
        # 40 000 keys, one repeated, held the event loop, /healthz with it, 29 s)
        repeated.keys_repeated = frozenset(name for name, times in counts.items() if times > 1)
        repeated.pairs = pairs
        return repeated

    def first(value: Any, path: list[str | int]) -> list[str | int] | None:  # children before their parent
        items: Any = (value.pairs if isinstance(value, _Repeated) else value.items() if isinstance(value, dict)
                      else enumerate(value) if isinstance(value, list) else ())
        for name, item in items:
            path.append(name)  # (one list, not a copy per value: the depth times the values, 10 s for 16 MiB)
            found = first(item, path)
            if found is not None:
                return found
            path.pop()
        if isinstance(value, _Repeated) and key in value.keys_repeated:
            return list(path)
        return None

    try:
        found = first(json.loads(text, object_pairs_hook=hook), [])
    except RecursionError:
        return None
    return json_path(found) if found else None


class JsonRequest(Request):
    """A request whose ``json()`` is ``decode_json_body`` (read once)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            # (a big body is read in a thread: 15 MB of small objects took the event loop 1.7 s)
            self._json = (decode_json_body(raw) if len(raw) < DECODE_OFF_LOOP_BYTES
                          else await anyio.to_thread.run_sync(decode_json_body, raw))
        return self._json


DECODE_OFF_LOOP_BYTES = 256 * 1024


class JsonBodyRoute(APIRoute):
    """A route whose body, when it takes one, must be JSON sent as JSON (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # a POST's query holds only the parameters it takes: ``?timeout=1`` on a forced compaction
        # was dropped silently (the call still waited jobWaitSeconds). (A GET may carry a client's
        # cache-buster.)
        known = _query_names(self.dependant) if "POST" in (self.methods or ()) else None
        if self.body_field is None:
            async def checked(request: Request) -> Response:
                _refuse_repeated_query(request, known)
                return await handler(request)

            return checked

        async def read_json(request: Request) -> Response:
            _refuse_repeated_query(request, known)
            strict = JsonRequest(request.scope, request.receive)
            encoding = strict.headers.get("content-encoding", "identity").strip().lower()
            if encoding != "identity":  # (gzip was read as the body itself: "not valid UTF-8: byte 0x8b")
                raise BadBody(f"body: Content-Encoding {encoding!r} is not supported: send the JSON uncompressed")
            content_type = strict.headers.get("content-type")
            if await strict.body() and not is_json_type(content_type):
                sent = f"not {content_type!r}" if content_type else "none was sent"
                raise BadBody(f"body: must be sent with Content-Type: application/json ({sent})")
            return await handler(strict)

        return read_json


def _query_names(dependant: Any) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    names: set[str] = set()
    stack = [dependant]
    while stack:
        current = stack.pop()
        names.update(param.alias for param in current.query_params)
        stack.extend(current.dependencies)
    return names


def _refuse_repeated_query(request: Request, known: set[str] | None = None) -> None:
    """A parameter given twice in the query string is a 400: no route takes a list, and one
    value would be dropped (``?cwd=/a&cwd=/b`` read the last, silently); so is one not in
    ``known`` (the route's, when given)."""
    names = [name for name, _ in request.query_params.multi_items()]
    if known is not None and (unknown := next((name for name in names if name not in known), None)) is not None:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise BadBody(f"{unknown}: unknown query parameter ({takes})")
    if len(names) != len(set(names)):
        counts = collections.Counter(names)  # (not names.count per name: a long query would cost its square)
        name = next(name for name in names if counts[name] > 1)
        raise BadBody(f"{name}: given {counts[name]} times in the query string; give it once")


RETRY_AFTER = {"Retry-After": "1"}  # on a 503 (Redis unreachable or refusing): seconds before a retry


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    code = code or STATUS_CODES.get(status, "error")
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    located = list(first.get("loc", ()))
    where = json_path([p for p in located if p not in ("body", "query", "path")])
    msg = str(first.get("msg", "invalid"))
    if first.get("type") == "extra_forbidden":  # a request body's unknown field
        msg = "unknown field" + (" (wait goes in the query string: ?wait=false)" if where == "wait" else "")
    if first.get("type") == "json_invalid":
        return f"body: is not valid JSON: {first.get('ctx', {}).get('error', msg)}"  # a route not a JsonBodyRoute
    where = where or (str(located[0]) if located else "")  # the whole body (or query) is what is wrong
    return f"{where}: {msg}" if where else msg


def install_error_handlers(app: FastAPI) -> None:
    """Map every expected exception to SPEC §7's error shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.message, exc.code)

    async def invalid_input(_: Request, exc: Exception) -> JSONResponse:
        return error_response(400, str(exc))

    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return error_response(404, str(exc) or "session not found")

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(400, _validation_message(exc))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = exc.headers
        if headers and "GET" in (allow := headers.get("Allow", "").split(", ")) and "HEAD" not in allow:
            headers = {**headers, "Allow": ", ".join([*allow, "HEAD"])}  # (every GET route answers HEAD too)
        return error_response(exc.status_code, str(exc.detail), headers=headers)

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        logger.warning("redis unavailable path=%s error=%s", request.url.path, exc)
        return error_response(503, f"Redis is unreachable: {exc}", headers=RETRY_AFTER)

    async def redis_refused(request: Request, exc: Exception) -> JSONResponse:
        if is_permission_error(exc):  # the ACL changed since the start's check
            logger.error("redis refused a permission path=%s error=%s", request.url.path, exc)
            return error_response(500, f"Redis's ACL refuses the API's user: {exc}; "
                                  f"{acl_needs(request.app.state.settings.redis.prefix)}", "redis_permission")
        if not is_refusal(exc):  # WRONGTYPE, a script's error: a bug, not an outage
            logger.error("redis error path=%s", request.url.path, exc_info=exc)
            return await internal(request, exc)
        logger.warning("redis refused path=%s error=%s", request.url.path, exc)
        return error_response(503, f"Redis refused the request: {exc}", headers=RETRY_AFTER)

    async def storage(request: Request, exc: Exception) -> JSONResponse:
        logger.error("session log unusable path=%s error=%s", request.url.path, exc)
        return error_response(500, str(exc), "log_unreadable" if isinstance(exc, LogCorrupted) else "log_write_failed")

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # (Starlette logs the traceback after this answer; the body keeps SPEC §7's shape)
        return error_response(500, f"internal error ({type(exc).__name__}); the API's log has the details",
                              "internal_error", headers={k.decode(): v.decode() for k, v in SECURITY_HEADERS})
        # (its own: Starlette answers an unhandled error outside the middleware that adds them)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(InvalidInput, invalid_input)
    app.add_exception_handler(SessionNotFound, not_found)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(redis.ConnectionError, redis_down)
    app.add_exception_handler(redis.TimeoutError, redis_down)
    app.add_exception_handler(redis.ResponseError, redis_refused)
    app.add_exception_handler(LogCorrupted, storage)
    app.add_exception_handler(LogWriteFailed, storage)
    app.add_exception_handler(Exception, internal)


def unauthorized_response() -> JSONResponse:
    """The 401, with one ``WWW-Authenticate`` line per accepted scheme (Bearer, Basic)."""
    response = error_response(401, UNAUTHORIZED)
    response.raw_headers += [(b"www-authenticate", c.encode("latin-1")) for c in CHALLENGES]
    return response


def basic_password(credentials: bytes) -> bytes | None:
    """The password of HTTP Basic ``base64(user:password)``; None when malformed."""
    try:
        decoded = base64.b64decode(credentials, validate=True)
    except ValueError:  # binascii.Error
        return None
    _, colon, password = decoded.partition(b":")
    return password if colon else None


def token_matches(header: bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` header (its bytes, as received) carries the token, compared
    with the token's UTF-8 bytes in constant time: as ``Bearer <token>``, or as HTTP Basic
    with the token as password (any user name)."""
    if not header:
        return False
    scheme, _, given = header.partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return secrets.compare_digest(given.strip(), token.encode("utf-8"))
    if scheme == b"basic":
        password = basic_password(given.strip())
        return password is not None and secrets.compare_digest(password, token.encode("utf-8"))
    return False


ENCODED_SEPARATORS = (b"%2f", b"%5c")  # "/" and "\\" as a path's bytes may spell them


def _encoded_separator(scope: Scope) -> JSONResponse | None:
    """A 400 for an API path holding an encoded ``/`` or ``\\``: routing reads the decoded path,
    so ``/api/sessions/s1%2Fcontext`` answered s1's context and ``a%2Fb`` a bare 404 (SPEC §3:
    an invalid session id is refused with a clear error). No id may hold either."""
    raw = scope.get("raw_path")
    path = (raw if isinstance(raw, bytes) else scope["path"].encode()).lower()
    if not path.startswith(b"/api/") or not any(sep in path for sep in ENCODED_SEPARATORS):
        return None
    field = "jobId" if path.startswith(b"/api/jobs/") else "sessionId"
    return error_response(400, f"{field}: holds an encoded '/' or '\\' (%2F, %5C), which no id can hold")


# on every answer: no MIME sniffing of a JSON transcript, no Referer to another site, no framing (the
# status page in another site's invisible frame)
SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"))


def _with_security_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in headers}
            message = {**message, "headers": headers + [h for h in SECURITY_HEADERS if h[0] not in present]}
        await send(message)
    return sending


_ONCE_ONLY = (b"authorization", b"host")  # headers whose copies could be read two ways (RFC 9110: one value each)


def _repeated(path: str, repeated: set[bytes]) -> JSONResponse | None:
    """A 400 for a request giving ``Authorization`` or ``Host`` more than once (the last one was
    read: a wrong token first and the right one after passed, where a proxy checking the first
    would have refused it)."""
    if path in PUBLIC_PATHS:
        return None
    for name in _ONCE_ONLY:
        if name in repeated:
            return error_response(400, f"{name.decode().title()}: is given more than once: send it once")
    return None


def _empty_id(path: str) -> JSONResponse | None:
    """A 400 for an API path whose id segment is empty (``/api/sessions//context``,
    ``/api/jobs/``): it matched no route, and the bare 404 read as an unknown route, not as the
    client's empty id (SPEC §3: an invalid session id is refused with a clear error)."""
    for prefix, field in (("/api/sessions/", "sessionId"), ("/api/jobs/", "jobId")):
        if path.startswith(prefix) and path[len(prefix):len(prefix) + 1] in ("", "/"):
            return error_response(400, f"{field}: is empty (the path's segment after {prefix})")
    return None


def _undecodable_query(scope: Scope) -> JSONResponse | None:
    """A 400 naming a query parameter whose percent-encoded bytes are not UTF-8: Starlette
    decodes them with replacement characters, so ``?cwd=/proj/%ff`` asked for cwd ``/proj/\ufffd``
    (a body's bytes are refused so: ``body: is not valid UTF-8``)."""
    for part in scope.get("query_string", b"").split(b"&"):  # (as Starlette splits it; parse_qsl decodes)
        name, _, value = part.partition(b"=")
        try:
            field = unquote_to_bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            return error_response(400, "query: a parameter's name is not valid UTF-8")
        try:
            unquote_to_bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return error_response(400, f"{field}: is not valid UTF-8 (its percent-encoded bytes)")
    return None


def _without_body(send: Send) -> Send:
    """``send`` for a HEAD request answered as its GET: the headers (its Content-Length too), no body."""
    async def headers_only(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return headers_only


def _foreign_host(value: bytes | None, allowed: frozenset[str]) -> str | None:
    """The name of a ``Host`` header that names no address of this API, else None: not an IP
    address, not localhost (or a name under .localhost), not in ``allowed`` (``*``: any). With no
    token, a page of any site could reach the API by DNS rebinding (its name resolved to 127.0.0.1:
    the browser sends it as Host, and the page reads the answers as same-origin): every transcript
    read, instructions pushed into an agent's context."""
    if value is None or "*" in allowed:
        return None
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):  # [v6]:port
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = unquote_to_bytes(name).decode("latin-1").rstrip(".")  # (a scoped IPv6 address: fe80::1%25eth0)
    if not name or name == "localhost" or name.endswith(".localhost") or name in allowed:
        return None
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name
    return None


class RequestGuard:
    """ASGI middleware: token auth (when a token is set) and the body size limit."""

    def __init__(self, app: ASGIApp, *, token: str, max_body_bytes: int,
                 allowed_hosts: Sequence[str] = ()) -> None:
        self.app = app
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        if scope["method"] == "HEAD":  # what GET answers, without the body (RFC 9110: every GET route)
            scope, send = {**scope, "method": "GET"}, _without_body(send)
        headers: dict[bytes, bytes] = {}
        repeated: set[bytes] = set()
        for name, value in scope["headers"]:
            name = name.lower()
            if name in headers:
                repeated.add(name)
            headers[name] = value
        refusal = (_repeated(scope["path"], repeated) or self._refuse(scope["path"], headers) or _encoded_separator(scope)
                   or _empty_id(scope["path"]) or _undecodable_query(scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self._call_counted(scope, receive, send)

    def _refuse(self, path: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        if not self.token and path not in PUBLIC_PATHS:
            foreign = _foreign_host(headers.get(b"host"), self.allowed_hosts)
            if foreign is not None:
                return error_response(400, f"Host: {foreign!r} is no address of this API: with no api.token set, "
                                           "only IP addresses and localhost are answered (a web page could reach "
                                           "the API through a DNS name rebound to it); set api.token, or list "
                                           "the name in api.allowedHosts")
        if self.token and path not in PUBLIC_PATHS and not token_matches(
                headers.get(b"authorization"), self.token):
            return unauthorized_response()
        declared = headers.get(b"content-length")
        if declared is not None:
            if not (declared.strip().isascii() and declared.strip().isdigit()):
                return error_response(400, "Content-Length is not a number")
            if int(declared) > self.max_body_bytes:
                return error_response(413, BodyTooLarge(self.max_body_bytes).message)
        return None

    async def _call_counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge as e:
            if started:
                raise
            await error_response(413, e.message)(scope, receive, send)
