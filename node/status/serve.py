"""``atoll status --serve``: a peer's status page and ``/metrics`` on this machine, signed for.

In a certified swarm a peer answers only signed requests, so a browser or Prometheus cannot read
its page or its metrics. ``StatusProxy`` serves the page and its script itself (the files a peer
serves) and asks the peer for the JSON the page polls and for ``/metrics``, signing each request
with the operator's key and certificate (``Atoll-Auth``, ``node.wire.admission``). It listens on
127.0.0.1 unless told otherwise, since whoever reaches it reads what that key may read; on a
loopback address it answers only requests whose ``Host`` names it, so a web page elsewhere cannot
read it through DNS rebinding.

Whom it asks: a signed request names the peer id of the node it means to reach. Over HTTPS a
peer's TLS key is its Atoll key (``node.wire.tls``): the first connection learns the key, the
requests name its peer id, and every later connection is pinned to it (a key that changes at
that address fails the request; restart to follow a peer that moved to a new key). Over plain
HTTP (an open swarm) the peer id is the one its signed ``/v1/status`` names.

A peer's refusal or silence is a 502 whose body says why (the peer's reason, or that it did not
answer within ``timeout_s``); the page shows the page's own "no answer" state meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from node.status.metrics import CONTENT_TYPE
from node.status.page import BOARD_PATH, METRICS_PATH, add_routes
from node.wire.admission import request_headers
from node.wire.tls import PinnedKey, client_context, spki_pin
from protocol.ids import peer_id_from_public_key
from protocol.wire.certificates import Certificate
from protocol.wire.signing import Signer

__all__ = ["PeerUnavailable", "StatusProxy"]

STATUS_PATH = "/v1/status"
MAX_ANSWER_BYTES = 16 << 20
IN_FLIGHT = 4  # requests to the peer at once; more visitors wait their turn


class PeerUnavailable(web.HTTPBadGateway):
    """The peer refused or did not answer (a 502 with the reason as its body)."""

    def __init__(self, reason: str) -> None:
        super().__init__(text=reason)
        self.reason_text = reason

    def __str__(self) -> str:
        return self.reason_text


class StatusProxy:
    """Serves ``peer``'s page and metrics, each request to the peer signed (see the module
    docstring). ``start`` checks the peer answers before it listens; ``close`` stops."""

    def __init__(
        self,
        peer: str,
        *,
        swarm: str,
        signer: Signer,
        cert: Certificate | None,
        timeout_s: float = 10.0,
    ) -> None:
        self.peer = peer.rstrip("/")
        self.swarm, self.signer, self.timeout_s = swarm, signer, timeout_s
        self._cert_header = cert.to_header() if cert is not None else ""
        self.peer_id: bytes | None = None
        self._tls: ssl.SSLContext | PinnedKey | bool = True
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._in_flight = asyncio.Semaphore(IN_FLIGHT)
        self._hosts: set[str] | None = None  # Host headers answered (None: any)
        self.app = web.Application(middlewares=[self._host_check])
        add_routes(
            self.app,
            board=self._asker(BOARD_PATH),
            metrics=self._asker(METRICS_PATH),
            metrics_type=CONTENT_TYPE,
        )

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Learn who the peer is, check it answers our signed request, then listen on
        ``host:port`` (port 0: any free port); returns the page's URL. Raises ``PeerUnavailable``
        when the peer refuses or does not answer, ``OSError`` when the address cannot be bound."""
        self._session = aiohttp.ClientSession()
        try:
            await self._identify()
            await self.get(BOARD_PATH)
            self._runner = web.AppRunner(self.app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port)
            await site.start()
        except BaseException:
            await self.close()
            raise
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        shown = f"[{host}]" if ":" in host else host
        if _loopback(host):
            self._hosts = {f"{h}:{bound}" for h in (shown, "localhost", "127.0.0.1", "[::1]")}
        return f"http://{shown}:{bound}/"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, path: str) -> bytes:
        """The peer's answer to a signed ``GET path``; raises ``PeerUnavailable`` unless 200."""
        status, body = await self._request(path, self.peer_id)
        if status != 200:
            raise PeerUnavailable(
                f"{self.peer}{path} answered {status}: {_reason(body)}"
                + ("; check --key, --cert and --manifest" if status in (401, 403) else "")
            )
        return body

    def _asker(self, path: str) -> Callable[[], Awaitable[bytes]]:
        async def ask() -> bytes:
            return await self.get(path)

        return ask

    async def _request(self, path: str, recipient: bytes | None) -> tuple[int, bytes]:
        assert self._session is not None, "start() first"
        url = self.peer + path
        headers = request_headers(
            self.signer,
            self._cert_header,
            swarm=self.swarm,
            method="GET",
            url=url,
            now=time.time(),
            recipient=recipient,
        )
        try:
            async with (
                self._in_flight,
                asyncio.timeout(self.timeout_s),
                self._session.get(
                    url, headers=headers, ssl=self._tls, allow_redirects=False
                ) as resp,
            ):
                status, body = resp.status, bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        break
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            why = str(exc) or f"no answer within {self.timeout_s:g} s"
            raise PeerUnavailable(f"{self.peer} did not answer: {' '.join(why.split())}") from None
        if len(body) > MAX_ANSWER_BYTES:
            raise PeerUnavailable(f"{url} answered more than {MAX_ANSWER_BYTES} bytes")
        return status, bytes(body)

    async def _identify(self) -> None:
        """The peer's id, from its TLS key (HTTPS, then pinned) or its signed ``/v1/status``."""
        parts = urlsplit(self.peer)
        if parts.scheme == "https":
            der = await self._tls_certificate(parts.hostname or "", parts.port or 443)
            key = x509.load_der_x509_certificate(der).public_key()
            if not isinstance(key, Ed25519PublicKey):
                raise PeerUnavailable(
                    f"{self.peer} is not an Atoll peer (its TLS key is not Ed25519)"
                )
            self.peer_id = peer_id_from_public_key(key.public_bytes(Encoding.Raw, PublicFormat.Raw))
            self._tls = PinnedKey(spki_pin(der))
            return
        self._tls = False
        status, body = await self._request(STATUS_PATH, None)
        try:
            self.peer_id = bytes.fromhex(json.loads(body)["peer_id"]) if status == 200 else None
        except (ValueError, KeyError, TypeError):
            self.peer_id = None
        if self.peer_id is None or len(self.peer_id) != 32:
            raise PeerUnavailable(
                f"{self.peer}{STATUS_PATH} answered {status} without a peer id: {_reason(body)}"
            )

    async def _tls_certificate(self, host: str, port: int) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                _, writer = await asyncio.open_connection(host, port, ssl=client_context())
        except (OSError, TimeoutError) as exc:
            why = str(exc) or f"no answer within {self.timeout_s:g} s"
            raise PeerUnavailable(f"{self.peer} did not answer: {' '.join(why.split())}") from None
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.close()
        if not der:
            raise PeerUnavailable(f"{self.peer} showed no TLS certificate")
        return bytes(der)

    @web.middleware
    async def _host_check(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self._hosts is not None and request.host not in self._hosts:
            raise web.HTTPMisdirectedRequest(
                text=f"this server answers requests for {sorted(self._hosts)[0]} only"
            )
        return await handler(request)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reason(body: bytes) -> str:
    """A peer's answer body as one short line (the ``reason`` or ``error`` of a JSON body)."""
    text = body[:2000].decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        text = str(data.get("reason") or data.get("error") or text)
    return " ".join(text.split())[:300] or "(no reason given)"
