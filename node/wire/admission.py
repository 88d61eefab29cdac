"""Who may be served: every request's key and certificate, checked before its route runs.

The decisions are ``protocol.wire.request_checks`` (sans-IO: headers and ``now`` in, who sent
it or the refusal out); this module is their aiohttp side: it reads the clock and the headers,
keeps the result in ``request[ADMITTED]``, and logs refusals.

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

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from node.wire.tls import origin
from node.wire.transport import Transport
from protocol.errors import RemoteProtocolError
from protocol.ids import peer_id_from_public_key
from protocol.wire.certificates import CERT_HEADER
from protocol.wire.membership import ManifestSigner, SwarmManifest
from protocol.wire.request_auth import AUTH_HEADER, NONCE_BYTES, RequestAuth, sealed_route
from protocol.wire.request_checks import (
    ANONYMOUS,
    Admitted,
    Refusals,
    RequestChecks,
    RequestHead,
)
from protocol.wire.request_checks import unbound_ok as _unbound_ok

__all__ = [
    "ADMITTED",
    "ANONYMOUS",
    "Admission",
    "Admitted",
    "Identification",
    "MemberAddresses",
    "request_headers",
    "sealed_request",
    "unbound_ok",
]

log = logging.getLogger(__name__)

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


def sealed_request(method: str, url: str) -> bool:
    """Whether a request of ``method`` to ``url`` goes to a route that verifies its sealed body
    (``protocol.wire.request_auth.sealed_route``): outside certified swarms it is sent without
    ``Atoll-Auth`` and ``Atoll-Certificate``."""
    return sealed_route(method, urlsplit(url).path)


def unbound_ok(request: web.Request) -> bool:
    """Whether ``request`` may carry an ``Atoll-Auth`` that names no recipient
    (``protocol.wire.request_checks.unbound_ok``)."""
    return _unbound_ok(request.method, request.path)


def head_of(request: web.Request) -> RequestHead:
    """What the checks read of ``request``."""
    return RequestHead(
        method=request.method,
        path=request.path,
        target=request.path_qs,
        remote=request.remote or "unknown",
        auth=request.headers.get(AUTH_HEADER),
        cert=request.headers.get(CERT_HEADER),
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


class Checked:
    """An aiohttp middleware that runs ``check`` on each request before its route, keeping who
    sent it in ``request[ADMITTED]``; a refusal goes to ``refused`` and is re-raised (the
    transport's guard answers it with its 4xx). ``admitted`` counts the requests let through."""

    def __init__(
        self,
        check: Callable[[web.Request], Admitted],
        refused: Callable[[web.Request, RemoteProtocolError], None],
    ) -> None:
        self.check, self.refused = check, refused
        self.admitted = 0

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            request[ADMITTED] = self.check(request)
        except RemoteProtocolError as exc:
            self.refused(request, exc)
            raise
        self.admitted += 1
        return await handler(request)


class Admission:
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
        self.checks = RequestChecks(own_id)
        self.replays = self.checks.replays
        self.refusals = Refusals()
        self.refused = self.refusals.by_reason  # reason -> requests
        self.refused_keys = self.refusals.by_key  # key hex -> reason
        self.checked = Checked(self.check, self.note_refusal)
        self.middleware = self.checked.middleware

    @property
    def admitted(self) -> int:
        return self.checked.admitted

    def check(self, request: web.Request) -> Admitted:
        """Who sent ``request`` (``RequestChecks.admit`` at the clock's time); raises
        ``NotAuthorized`` (403), ``BadSignature`` or ``AuthRefused`` (401: another node's header,
        an old version, a replay) or ``DecodeError`` (400) with the reason."""
        head = head_of(request)
        exempt = head.auth is None and self.exempt(request)
        return self.checks.admit(head, self.manifest(), exempt=exempt, now=self.clock())

    def note_refusal(self, request: web.Request, exc: RemoteProtocolError) -> None:
        who = self.refusals.note(head_of(request), exc.reason)
        log.info("refused %s %s from %s: %s", request.method, request.path, who[:16], exc.reason)

    def status(self) -> dict[str, object]:
        return {
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "refused_keys": dict(self.refused_keys),
            "auth_replays": self.replays.replays,
            "auth_cache": len(self.replays),
        }


class Identification:
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
        self.checks = RequestChecks(self.own_id)
        self.replays = self.checks.replays
        self.refusals = Refusals()
        self.refused = self.refusals.by_reason  # reason -> requests
        self.checked = Checked(self.check, self.note_refusal)
        self.middleware = self.checked.middleware

    @property
    def admitted(self) -> int:
        return self.checked.admitted

    def install(self, transport: Transport) -> None:
        """Sign our requests and check everyone's (before ``transport.start``)."""
        transport.authenticate = self.headers
        transport.admit_with(self.middleware)

    def headers(self, method: str, url: str, recipient: bytes | None = None) -> dict[str, str]:
        if sealed_request(method, url):
            return {}  # the envelope signs it; an unsigned request is served here all the same
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
        """The request's signer (``RequestChecks.identify`` at the clock's time); raises
        ``BadSignature`` or ``AuthRefused`` (401: another node's header, an old version, a
        replay), ``NotAuthorized`` (403: too far from our clock) or ``DecodeError`` (400) for a
        bad header."""
        return self.checks.identify(head_of(request), swarm=self.swarm, now=self.clock())

    def note_refusal(self, request: web.Request, exc: RemoteProtocolError) -> None:
        self.refusals.note(head_of(request), exc.reason)
        log.info("refused %s %s: %s", request.method, request.path, exc.reason)
