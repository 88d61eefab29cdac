"""The swarm's signed manifest as one node holds it: admission, request signing, spreading.

``SwarmCredentials`` binds a node to its swarm: the founder-signed manifest (replaced when a
newer version arrives), this peer's certificate, and the pieces that enforce them on the wire:

- ``admission``: the middleware that checks every incoming request's key and certificate
  (``node.wire.admission``); ``POST /v1/swarm/manifest`` is the one route a stranger may use,
  since what it carries proves itself (the founder's signature), and it is rate-limited.
- ``headers(method, url)``: ``Atoll-Auth`` and ``Atoll-Certificate`` for our own requests.
- ``GET /v1/swarm/manifest``: the manifest's TOML, so ``atoll join --swarm ID`` can fetch it from
  any member and check it against the id.
- ``POST /v1/swarm/manifest`` (``atoll swarm publish``): adopt a newer version signed by the
  founder for the same swarm and recipe. Members carry their manifest version in their records;
  a node that sees a higher one fetches it from that member (``adopt_from``), so a revocation
  reaches every member within a membership period or two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import tomli_w
from aiohttp import web

from node.wire.admission import Admission, request_headers
from node.wire.connections import address_key
from node.wire.transport import Transport
from protocol.dht.ratelimit import RateLimiter
from protocol.errors import DecodeError, NotAuthorized, Oversize, RemoteProtocolError
from protocol.wire.certificates import Certificate, check_certificate
from protocol.wire.membership import MAX_MANIFEST_BYTES, SwarmManifest
from protocol.wire.signing import Signer

__all__ = ["MANIFEST_PATH", "SwarmCredentials"]

log = logging.getLogger(__name__)

MANIFEST_PATH = "/v1/swarm/manifest"
PUBLISH_PER_S = 0.5  # manifest posts per sender address (after a burst)
PUBLISH_BURST = 4


class SwarmCredentials:
    """A node's manifest and certificate, and their enforcement (see the module docstring)."""

    def __init__(self, manifest: SwarmManifest, signer: Signer, cert: Certificate | None, *,
                 clock: Callable[[], float] = time.time) -> None:
        manifest.verify()
        if cert is not None:
            check_certificate(manifest, cert, public_key=signer.public_key, role=None, now=clock())
        self.manifest, self.signer, self.cert, self.clock = manifest, signer, cert, clock
        self._cert_header = cert.to_header() if cert is not None else ""
        self.admission = Admission(lambda: self.manifest, exempt=self._exempt, clock=clock)
        self._publishes = RateLimiter(rate=PUBLISH_PER_S, burst=PUBLISH_BURST)
        self.on_adopt: list[Callable[[SwarmManifest], None]] = []
        self.adopted = 0
        self._transport: Transport | None = None

    @property
    def certified(self) -> bool:
        return self.manifest.admission == "certified"

    @property
    def swarm_id(self) -> str:
        return self.manifest.swarm_id

    def install(self, transport: Transport) -> None:
        """Sign our requests, check everyone's, and serve the manifest routes (before start)."""
        self._transport = transport
        transport.authenticate = self.headers
        transport.admit_with(self.admission.middleware)
        transport.app.router.add_get(MANIFEST_PATH, self._on_get)
        transport.app.router.add_post(MANIFEST_PATH, self._on_post)

    def headers(self, method: str, url: str) -> dict[str, str]:
        return request_headers(self.signer, self._cert_header, swarm=self.swarm_id, method=method, url=url,
                               now=self.clock())

    @staticmethod
    def _exempt(request: web.Request) -> bool:
        return request.method == "POST" and request.path == MANIFEST_PATH

    def toml(self) -> str:
        return tomli_w.dumps(self.manifest.to_toml_data())

    def offer(self, text: bytes | str) -> bool:
        """Adopt the manifest in ``text`` if it is a newer version of ours (True when adopted).

        Raises ``DecodeError``/``Oversize`` for a malformed one, ``BadSignature`` for one the
        founder did not sign, ``NotAuthorized`` for another swarm or a changed recipe."""
        newer = SwarmManifest.from_toml(text)
        newer.verify(expected_id=self.swarm_id)
        if newer.founder != self.manifest.founder:
            raise NotAuthorized("manifest signed by another founder")
        if not self.manifest.superseded_by(newer):
            return False
        self.manifest = newer
        self.adopted += 1
        log.warning("adopted swarm manifest version %d (%d authorities, %d revoked)", newer.version,
                    len(newer.authorities), len(newer.revoked))
        if self.cert is not None:
            try:
                check_certificate(newer, self.cert, public_key=self.signer.public_key, role=None, now=self.clock())
            except RemoteProtocolError as exc:
                log.error("our own certificate no longer holds under manifest version %d: %s",
                          newer.version, exc.reason)
        for callback in self.on_adopt:
            callback(newer)
        return True

    async def adopt_from(self, transport: Transport, url: str) -> bool:
        """Fetch a member's manifest and adopt it if newer; False (logged) on any failure."""
        try:
            status, buf, used, _ = await transport.request("GET", url.rstrip("/") + MANIFEST_PATH, timeout_s=10,
                                                           max_reply=MAX_MANIFEST_BYTES)
            try:
                body = bytes(memoryview(buf)[:used])
            finally:
                transport.pool.give(buf)
            if status != 200:
                raise DecodeError(f"answered {status}")
            return self.offer(body)
        except Exception as exc:  # a member that cannot hand it over: another will
            log.info("no newer manifest from %s: %r", url, exc)
            return False

    async def _on_get(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.toml(), content_type="application/toml")

    async def _on_post(self, request: web.Request) -> web.Response:
        if not self._publishes.allow(address_key(request.remote or "unknown"), self.clock()):  # IPv6 by its /64
            raise NotAuthorized("too many manifest posts from this address; retry in a few seconds")
        length = request.content_length
        if length is None or length > MAX_MANIFEST_BYTES:
            raise Oversize(f"a manifest post needs a Content-Length of at most {MAX_MANIFEST_BYTES} bytes")
        assert self._transport is not None
        buf, used = await self._transport.read_request(request, MAX_MANIFEST_BYTES)
        try:
            body = bytes(memoryview(buf)[:used])
        finally:
            self._transport.pool.give(buf)
        adopted = self.offer(body)
        return web.json_response({"adopted": adopted, "version": self.manifest.version,
                                  "swarm": self.swarm_id})

    def status(self) -> dict[str, object]:
        m = self.manifest
        return {"id": m.swarm_id, "name": m.name, "version": m.version, "admission": m.admission,
                "authorities": {a.lab: a.public_key.hex() for a in m.authorities}, "revoked": len(m.revoked),
                "lab": self.cert.lab if self.cert else None,
                "roles": list(self.cert.roles) if self.cert else [],
                **self.admission.status()}
