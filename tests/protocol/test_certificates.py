"""Lab certificates and admission: every refusal's reason, issue, decoding (pure, fake time)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.wire.certificates import Certificate, admit, check_certificate
from protocol.wire.membership import SwarmManifest, tls_pin
from tests.protocol.swarm_keys import NOW, cert, key


def test_certificate_checks_each_reason(swarm):
    founder, lab_a, lab_b, m = swarm
    peer = key()
    c = cert(lab_a, m, peer)
    check_certificate(m, c, public_key=peer.public_key, role="owner", now=NOW)
    assert Certificate.from_text(c.to_text()) == c
    assert Certificate.from_header(c.to_header()) == c
    assert c.tls_pin == tls_pin(peer.public_key)

    with pytest.raises(NotAuthorized, match="expired"):
        check_certificate(m, c, public_key=peer.public_key, role=None, now=NOW + 2 * 86400)
    with pytest.raises(NotAuthorized, match="not the sender"):
        check_certificate(m, c, public_key=key().public_key, role=None, now=NOW)
    learner_only = cert(lab_b, m, peer, roles=("learner",))
    with pytest.raises(NotAuthorized, match="not owner"):
        check_certificate(m, learner_only, public_key=peer.public_key, role="owner", now=NOW)
    stranger = key()
    other = SwarmManifest(name="two-labs", founder=founder.public_key).with_authority(
        "lab-x", stranger.public_key
    )
    forged = Certificate.issue(
        stranger,
        manifest=other,
        subject=peer.public_key,
        roles=["owner"],
        not_before=NOW - 1,
        not_after=NOW + 60,
    )
    with pytest.raises(NotAuthorized, match="not an authority of this swarm"):
        check_certificate(m, forged, public_key=peer.public_key, role=None, now=NOW)
    revoked = m.with_revoked(peer.public_key).signed(founder)
    with pytest.raises(NotAuthorized, match="revoked"):
        check_certificate(revoked, c, public_key=peer.public_key, role=None, now=NOW)
    elsewhere = SwarmManifest(name="another", founder=founder.public_key).with_authority(
        "lab-a", lab_a.public_key
    )
    with pytest.raises(NotAuthorized, match="for swarm"):
        check_certificate(elsewhere, c, public_key=peer.public_key, role=None, now=NOW)
    tampered = dataclasses.replace(c, roles=("learner", "owner"), not_after=c.not_after + 1e6)
    with pytest.raises(BadSignature):
        check_certificate(m, tampered, public_key=peer.public_key, role=None, now=NOW)


def test_issue_refuses_a_key_that_is_not_an_authority(swarm):
    founder, _, _, m = swarm
    with pytest.raises(LocalProtocolError, match="not an authority"):
        cert(founder, m, key())


def test_admission_open_and_certified(swarm):
    founder, lab_a, _, m = swarm
    peer = key()
    with pytest.raises(NotAuthorized, match="certified peers only"):
        admit(m, None, public_key=peer.public_key, role="learner", now=NOW)
    open_m = dataclasses.replace(m, admission="open", version=m.version + 1).signed(founder)
    admit(open_m, None, public_key=peer.public_key, role="learner", now=NOW)
    admit(open_m, None, public_key=peer.public_key, role=None, now=NOW)
    with pytest.raises(NotAuthorized, match="owner role"):
        admit(open_m, None, public_key=peer.public_key, role="owner", now=NOW)
    admit(open_m, cert(lab_a, m, peer), public_key=peer.public_key, role="owner", now=NOW)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_certificate_decode_never_crashes(data):
    with contextlib.suppress(DecodeError, Oversize):
        Certificate.decode(data)
