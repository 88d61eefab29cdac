"""Who sent a request, decided from its head at ``now``: the checks behind ``node.wire.admission``.

A request from a peer carries ``Atoll-Auth`` (``protocol.wire.request_auth.RequestAuth``) and
maybe ``Atoll-Certificate``. ``RequestChecks.admit`` decides for a swarm with a manifest: no
header is an anonymous learner where the manifest admits one (an ``open`` swarm, or an
``exempt`` route), else a refusal with the reason; a header must verify (this swarm, method,
target, time, the recipient it names), its certificate must pass ``certificates.admit`` (its
signature verified once and remembered by its bytes, bounded; the cheap checks on every request,
so a revocation takes effect on the key's next request), and the header is taken once
(``ReplayCache``, counted per sender address, ``netgroups.sender_key``). ``identify`` is the same
without a manifest (a development swarm: the header only). ``Refusals`` counts refusals by reason
and by key, bounded, for ``/v1/status``.

A refusal is the ``RemoteProtocolError`` the failed check raised: ``NotAuthorized`` (403),
``BadSignature`` or ``AuthRefused`` (401: another node's header, an old version, a replay) or
``DecodeError`` (400). Pure: headers, the manifest and ``now`` in; a decision out.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from protocol.dht.netgroups import sender_key
from protocol.wire.certificates import Certificate, admit
from protocol.wire.membership import SwarmManifest
from protocol.wire.request_auth import ReplayCache, RequestAuth

__all__ = [
    "ANONYMOUS",
    "CERTS_KEPT",
    "REFUSED_KEYS_KEPT",
    "Admitted",
    "RequestChecks",
    "RequestHead",
    "Refusals",
    "unbound_ok",
]

CERTS_KEPT = 4096
REFUSED_KEYS_KEPT = 1024

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


def unbound_ok(method: str, path: str) -> bool:
    """Whether a request may carry an ``Atoll-Auth`` that names no recipient (see above); every
    other route (fragments, state sync, long-polls) needs the header to name this node."""
    return (
        (method, path) in _UNBOUND_OK
        or (method == "POST" and path.startswith("/v1/dht/"))
        # an artifact proves itself by its hash (node.state.artifact_serve)
        or (method == "GET" and path.startswith("/v1/artifacts/"))
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestHead:
    """What the checks read of a request: ``target`` is its path and query as signed; ``auth``
    and ``cert`` its ``Atoll-Auth`` and ``Atoll-Certificate`` headers (None: absent);
    ``remote`` the sender's address."""

    method: str
    path: str
    target: str
    remote: str
    auth: str | None = None
    cert: str | None = None

    @property
    def key(self) -> str:
        """Who the head says sent it, for refusal counts: its header's key text, or
        ``anonymous@`` its address."""
        parts = (self.auth or "").split(" ")
        return parts[1][:64] if len(parts) > 1 else f"anonymous@{self.remote}"


@dataclass(frozen=True, slots=True)
class Admitted:
    """Who sent a request: their key and certificate (both None for an anonymous open-swarm learner)."""

    public_key: bytes | None
    cert: Certificate | None


ANONYMOUS = Admitted(None, None)


class RequestChecks:
    """The checks of requests to the node ``own_id`` (see the module docstring)."""

    def __init__(self, own_id: bytes, *, certs_kept: int = CERTS_KEPT) -> None:
        if certs_kept < 1:
            raise ValueError(f"certs_kept must be >= 1, not {certs_kept}")
        self.own_id, self.certs_kept = own_id, certs_kept
        self.replays = ReplayCache()
        self._verified: collections.OrderedDict[str, Certificate] = collections.OrderedDict()

    def admit(
        self, head: RequestHead, manifest: SwarmManifest, *, exempt: bool, now: float
    ) -> Admitted:
        """Who sent ``head`` in the swarm of ``manifest``; ``exempt``: its route serves anyone
        without a header. Raises the refusal (see the module docstring)."""
        if head.auth is None:
            if not exempt:
                admit(manifest, None, public_key=b"", role=None, now=now)
            return ANONYMOUS
        auth = self._verified_auth(head, head.auth, manifest.swarm_id, now)
        cert = self._certificate(manifest, auth, head.cert, now)  # a stranger hears why first
        self._take_once(auth, head, now)
        return Admitted(auth.public_key, cert)

    def identify(self, head: RequestHead, *, swarm: str, now: float) -> Admitted:
        """Who sent ``head`` in the development swarm ``swarm`` (no manifest: the header only);
        anonymous without one. Raises the refusal of a bad header."""
        if head.auth is None:
            return ANONYMOUS
        auth = self._verified_auth(head, head.auth, swarm, now)
        self._take_once(auth, head, now)
        return Admitted(auth.public_key, None)

    def _verified_auth(self, head: RequestHead, value: str, swarm: str, now: float) -> RequestAuth:
        auth = RequestAuth.parse(value)
        auth.verify(
            swarm=swarm,
            method=head.method,
            target=head.target,
            now=now,
            recipient=self.own_id,
            unbound_ok=True,
        )
        return auth

    def _certificate(
        self, manifest: SwarmManifest, auth: RequestAuth, value: str | None, now: float
    ) -> Certificate | None:
        """The sender's certificate checked against ``manifest`` (None: it sent none, which an
        open swarm admits); raises ``NotAuthorized`` with the reason."""
        if not value:
            admit(manifest, None, public_key=auth.public_key, role=None, now=now)
            return None
        known = self._verified.get(value)
        cert = known if known is not None else Certificate.from_header(value)
        admit(
            manifest,
            cert,
            public_key=auth.public_key,
            role=None,
            now=now,
            signature_verified=known is not None,
        )
        if known is None:
            self._verified[value] = cert
            while len(self._verified) > self.certs_kept:
                self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(value)
        return cert

    def _take_once(self, auth: RequestAuth, head: RequestHead, now: float) -> None:
        """After ``auth`` verified: refuse it on a route that needs a recipient when it names
        none, then take it once (per sender address). Raises ``AuthRefused``."""
        if not unbound_ok(head.method, head.path):
            auth.check_bound(self.own_id)
        self.replays.admit(auth, sender_key(head.remote or "unknown"), now)


class Refusals:
    """Refused requests counted by reason (its text before any ":", at most 80 characters) and
    the last reason per key (the ``keys_kept`` latest keys)."""

    def __init__(self, keys_kept: int = REFUSED_KEYS_KEPT) -> None:
        self.keys_kept = keys_kept
        self.by_reason: collections.Counter[str] = collections.Counter()
        self.by_key: collections.OrderedDict[str, str] = collections.OrderedDict()

    def note(self, head: RequestHead, reason: str) -> str:
        """Count a refusal of ``head`` for ``reason``; returns who it was (``RequestHead.key``)."""
        self.by_reason[reason.split(":")[0][:80]] += 1
        who = head.key
        self.by_key[who] = reason[:200]
        self.by_key.move_to_end(who)
        while len(self.by_key) > self.keys_kept:
            self.by_key.popitem(last=False)
        return who
