"""The Atoll-Auth request header: what it binds, parsing anything (pure, fake time)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import BadSignature, DecodeError, NotAuthorized, Oversize
from protocol.wire.request_auth import MAX_SKEW_S, AuthRefused, ReplayCache, RequestAuth
from tests.protocol.swarm_keys import NOW, key

SERVER = bytes(range(32))  # the peer id of the node a header is meant for
OTHER = bytes(32)
TARGET = "/v1/fragments/0/latest"


def _header(
    signer,
    swarm: str,
    *,
    recipient: bytes | None = SERVER,
    nonce: bytes = b"n" * 16,
    now: float = NOW,
    target: str = TARGET,
) -> RequestAuth:
    return RequestAuth.parse(
        RequestAuth.make(
            signer,
            swarm=swarm,
            method="GET",
            target=target,
            now=now,
            recipient=recipient,
            nonce=nonce,
        )
    )


def test_request_auth_binds_swarm_method_target_and_time(swarm):
    _, _, _, m = swarm
    peer = key()
    auth = _header(peer, m.swarm_id)
    assert auth.public_key == peer.public_key
    auth.verify(swarm=m.swarm_id, method="GET", target=TARGET, now=NOW + 5, recipient=SERVER)
    with pytest.raises(BadSignature):
        auth.verify(
            swarm=m.swarm_id,
            method="GET",
            target="/v1/fragments/1/latest",
            now=NOW,
            recipient=SERVER,
        )
    with pytest.raises(BadSignature):
        auth.verify(swarm="11" * 16, method="GET", target=TARGET, now=NOW, recipient=SERVER)
    with pytest.raises(NotAuthorized, match="clock"):
        auth.verify(swarm=m.swarm_id, method="GET", target=TARGET, now=NOW + 600, recipient=SERVER)


def test_a_header_is_good_only_at_the_node_it_names(swarm):
    """A header captured on its way to one member was accepted by every member for 60 s: it
    now names its recipient, signed, and another node refuses it with a 401 and the reason."""
    _, _, _, m = swarm
    auth = _header(key(), m.swarm_id)
    with pytest.raises(AuthRefused, match="not this node") as refused:
        auth.verify(swarm=m.swarm_id, method="GET", target=TARGET, now=NOW, recipient=OTHER)
    assert refused.value.status == 401
    forged = RequestAuth(
        auth.public_key, auth.timestamp, OTHER, auth.nonce, auth.signature
    )  # recipient rewritten
    with pytest.raises(BadSignature):
        forged.verify(swarm=m.swarm_id, method="GET", target=TARGET, now=NOW, recipient=OTHER)


def test_a_header_naming_no_recipient_is_taken_only_on_first_contact_routes(swarm):
    _, _, _, m = swarm
    auth = _header(key(), m.swarm_id, recipient=None)
    assert auth.recipient == b""
    with pytest.raises(AuthRefused, match="names no recipient"):
        auth.verify(swarm=m.swarm_id, method="GET", target=TARGET, now=NOW, recipient=SERVER)
    auth.verify(
        swarm=m.swarm_id, method="GET", target=TARGET, now=NOW, recipient=SERVER, unbound_ok=True
    )


def test_a_version_1_header_is_a_401_that_says_to_upgrade():
    old = f"v1 {key().public_key.hex()} {NOW!r} {'A' * 86}=="
    with pytest.raises(AuthRefused, match="v1 is no longer accepted.*upgrade") as refused:
        RequestAuth.parse(old)
    assert refused.value.status == 401


def test_a_header_is_taken_once(swarm):
    """No nonce, no memory: a captured header was good again and again for 60 s. The replay
    cache takes each (key, nonce) once, forgets it when its skew window ends (the clock check
    refuses it from then on), and a new nonce is a new request."""
    _, _, _, m = swarm
    peer, cache = key(), ReplayCache()
    auth = _header(peer, m.swarm_id)
    cache.admit(auth, "10.0.0.1", NOW)
    with pytest.raises(AuthRefused, match="used before") as refused:
        cache.admit(auth, "10.9.9.9", NOW + 1)  # replayed from elsewhere
    assert refused.value.status == 401 and cache.replays == 1
    cache.admit(_header(peer, m.swarm_id, nonce=b"m" * 16), "10.0.0.1", NOW + 1)
    cache.admit(_header(key(), m.swarm_id), "10.0.0.1", NOW + 1)  # the same nonce under another key
    assert len(cache) == 3
    cache.admit(_header(peer, m.swarm_id, nonce=b"z" * 16, now=NOW + 200), "10.0.0.1", NOW + 200)
    assert len(cache) == 1  # the others' windows ended: evicted by expiry


def test_the_replay_cache_is_bounded_and_a_flood_evicts_only_its_own_address(swarm):
    _, _, _, m = swarm
    cache = ReplayCache(max_entries=64)
    honest = [_header(key(), m.swarm_id, nonce=bytes([i]) * 16) for i in range(8)]
    for auth in honest:
        cache.admit(auth, "192.0.2.1", NOW)
    flooder = key()
    for i in range(1000):  # signed requests from one address (keys cost nothing in open swarms)
        cache.admit(
            _header(flooder, m.swarm_id, nonce=i.to_bytes(16, "big")),
            "198.51.100.7",
            NOW + i * 0.01,
        )
    assert len(cache) == 64 and cache.evicted == 1000 + 8 - 64
    for auth in honest:  # the honest address's headers are still remembered: their replays refused
        with pytest.raises(AuthRefused, match="used before"):
            cache.admit(auth, "203.0.113.9", NOW + 11)
    assert honest[0].expires_at == NOW + MAX_SKEW_S


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_auth_header_parse_never_crashes(text):
    with contextlib.suppress(DecodeError, Oversize, AuthRefused):  # AuthRefused: a v1 header
        RequestAuth.parse(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=70), min_size=6, max_size=6))
def test_a_v2_shaped_header_parses_or_is_refused_with_a_reason(parts):
    with contextlib.suppress(DecodeError, Oversize):
        RequestAuth.parse(" ".join(["v2", *parts[1:]]))


@pytest.mark.parametrize(
    ("method", "path", "sealed"),
    [
        ("POST", "/v1/rpc", True),
        ("POST", "/v1/dht", True),
        ("POST", "/v1/dht/17", True),
        ("post", "/v1/dht", True),
        ("GET", "/v1/dht", False),  # only a POST carries an envelope
        ("GET", "/v1/rpc", False),
        ("POST", "/v1/dht/17/x", False),  # not a DHT node's path
        ("POST", "/v1/dhtx", False),
        ("POST", "/v1/rpc/", False),
        ("GET", "/v1/fragments/0/held", False),
        ("GET", "/v1/fragments/0/next", False),
        ("POST", "/v1/swarm/manifest", False),
    ],
)
def test_only_the_dht_and_rpc_posts_are_sealed_routes(method: str, path: str, sealed: bool) -> None:
    from protocol.wire.request_auth import sealed_route

    assert sealed_route(method, path) is sealed


@given(st.text(max_size=40), st.sampled_from(["GET", "POST", "PUT"]))
@settings(max_examples=300)
def test_a_sealed_route_is_always_one_that_takes_an_unbound_header(path: str, method: str) -> None:
    """Leaving the header off never reaches a route that needs one naming its node."""
    from protocol.wire.request_auth import sealed_route
    from protocol.wire.request_checks import unbound_ok

    if sealed_route(method, path):
        assert unbound_ok(method.upper(), path)
