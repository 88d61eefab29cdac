"""Who may be served: every request's key and certificate, checked before its route runs.

Requests from peers carry two headers (``protocol.wire.request_auth.RequestAuth``): ``Atoll-Auth``
(the sender's key signs the swarm id, method, path, time, the peer id of the node it means to
reach and a nonce) and ``Atoll-Certificate``. The
``Admission`` middleware checks both against the node's current manifest before any route reads a
body or serves a byte: in a ``certified`` swarm a request without a valid certificate is a 403
with the reason ("certificate expired", "issuer … not an authority of this swarm", "revoked");
in an ``open`` swarm a request without headers is served as an anonymous learner, and one with
bad headers is refused all the same.

A certificate's signature is verified once and remembered by its bytes (bounded); the cheap
checks (validity period, revocation, issuer still an authority) run on every request, so a
manifest that revokes a key takes effect on that key's next request. Refusals are counted by
reason and by key (bounded), for ``/v1/status``.

Replay: a header must name this node's peer id, except on the routes a client reaches before it
knows whom it reaches (``unbound_ok``: first contact with an initial peer's URL), and each
header is taken once (``ReplayCache``, bounded, per sender address). A client learns the peer
id behind an address from the member records (``MemberAddresses``, the transport's
``recipient_of``).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import web

from node.wire.connections import address_key
from node.wire.tls import origin
from protocol.errors import RemoteProtocolError
from protocol.ids import peer_id_from_public_key
from protocol.wire.certificates import CERT_HEADER, Certificate, admit
from protocol.wire.membership import ManifestSigner, SwarmManifest
from protocol.wire.request_auth import AUTH_HEADER, NONCE_BYTES, ReplayCache, RequestAuth

if TYPE_CHECKING:
    from node.wire.transport import Transport

__all__ = [
    "ADMITTED",
    "Admission",
    "Admitted",
    "Identification",
    "MemberAddresses",
    "request_headers",
    "unbound_ok",
]

log = logging.getLogger(__name__)

CERTS_KEPT = 4096
REFUSED_KEYS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class Admitted:
    """Who sent a request: their key and certificate (both None for an anonymous open-swarm learner)."""

    public_key: bytes | None
    cert: Certificate | None


ANONYMOUS = Admitted(None, None)
# where a request's ``Admitted`` is kept for its route (aiohttp >= 3.12 types request keys)
ADMITTED: Any = (
    web.RequestKey("atoll_admitted", Admitted) if hasattr(web, "RequestKey") else "atoll_admitted"
)


def request_headers(
    signer: ManifestSigner,
    cert_header: str,
    *,
    swarm: str,
    method: str,
    url: str,
    now: float,
    recipient: bytes | None = None,
) -> dict[str, str]:
    """``Atoll-Auth`` for a request of ``method`` to ``url`` at the node whose peer id is
    ``recipient`` (None: not known yet, which only first-contact routes accept, see
    ``unbound_ok``), with a fresh nonce; and the certificate, if any."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    out = {
        AUTH_HEADER: RequestAuth.make(
            signer,
            swarm=swarm,
            method=method,
            target=target,
            now=now,
            recipient=recipient,
            nonce=os.urandom(NONCE_BYTES),
        )
    }
    if cert_header:
        out[CERT_HEADER] = cert_header
    return out


# Routes a client may sign for without knowing the peer id it reaches (first contact with an
# initial peer's URL, ``atoll status``): what they answer is public to members or proves itself,
# and the DHT's and RPC's bodies are signed envelopes that name their recipient themselves.
_UNBOUND_OK = {
    ("GET", "/v1/swarm/manifest"),
    ("POST", "/v1/swarm/manifest"),
    ("GET", "/v1/members"),
    ("GET", "/v1/dialback"),
    ("GET", "/v1/status"),
    ("POST", "/v1/rpc"),
    ("POST", "/v1/dht"),
}


def unbound_ok(request: web.Request) -> bool:
    """Whether ``request`` may carry an ``Atoll-Auth`` that names no recipient (see above); every
    other route (fragments, state sync, long-polls) needs the header to name this node."""
    path = request.path
    return (request.method, path) in _UNBOUND_OK or (
        request.method == "POST" and path.startswith("/v1/dht/")
    )


class MemberAddresses:
    """The peer id expected at a URL, from the member records: the transport's ``recipient_of``,
    so our headers name the node we mean to reach. The index is rebuilt when the member list is
    replaced (each membership read), not per request."""

    def __init__(self, members: Callable[[], Mapping[bytes, Any]]) -> None:
        self.members = members
        self._seen: object = None
        self._index: dict[str, bytes] = {}

    def __call__(self, url: str) -> bytes | None:
        members = self.members()
        if members is not self._seen:
            self._seen = members
            self._index = {origin(m.record.url): pid for pid, m in members.items() if m.record.url}
        return self._index.get(origin(url))


class _Checks:
    """The middleware of ``Admission`` and ``Identification``: ``check`` each request before its
    route runs, keeping who sent it in ``request[ADMITTED]``; a refusal is noted and re-raised
    (the transport's guard answers it with its 4xx)."""

    admitted = 0

    def check(self, request: web.Request) -> Admitted:
        raise NotImplementedError

    def note_refusal(self, request: web.Request, exc: RemoteProtocolError) -> None:
        raise NotImplementedError

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            request[ADMITTED] = self.check(request)
        except RemoteProtocolError as exc:
            self.note_refusal(request, exc)
            raise
        self.admitted += 1
        return await handler(request)


class Admission(_Checks):
    """Checks requests against ``manifest()``; ``exempt(request)`` names routes anyone may use."""

    def __init__(
        self,
        manifest: Callable[[], SwarmManifest],
        *,
        own_id: bytes,
        exempt: Callable[[web.Request], bool] = lambda _r: False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.manifest, self.own_id, self.exempt, self.clock = manifest, own_id, exempt, clock
        self.replays = ReplayCache()
        self._verified: collections.OrderedDict[str, Certificate] = collections.OrderedDict()
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> requests
        self.refused_keys: collections.OrderedDict[str, str] = (
            collections.OrderedDict()
        )  # key hex -> reason
        self.admitted = 0

    def check(self, request: web.Request) -> Admitted:
        """Who sent ``request``; raises ``NotAuthorized`` (403), ``BadSignature`` or ``AuthRefused``
        (401: another node's header, an old version, a replay) or ``DecodeError`` (400) with the
        reason."""
        manifest = self.manifest()
        auth_value = request.headers.get(AUTH_HEADER)
        if auth_value is None:
            if self.exempt(request):
                return ANONYMOUS
            admit(manifest, None, public_key=b"", role=None, now=self.clock())
            return ANONYMOUS
        auth = RequestAuth.parse(auth_value)
        now = self.clock()
        auth.verify(
            swarm=manifest.swarm_id,
            method=request.method,
            target=request.path_qs,
            now=now,
            recipient=self.own_id,
            unbound_ok=True,
        )
        cert = self._admit(
            manifest, auth, request.headers.get(CERT_HEADER), now
        )  # a stranger hears why first
        _take_once(auth, request, self.replays, own_id=self.own_id, now=now)
        return Admitted(auth.public_key, cert)

    def _admit(
        self, manifest: SwarmManifest, auth: RequestAuth, cert_value: str | None, now: float
    ) -> Certificate | None:
        """The sender's certificate checked against ``manifest`` (None: it sent none, which an
        open swarm admits); raises ``NotAuthorized`` with the reason."""
        if not cert_value:
            admit(manifest, None, public_key=auth.public_key, role=None, now=now)
            return None
        known = self._verified.get(cert_value)
        cert = known if known is not None else Certificate.from_header(cert_value)
        admit(
            manifest,
            cert,
            public_key=auth.public_key,
            role=None,
            now=now,
            signature_verified=known is not None,
        )
        if known is None:
            self._verified[cert_value] = cert
            while len(self._verified) > CERTS_KEPT:
                self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(cert_value)
        return cert

    def note_refusal(self, request: web.Request, exc: RemoteProtocolError) -> None:
        self.refused[exc.reason.split(":")[0][:80]] += 1
        key = request.headers.get(AUTH_HEADER, "").split(" ")
        who = key[1][:64] if len(key) > 1 else f"anonymous@{request.remote}"
        self.refused_keys[who] = exc.reason[:200]
        self.refused_keys.move_to_end(who)
        while len(self.refused_keys) > REFUSED_KEYS_KEPT:
            self.refused_keys.popitem(last=False)
        log.info("refused %s %s from %s: %s", request.method, request.path, who[:16], exc.reason)

    def status(self) -> dict[str, object]:
        return {
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "refused_keys": dict(self.refused_keys),
            "auth_replays": self.replays.replays,
            "auth_cache": len(self.replays),
        }


class Identification(_Checks):
    """Who asks, in a development swarm (no manifest, so no admission): requests that carry an
    ``Atoll-Auth`` header are checked (the sender's key signed this swarm's name, the method,
    path and time: a bad signature is a 401, a stale one a 403, as with ``Admission``) and served
    as that key; requests without one as anonymous. Owners then know which member asks, as in a signed
    swarm: its replica's learner takes a version from the handoff instead of downloading it,
    and versions spread peer to peer instead of all coming from their owner.

    ``headers`` signs our own requests the same way (``Transport.authenticate``)."""

    def __init__(
        self, signer: ManifestSigner, swarm: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.signer, self.swarm, self.clock = signer, swarm, clock
        self.own_id = peer_id_from_public_key(signer.public_key)
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> requests
        self.replays = ReplayCache()

    def install(self, transport: Transport) -> None:
        """Sign our requests and check everyone's (before ``transport.start``)."""
        transport.authenticate = self.headers
        transport.admit_with(self.middleware)

    def headers(self, method: str, url: str, recipient: bytes | None = None) -> dict[str, str]:
        return request_headers(
            self.signer,
            "",
            swarm=self.swarm,
            method=method,
            url=url,
            now=self.clock(),
            recipient=recipient,
        )

    def check(self, request: web.Request) -> Admitted:
        """The request's signer; raises ``BadSignature`` or ``AuthRefused`` (401: another node's
        header, an old version, a replay), ``NotAuthorized`` (403: too far from our clock) or
        ``DecodeError`` (400) for a bad header."""
        value = request.headers.get(AUTH_HEADER)
        if value is None:
            return ANONYMOUS
        auth = RequestAuth.parse(value)
        now = self.clock()
        auth.verify(
            swarm=self.swarm,
            method=request.method,
            target=request.path_qs,
            now=now,
            recipient=self.own_id,
            unbound_ok=True,
        )
        _take_once(auth, request, self.replays, own_id=self.own_id, now=now)
        return Admitted(auth.public_key, None)

    def note_refusal(self, request: web.Request, exc: RemoteProtocolError) -> None:
        self.refused[exc.reason.split(":")[0][:80]] += 1
        log.info("refused %s %s: %s", request.method, request.path, exc.reason)


def _take_once(
    auth: RequestAuth, request: web.Request, replays: ReplayCache, *, own_id: bytes, now: float
) -> None:
    """After ``auth`` verified: refuse it on a route that needs a recipient when it names none,
    then take it once (``replays``, counted per sender address). Raises ``AuthRefused``."""
    if not unbound_ok(request):
        auth.check_bound(own_id)
    replays.admit(auth, address_key(request.remote or "unknown"), now)
