"""The Atoll-Auth request header: what it binds, parsing anything (pure, fake time)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import BadSignature, DecodeError, NotAuthorized, Oversize
from protocol.wire.request_auth import RequestAuth
from tests.protocol.swarm_keys import NOW, key


def test_request_auth_binds_swarm_method_target_and_time(swarm):
    _, _, _, m = swarm
    peer = key()
    header = RequestAuth.make(peer, swarm=m.swarm_id, method="GET", target="/v1/fragments/0/latest", now=NOW)
    auth = RequestAuth.parse(header)
    assert auth.public_key == peer.public_key
    auth.verify(swarm=m.swarm_id, method="GET", target="/v1/fragments/0/latest", now=NOW + 5)
    with pytest.raises(BadSignature):
        auth.verify(swarm=m.swarm_id, method="GET", target="/v1/fragments/1/latest", now=NOW)
    with pytest.raises(BadSignature):
        auth.verify(swarm="11" * 16, method="GET", target="/v1/fragments/0/latest", now=NOW)
    with pytest.raises(NotAuthorized, match="clock"):
        auth.verify(swarm=m.swarm_id, method="GET", target="/v1/fragments/0/latest", now=NOW + 600)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_auth_header_parse_never_crashes(text):
    with contextlib.suppress(DecodeError, Oversize):
        RequestAuth.parse(text)
