"""One bounded HTTP(S) exchange with a peer (``http_fetch``): the whole answer within a deadline,
or ``SlowAnswer``. Used by ``atoll join``/``status`` (``node.run.join``) and ``atoll admin``."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from urllib.parse import urlsplit

from node.wire.tls import client_context

__all__ = ["ERROR_BODY_BYTES", "SlowAnswer", "http_fetch"]

ERROR_BODY_BYTES = 4096  # of a 4xx/5xx answer: its reason


class SlowAnswer(TimeoutError):
    """A peer's answer that was not whole within the deadline (one trickling a byte a second, say)."""


def http_fetch(
    url: str,
    *,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    limit: int = 16 << 20,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """One HTTP(S) exchange, all of it (connecting, sending, the answer's head and at most ``limit``
    bytes of its body, ``ERROR_BODY_BYTES`` of an error's) within ``timeout`` s: a socket timeout
    bounds each read only, and a peer trickling a byte a second held ``urlopen`` for ever. Past
    the deadline a watchdog shuts the socket. TLS without a pin: what matters is checked by
    signature. Returns (status, body) for any status; raises ``OSError`` when there is no whole
    answer (``SlowAnswer`` past the deadline)."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = (
        http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=timeout, context=client_context()
        )
        if parts.scheme == "https"
        else http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    )
    expired = threading.Event()
    connected: list[socket.socket] = []  # the socket: a response that closes takes it from conn

    def expire() -> None:
        expired.set()
        for sock in connected:  # wakes a read blocked on the socket (TLS too: the same descriptor)
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, expire)
    watchdog.start()
    try:
        conn.connect()  # bounded by the socket timeout; from here on the watchdog can reach the socket
        connected.append(conn.sock)
        if expired.is_set():
            raise SlowAnswer(f"no whole answer within {timeout:g} s")
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read(limit if resp.status < 400 else min(limit, ERROR_BODY_BYTES))
        if expired.is_set():  # the watchdog's shutdown reads as the end of the body: a cut answer
            raise SlowAnswer(f"no whole answer within {timeout:g} s")
        return resp.status, data
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise SlowAnswer(f"no whole answer within {timeout:g} s") from None
        if isinstance(exc, OSError):
            raise
        raise ConnectionError(f"not an HTTP answer ({type(exc).__name__})") from None
    finally:
        watchdog.cancel()
        watchdog.join()
        conn.close()
