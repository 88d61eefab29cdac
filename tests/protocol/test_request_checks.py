"""Who sent a request (``protocol.wire.request_checks``): admission and identification decided
from a request's head and a fake clock, no server."""

from __future__ import annotations

import dataclasses
import os

import pytest

from protocol.errors import BadSignature, NotAuthorized
from protocol.ids import peer_id_from_public_key
from protocol.wire.membership import SwarmManifest
from protocol.wire.request_auth import NONCE_BYTES, AuthRefused, RequestAuth
from protocol.wire.request_checks import (
    ANONYMOUS,
    Refusals,
    RequestChecks,
    RequestHead,
    unbound_ok,
)
from protocol.wire.signing import Signer
from tests.protocol.swarm_keys import NOW, cert, key

SERVER = bytes(range(32))
FRAGMENT = "/v1/fragments/0/latest"


def _head(
    signer: Signer | None,
    swarm: str,
    *,
    now: float = NOW,
    path: str = FRAGMENT,
    recipient: bytes | None = SERVER,
    cert_header: str | None = None,
    remote: str = "203.0.113.7",
) -> RequestHead:
    auth = (
        None
        if signer is None
        else RequestAuth.make(
            signer,
            swarm=swarm,
            method="GET",
            target=path,
            now=now,
            recipient=recipient,
            nonce=os.urandom(NONCE_BYTES),
        )
    )
    return RequestHead(
        method="GET", path=path, target=path, remote=remote, auth=auth, cert=cert_header
    )


def _open(m: SwarmManifest) -> SwarmManifest:
    return dataclasses.replace(m, admission="open")


def test_an_open_swarm_serves_the_anonymous_and_a_certified_one_only_exempt_routes(swarm) -> None:
    _, _, _, m = swarm
    checks = RequestChecks(SERVER)
    assert checks.admit(_head(None, m.swarm_id), _open(m), exempt=False, now=NOW) is ANONYMOUS
    with pytest.raises(NotAuthorized, match="no certificate"):
        checks.admit(_head(None, m.swarm_id), m, exempt=False, now=NOW)
    assert checks.admit(_head(None, m.swarm_id), m, exempt=True, now=NOW) is ANONYMOUS


def test_a_certified_member_is_admitted_until_its_certificate_expires(swarm) -> None:
    _, lab_a, _, m = swarm
    peer = key()
    header = cert(lab_a, m, peer, days=1.0).to_header()
    checks = RequestChecks(SERVER)
    who = checks.admit(_head(peer, m.swarm_id, cert_header=header), m, exempt=False, now=NOW)
    assert who.public_key == peer.public_key and who.cert is not None
    assert peer_id_from_public_key(who.public_key) == who.cert.peer_id
    later = NOW + 2 * 86400  # the fake clock moves on: the remembered certificate is checked again
    with pytest.raises(NotAuthorized, match="expired"):
        checks.admit(
            _head(peer, m.swarm_id, cert_header=header, now=later), m, exempt=False, now=later
        )
    revoked = m.with_revoked(peer.public_key)
    with pytest.raises(NotAuthorized, match="revoked"):
        checks.admit(_head(peer, m.swarm_id, cert_header=header), revoked, exempt=False, now=NOW)


def test_a_header_is_checked_against_the_clock_the_node_and_its_past(swarm) -> None:
    _, _, _, m = swarm
    checks, peer = RequestChecks(SERVER), key()
    stale = _head(peer, m.swarm_id, now=NOW - 3600)
    with pytest.raises(NotAuthorized, match="clock"):
        checks.identify(stale, swarm=m.swarm_id, now=NOW)
    with pytest.raises(BadSignature):
        checks.identify(_head(peer, "another swarm"), swarm=m.swarm_id, now=NOW)
    with pytest.raises(AuthRefused, match="not this node"):
        checks.identify(_head(peer, m.swarm_id, recipient=bytes(32)), swarm=m.swarm_id, now=NOW)
    head = _head(peer, m.swarm_id)
    assert checks.identify(head, swarm=m.swarm_id, now=NOW).public_key == peer.public_key
    with pytest.raises(AuthRefused, match="used before"):
        checks.identify(head, swarm=m.swarm_id, now=NOW + 1)
    assert checks.replays.replays == 1
    assert checks.identify(_head(None, m.swarm_id), swarm=m.swarm_id, now=NOW) is ANONYMOUS


def test_a_header_naming_no_node_is_taken_on_first_contact_routes_only(swarm) -> None:
    _, _, _, m = swarm
    checks, peer = RequestChecks(SERVER), key()
    unbound = _head(peer, m.swarm_id, recipient=None)
    with pytest.raises(AuthRefused):
        checks.admit(unbound, _open(m), exempt=False, now=NOW)
    status = _head(peer, m.swarm_id, recipient=None, path="/v1/status")
    assert checks.admit(status, _open(m), exempt=False, now=NOW).public_key == peer.public_key
    assert unbound_ok("POST", "/v1/dht/7") and not unbound_ok("GET", FRAGMENT)


def test_refusals_are_counted_by_reason_and_the_latest_keys_only() -> None:
    refusals = Refusals(keys_kept=2)
    for i in range(3):
        head = RequestHead(method="GET", path="/", target="/", remote=f"192.0.2.{i}")
        assert refusals.note(head, f"certificate expired: at {i}") == f"anonymous@192.0.2.{i}"
    assert refusals.by_reason == {"certificate expired": 3}
    assert list(refusals.by_key) == ["anonymous@192.0.2.1", "anonymous@192.0.2.2"]
