"""`Http1Pool`: keep-alive HTTP/1.1 connections to one worker, for the generate stream only.

Every routed request makes one generate call, so its client cost is the router's overhead. httpx
(over httpcore and anyio) writes a request's headers and body in two socket writes and walks
several layers per chunk; on a busy 2-core box that cost about 3 ms a request more than one write
and httptools' C parser (benchmarks/RESULTS.md, router overhead). The other calls (load, health,
abort, model card) are rare and stay on httpx in disagg/client.py.

Not here: timeouts policy and error classification (disagg/client.py decides; this raises
`OSError`, `TimeoutError` or `Http1Error`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


class Http1Error(Exception):
    """The worker's answer was not valid HTTP/1.1, or the connection closed mid-answer."""


@dataclass
class _Parsed:
    """What httptools' callbacks collect from one response."""

    parser: httptools.HttpResponseParser | None = None
    status: int = 0
    headers_done: bool = False
    keep_alive: bool = False
    complete: bool = False
    body: list[bytes] = field(default_factory=list)

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # Only meaningful now: once the message is complete httptools resets it to False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        self.complete = True


class Response:
    """One response being read: the status once the headers are in, then the body's chunks."""

    def __init__(self, conn: _Conn, parsed: _Parsed, parser: httptools.HttpResponseParser) -> None:
        self.conn = conn
        self._parsed = parsed
        self._parser = parser

    @property
    def status(self) -> int:
        return self._parsed.status

    async def next_chunk(self, read_timeout: float) -> bytes | None:
        """The body's next bytes as they arrive (None at its end); each wait for bytes is bounded
        by `read_timeout`. A method, not an async generator: one per hop of every event."""
        parsed = self._parsed
        while not parsed.body:
            if parsed.complete:
                return None
            await self.conn.feed(self._parser, read_timeout)
        body, parsed.body = parsed.body, []
        return body[0] if len(body) == 1 else b"".join(body)

    async def read(self, read_timeout: float) -> bytes:
        chunks = []
        while (chunk := await self.next_chunk(read_timeout)) is not None:
            chunks.append(chunk)
        return b"".join(chunks)

    @property
    def complete(self) -> bool:
        return self._parsed.complete

    def reusable(self) -> bool:
        return self._parsed.complete and self._parsed.keep_alive


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def alive(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    async def feed(self, parser: httptools.HttpResponseParser, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            data = await self.reader.read(65536)
        if not data:
            raise Http1Error("the worker closed the connection mid-response")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise Http1Error(f"bad HTTP from the worker: {e}") from e

    def close(self) -> None:
        self.writer.close()


class Http1Pool:
    def __init__(self, url: str, headers: dict[str, str], max_idle: int = 64) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.base_path = parts.path.rstrip("/")
        self.max_idle = max_idle
        fixed = {"host": parts.netloc, **{k.lower(): v for k, v in headers.items()}}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Conn] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def post(self, path: str, body: bytes, connect_timeout: float, headers_timeout: float) -> _Post:
        """POST `body` (JSON); `async with` it for the response once its headers are in; each wait
        for their bytes is bounded by `headers_timeout`. The connection goes back to the pool
        only when the response was read to its end; otherwise it is closed."""
        request = (
            f"POST {self.base_path}{path} HTTP/1.1\r\n{self._head}"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        return _Post(self, request, connect_timeout, headers_timeout)

    def release(self, resp: Response) -> None:
        if resp.reusable() and len(self._idle) < self.max_idle:
            resp.conn.reused = True
            self._idle.append(resp.conn)
        else:
            resp.conn.close()

    async def _send(self, request: bytes, connect_timeout: float, read_timeout: float) -> Response:
        while True:
            conn = await self._acquire(connect_timeout)
            try:
                return await self._exchange(conn, request, read_timeout)
            except (OSError, Http1Error):
                conn.close()
                # A kept-alive connection the worker closed while it sat idle fails before any
                # answer; the request never reached the worker, so a fresh connection may retry.
                if not conn.reused:
                    raise
            except BaseException:
                conn.close()
                raise

    async def _exchange(self, conn: _Conn, request: bytes, read_timeout: float) -> Response:
        conn.writer.write(request)
        # The write went straight to the socket unless it was full: wait only then (a lost
        # connection shows at the read below all the same).
        if conn.writer.transport.get_write_buffer_size():
            async with asyncio.timeout(read_timeout):
                await conn.writer.drain()
        parsed = _Parsed()
        parser = parsed.parser = httptools.HttpResponseParser(parsed)
        while not parsed.headers_done:
            await conn.feed(parser, read_timeout)
        parsed.status = parser.get_status_code()
        conn.reused = False  # answered: from here a failure is the worker's, never retried
        return Response(conn, parsed, parser)

    async def _acquire(self, connect_timeout: float) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if conn.alive():
                return conn
            conn.close()
        async with asyncio.timeout(connect_timeout):
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        return _Conn(reader, writer)


class _Post:
    """`Http1Pool.post`'s context: a class, not `asynccontextmanager`, as it runs every request."""

    def __init__(
        self, pool: Http1Pool, request: bytes, connect_timeout: float, headers_timeout: float
    ) -> None:
        self._pool = pool
        self._request = request
        self._timeouts = (connect_timeout, headers_timeout)
        self._resp: Response | None = None

    async def __aenter__(self) -> Response:
        self._resp = await self._pool._send(self._request, *self._timeouts)
        return self._resp

    async def __aexit__(self, *exc_info: object) -> None:
        self._pool.release(self._resp)
