"""A local OpenAI-compatible chat-completions server for tests and benchmarks (the LLM faked at the HTTP layer).

``LLMStub`` serves ``POST /v1/chat/completions`` (and ``/chat/completions``) on
127.0.0.1 on a free port, from a thread of the test process, so litellm (in
the test or in a worker subprocess) reaches it over real HTTP:

    with LLMStub() as stub:
        os.environ["OPENAI_API_BASE"] = stub.base_url   # or api_base=stub.base_url
        ...  # model "openai/stub-model"
        stub.requests[0].body["messages"]

Control:
- ``stub.reply``: a string, or a callable ``(body: dict) -> str``; the default
  answers with a valid 10-section summary (``valid_summary_reply``).
- ``stub.latency_s``: seconds to wait before answering every request.
- ``stub.status``: the HTTP status of every answer (200 by default; an error
  status gets an OpenAI-style error body).
- ``stub.script(*responses)``: ``StubResponse`` objects answered first, one per
  request, in order, before falling back to the settings above.

Every request is recorded (``stub.requests``, thread-safe), also ones whose
client hung up before the answer. ``stub.wait_for_requests(n)`` blocks until
``n`` have arrived.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

STOP_POLL_S = 0.02  # how often the serving loop checks for stop()

SECTION_TITLES = (
    "Primary Request", "Key Technical Concepts", "Files and Code Sections",
    "Errors and Fixes", "Problem Solving", "Decision Rationale", "All User Messages",
    "Pending Tasks", "Current Work", "Optional Next Step",
)
STUB_MODEL = "openai/stub-model"
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 429: "rate_limit_error",
}

Reply = str | Callable[[dict[str, Any]], str]


def summary_text(tag: str = "stub") -> str:
    """A valid summary body (the inner text of ``<summary>``) whose sections mention ``tag``."""
    return "\n".join(f"### {title}\n{tag}: {title.lower()}\n" for title in SECTION_TITLES).strip()


def valid_summary_reply(body: dict[str, Any]) -> str:
    """The default reply: analysis plus a valid summary naming how many messages it got."""
    count = len(body.get("messages", []))
    return f"<analysis>\nread {count} messages\n</analysis>\n\n<summary>\n{summary_text('stub')}\n</summary>"


@dataclass(frozen=True)
class StubResponse:
    """One scripted answer: ``text`` with ``status`` after ``delay_s`` (None text: the default reply;
    with an error status, ``text`` is the error's message);
    with ``trickle_s``, the headers at once and the body 64 bytes at a time, ``trickle_s`` apart;
    ``raw``: the body sent as it is, with ``content_type`` (a proxy's page, a stream, bad bytes);
    ``finish_reason``: the choice's ("length": a reply cut at the model's output limit);
    ``hang_up``: the request read, the connection closed with no reply (a provider that closed a
    kept-alive connection as the request came)."""

    status: int = 200
    text: str | None = None
    delay_s: float = 0.0
    trickle_s: float = 0.0
    raw: bytes | None = None
    content_type: str = "application/json"
    finish_reason: str = "stop"
    hang_up: bool = False


@dataclass
class RecordedRequest:
    """A request the stub received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    received_at: float = field(default_factory=time.monotonic)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages", []))

    @property
    def user_text(self) -> str:
        """The text of every non-system message, joined."""
        return "\n".join(str(m.get("content", "")) for m in self.messages if m.get("role") != "system")


class LLMStub:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 (see the module docstring)."""

    def __init__(self, reply: Reply = valid_summary_reply, *, latency_s: float = 0.0, status: int = 200,
                 keep_alive: bool = True):
        self.reply: Reply = reply
        self.latency_s = latency_s
        self.status = status
        self.keep_alive = keep_alive  # False: each connection closed after its reply (no thread left waiting)
        self.requests: list[RecordedRequest] = []
        self._scripted: deque[StubResponse] = deque()
        self._lock = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        server.daemon_threads = True
        self._server = server
        # shutdown() waits for the serving loop to poll: at the default 0.5 s every stop cost ~0.5 s
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": STOP_POLL_S},
                                        name="llm-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "stub not started"
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """The ``api_base`` for litellm / ``OPENAI_API_BASE``."""
        return f"http://127.0.0.1:{self.port}/v1"

    # -- control ---------------------------------------------------------------------------

    def script(self, *responses: StubResponse) -> None:
        """Answer the next requests with these, in order."""
        with self._lock:
            self._scripted.extend(responses)

    def wait_for_requests(self, count: int, timeout_s: float = 30.0) -> list[RecordedRequest]:
        """Block until at least ``count`` requests arrived; the requests so far."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stub got {len(self.requests)} requests, expected {count}")
                self._lock.wait(left)
            return list(self.requests)

    # -- serving ---------------------------------------------------------------------------

    def _record(self, request: RecordedRequest) -> StubResponse:
        with self._lock:
            self.requests.append(request)
            self._lock.notify_all()
            if self._scripted:
                return self._scripted.popleft()
        return StubResponse(status=self.status, delay_s=self.latency_s)

    def _reply_text(self, response: StubResponse, body: dict[str, Any]) -> str:
        if response.text is not None:
            return response.text
        return self.reply(body) if callable(self.reply) else self.reply


def completion_body(text: str, model: str, finish_reason: str = "stop") -> dict[str, Any]:
    """An OpenAI chat.completion object answering ``text``."""
    return {
        "id": f"chatcmpl-stub-{time.time_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }],
        "usage": {"prompt_tokens": 1, "completion_tokens": max(1, len(text) // 4),
                  "total_tokens": 1 + max(1, len(text) // 4)},
    }


def error_body(status: int, message: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object for ``status`` (``message``: its text, else a stub's)."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message or f"stub error {status}", "type": kind, "param": None, "code": kind}}


def _handler_for(stub: LLMStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle + delayed-ACK stalls

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = {"_raw": raw.decode("utf-8", "replace")}
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._send(404, error_body(404))
                return
            response = stub._record(RecordedRequest(self.path, dict(self.headers), body))
            if response.delay_s:
                time.sleep(response.delay_s)
            if response.hang_up:
                self.close_connection = True
                self.request.shutdown(socket.SHUT_RDWR)
            elif response.raw is not None:
                self._send_bytes(response.status, response.raw, response.content_type, response.trickle_s)
            elif response.status == 200:
                text = stub._reply_text(response, body)
                self._send(200, completion_body(text, str(body.get("model", "stub-model")), response.finish_reason),
                           response.trickle_s)
            else:
                self._send(response.status, error_body(response.status, response.text), response.trickle_s)

        def _send(self, status: int, payload: dict[str, Any], trickle_s: float = 0.0) -> None:
            self._send_bytes(status, json.dumps(payload).encode(), "application/json", trickle_s)

        def _send_bytes(self, status: int, data: bytes, content_type: str, trickle_s: float) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                if not stub.keep_alive:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if not trickle_s:
                    self.wfile.write(data)
                    return
                self.wfile.flush()
                for start in range(0, len(data), 64):
                    time.sleep(trickle_s)
                    self.wfile.write(data[start:start + 64])
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client (a killed worker, a timed-out call) hung up

    return Handler
