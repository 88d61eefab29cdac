"""The swarm's signed manifest as one node holds it: admission, request signing, spreading.

``SwarmCredentials`` binds a node to its swarm: the founder-signed manifest (replaced when a
newer version arrives), this peer's certificate, and the pieces that enforce them on the wire:

- ``admission``: the middleware that checks every incoming request's key and certificate
  (``node.wire.admission``); ``POST /v1/swarm/manifest`` is the one route a stranger may use,
  and only with the founder's signature in its head (below), and it is rate-limited.
- ``headers(method, url)``: ``Atoll-Auth`` and ``Atoll-Certificate`` for our own requests (in an
  open swarm no certificate, and neither header on the sealed DHT and RPC routes).
- ``GET /v1/swarm/manifest``: the manifest's TOML, so ``atoll join --swarm ID`` can fetch it from
  any member and check it against the id.
- ``POST /v1/swarm/manifest`` (``atoll swarm publish``): adopt a newer version signed by the
  founder for the same swarm and recipe. Members carry their manifest version in their records;
  a node that sees a higher one fetches it from that member (``adopt_from``), so a revocation
  reaches every member within a membership period or two.

A manifest post costs nothing before it proves itself. Its head must carry ``Atoll-Manifest-
Signature: <version> <sha256 of the body, hex> <signature, hex>``, the founder's Ed25519 signature
over (swarm id, version, body hash), checked before a byte of the body is read (in a certified
swarm a member's certificate-authenticated request may post without it); a post without one is a
401, one for a version we hold already is answered unread. Parsing a manifest's TOML took up to
1.7 s of a crafted 1 MiB body on the loop (a burst of 4 held a concurrent GET 2.75 s), so every
parse, a post's or a member's (``adopt_from``), runs in a worker thread, one at a time: a second
one meanwhile is refused at once (429), never queued. ``MAX_MANIFEST_BYTES`` (1 MiB) bounds a
body: a manifest of 256 authorities with 64-character lab names, 64 recipe fields and 10,000
revoked keys, written by ``tomli_w``, is 768,395 bytes (~70 bytes a revoked key).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable

import msgpack
import tomli_w
from aiohttp import web

from node.wire.admission import ADMITTED, Admission, Admitted, request_headers, sealed_request
from node.wire.transport import Busy, Transport
from protocol.dht.netgroups import sender_key
from protocol.dht.ratelimit import RateLimiter
from protocol.errors import BadSignature, DecodeError, NotAuthorized, Oversize, RemoteProtocolError
from protocol.wire.certificates import Certificate, check_certificate
from protocol.wire.membership import (
    MAX_MANIFEST_BYTES,
    ManifestSigner,
    SwarmManifest,
    verify_signature,
)
from protocol.wire.signing import Signer

__all__ = ["MANIFEST_PATH", "POST_SIGNATURE_HEADER", "SwarmCredentials", "manifest_post_headers"]

log = logging.getLogger(__name__)

MANIFEST_PATH = "/v1/swarm/manifest"
PUBLISH_PER_S = 0.5  # manifest posts per sender address (after a burst)
PUBLISH_BURST = 4
POST_SIGNATURE_HEADER = "Atoll-Manifest-Signature"
_POST_DOMAIN = "atoll/manifest-post/v1"
_POST_SIGNATURE = re.compile(r"([0-9]{1,19}) ([0-9a-f]{64}) ([0-9a-f]{128})")


def _post_signing_bytes(swarm_id: str, version: int, digest: bytes) -> bytes:
    return bytes(msgpack.packb([_POST_DOMAIN, swarm_id, version, digest], use_bin_type=True))


def manifest_post_headers(
    founder: ManifestSigner, manifest: SwarmManifest, body: bytes
) -> dict[str, str]:
    """The ``Atoll-Manifest-Signature`` header for posting ``body`` (``manifest``'s TOML) to a
    member: the founder's signature over the swarm id, the version and the body's SHA-256."""
    digest = hashlib.sha256(body).digest()
    sig = founder.sign(_post_signing_bytes(manifest.swarm_id, manifest.version, digest))
    return {POST_SIGNATURE_HEADER: f"{manifest.version} {digest.hex()} {sig.hex()}"}


def _parse_verified(text: bytes, swarm_id: str) -> SwarmManifest:
    """A manifest parsed and its founder's signature verified (in a worker thread: see the
    module docstring). Raises as ``SwarmManifest.from_toml`` and ``verify``."""
    manifest = SwarmManifest.from_toml(text)
    manifest.verify(expected_id=swarm_id)
    return manifest


class SwarmCredentials:
    """A node's manifest and certificate, and their enforcement (see the module docstring)."""

    def __init__(
        self,
        manifest: SwarmManifest,
        signer: Signer,
        cert: Certificate | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        manifest.verify()
        if cert is not None:
            check_certificate(manifest, cert, public_key=signer.public_key, role=None, now=clock())
        self.manifest, self.signer, self.cert, self.clock = manifest, signer, cert, clock
        self._cert_header = cert.to_header() if cert is not None else ""
        self.admission = Admission(
            lambda: self.manifest, own_id=signer.peer_id, exempt=self._exempt, clock=clock
        )
        self._publishes = RateLimiter(rate=PUBLISH_PER_S, burst=PUBLISH_BURST)
        self.on_adopt: list[Callable[[SwarmManifest], None]] = []
        self.adopted = 0
        self.parses = 0  # manifest TOML parsed (each in a worker thread, one at a time)
        self._parsing = asyncio.Semaphore(1)
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

    def headers(self, method: str, url: str, recipient: bytes | None = None) -> dict[str, str]:
        """``Atoll-Auth`` and, in a certified swarm, ``Atoll-Certificate`` for a request; none
        for an open swarm's DHT and RPC requests, whose sealed bodies sign them
        (``node.wire.admission.sealed_request``). An open swarm reads no certificate off a
        request (a member's certificate travels in its record), so it is never sent there."""
        if not self.certified and sealed_request(method, url):
            return {}
        return request_headers(
            self.signer,
            self._cert_header if self.certified else "",
            swarm=self.swarm_id,
            method=method,
            url=url,
            now=self.clock(),
            recipient=recipient,
        )

    @staticmethod
    def _exempt(request: web.Request) -> bool:
        return request.method == "POST" and request.path == MANIFEST_PATH

    def toml(self) -> str:
        return tomli_w.dumps(self.manifest.to_toml_data())

    async def parse(self, text: bytes) -> SwarmManifest:
        """``text`` parsed as a manifest of this swarm, its founder's signature verified, in a
        worker thread and one at a time. Raises ``Busy`` (429) at once while another parse runs,
        ``DecodeError``/``Oversize`` for a malformed manifest, ``BadSignature`` for one the founder
        did not sign, ``NotAuthorized`` for another swarm's."""
        if self._parsing.locked():
            raise Busy("another manifest is being checked; retry in a few seconds")
        async with self._parsing:
            self.parses += 1
            return await asyncio.to_thread(_parse_verified, bytes(text), self.swarm_id)

    async def offer(self, text: bytes) -> bool:
        """Adopt the manifest in ``text`` if it is a newer version of ours (True when adopted).
        Raises as ``parse`` and ``adopt``."""
        return self.adopt(await self.parse(text))

    def adopt(self, newer: SwarmManifest) -> bool:
        """Adopt ``newer`` (parsed and verified by ``parse``) if it is a newer version of ours
        (True when adopted). Raises ``NotAuthorized`` for another founder or a changed recipe."""
        if newer.founder != self.manifest.founder:
            raise NotAuthorized("manifest signed by another founder")
        if not self.manifest.superseded_by(newer):
            return False
        self.manifest = newer
        self.adopted += 1
        log.warning(
            "adopted swarm manifest version %d (%d authorities, %d revoked)",
            newer.version,
            len(newer.authorities),
            len(newer.revoked),
        )
        if self.cert is not None:
            try:
                check_certificate(
                    newer, self.cert, public_key=self.signer.public_key, role=None, now=self.clock()
                )
            except RemoteProtocolError as exc:
                log.error(
                    "our own certificate no longer holds under manifest version %d: %s",
                    newer.version,
                    exc.reason,
                )
        for callback in self.on_adopt:
            callback(newer)
        return True

    async def adopt_from(self, transport: Transport, url: str) -> bool:
        """Fetch a member's manifest and adopt it if newer; False (logged) on any failure (a
        parse already running included: a later membership pass tries again)."""
        try:
            async with transport.reply(
                "GET", url.rstrip("/") + MANIFEST_PATH, timeout_s=10, max_reply=MAX_MANIFEST_BYTES
            ) as r:
                if r.status != 200:
                    raise DecodeError(f"answered {r.status}")
                body = bytes(r.body)
            return await self.offer(body)
        except Exception as exc:  # a member that cannot hand it over: another will
            log.info("no newer manifest from %s: %r", url, exc)
            return False

    async def _on_get(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.toml(), content_type="application/toml")

    async def _on_post(self, request: web.Request) -> web.Response:
        """Everything a post can be refused for is checked before its body is read (see the
        module docstring); the body is then read, hashed against the signed hash and parsed.
        The connection closes after the reply: a refused body is not drained."""
        assert self._transport is not None
        self._transport.hang_up(request)
        if not self._publishes.allow(
            sender_key(request.remote or "unknown"), self.clock()
        ):  # IPv6 by its /64
            raise Busy("too many manifest posts from this address; retry in a few seconds")
        length = request.content_length
        if length is None or length > MAX_MANIFEST_BYTES:
            raise Oversize(
                f"a manifest post needs a Content-Length of at most {MAX_MANIFEST_BYTES} bytes"
            )
        signed = self._post_signature(request)
        if (
            signed is not None and signed[0] <= self.manifest.version
        ):  # a replayed older post: not read
            return self._answer(False)
        buf, used = await self._transport.read_request(request, MAX_MANIFEST_BYTES)
        try:
            body = bytes(memoryview(buf)[:used])
        finally:
            self._transport.pool.give(buf)
        if signed is not None and hashlib.sha256(body).digest() != signed[1]:
            raise BadSignature(
                "the manifest post's body is not the one its founder's signature names"
            )
        newer = await self.parse(body)
        if signed is not None and newer.version != signed[0]:
            raise BadSignature(
                f"the manifest is version {newer.version}, its post's signature names {signed[0]}"
            )
        return self._answer(self.adopt(newer))

    def _post_signature(self, request: web.Request) -> tuple[int, bytes] | None:
        """The (version, body SHA-256) a post's founder signature vouches for, or None for a
        certificate-authenticated request of a certified swarm (admission checked it). Raises
        ``BadSignature`` (401) without a valid signature, ``DecodeError`` (400) for a malformed one."""
        admitted = request.get(ADMITTED)
        if self.certified and isinstance(admitted, Admitted) and admitted.cert is not None:
            return None
        value = request.headers.get(POST_SIGNATURE_HEADER)
        if value is None:
            raise BadSignature(
                f"a manifest post needs the founder's signature in an {POST_SIGNATURE_HEADER} header "
                "(signed by: atoll swarm publish MANIFEST --founder KEY --peer URL)"
            )
        m = _POST_SIGNATURE.fullmatch(value.strip())
        if m is None:
            raise DecodeError(
                f"{POST_SIGNATURE_HEADER} must be '<version> <sha256 hex> <signature hex>'"
            )
        version, digest = int(m[1]), bytes.fromhex(m[2])
        verify_signature(
            self.manifest.founder,
            bytes.fromhex(m[3]),
            _post_signing_bytes(self.swarm_id, version, digest),
            "manifest post (founder's)",
        )
        return version, digest

    def _answer(self, adopted: bool) -> web.Response:
        return web.json_response(
            {"adopted": adopted, "version": self.manifest.version, "swarm": self.swarm_id}
        )

    def status(self) -> dict[str, object]:
        m = self.manifest
        return {
            "id": m.swarm_id,
            "name": m.name,
            "version": m.version,
            "admission": m.admission,
            "authorities": {a.lab: a.public_key.hex() for a in m.authorities},
            "revoked": len(m.revoked),
            "manifest_parses": self.parses,
            "lab": self.cert.lab if self.cert else None,
            "roles": list(self.cert.roles) if self.cert else [],
            **self.admission.status(),
        }
