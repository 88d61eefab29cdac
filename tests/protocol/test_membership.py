"""Swarm manifests, certificates, admission and request authentication (pure, fake time)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.wire.certificates import Certificate, admit, check_certificate
from protocol.wire.membership import SwarmManifest, swarm_id, tls_pin
from protocol.wire.request_auth import RequestAuth
from protocol.wire.signing import Signer

NOW = 1_800_000_000.0


def key() -> Signer:
    return Signer.from_seed(os.urandom(32))


@pytest.fixture
def swarm() -> tuple[Signer, Signer, Signer, SwarmManifest]:
    founder, lab_a, lab_b = key(), key(), key()
    m = SwarmManifest(name="two-labs", founder=founder.public_key, admission="certified", created=NOW - 100,
                      recipe=(("fragments", 4), ("model", "tiny"), ("outer_lr", 0.7)))
    m = m.with_authority("lab-a", lab_a.public_key).with_authority("lab-b", lab_b.public_key)
    return founder, lab_a, lab_b, m.signed(founder)


def cert(authority: Signer, manifest: SwarmManifest, peer: Signer, roles: tuple[str, ...] = ("learner", "owner"),
         days: float = 1.0) -> Certificate:
    return Certificate.issue(authority, manifest=manifest, subject=peer.public_key, roles=roles,
                             not_before=NOW - 10, not_after=NOW + days * 86400)


def test_manifest_round_trips_through_toml_and_verifies(swarm):
    founder, _, _, m = swarm
    text = tomli_w.dumps(m.to_toml_data())
    back = SwarmManifest.from_toml(text)
    assert back == m
    back.verify(expected_id=swarm_id(founder.public_key, "two-labs"))
    assert m.version == 3  # init, two authorities


def test_manifest_tampering_is_caught(swarm):
    _, _, _, m = swarm
    data = m.to_toml_data()
    data["recipe"]["outer_lr"] = 1.0
    with pytest.raises(BadSignature):
        SwarmManifest.from_toml(tomli_w.dumps(data)).verify()
    data = m.to_toml_data()
    data["swarm"]["admission"] = "open"
    with pytest.raises(BadSignature):
        SwarmManifest.from_toml(tomli_w.dumps(data)).verify()


def test_manifest_for_another_swarm_id_is_refused(swarm):
    _, _, _, m = swarm
    with pytest.raises(NotAuthorized, match="not 00"):
        m.verify(expected_id="00" * 16)


def test_only_the_founder_signs(swarm):
    _, lab_a, _, m = swarm
    with pytest.raises(LocalProtocolError, match="founder"):
        m.with_revoked(lab_a.public_key).signed(lab_a)


def test_newer_manifest_supersedes_but_may_not_change_the_recipe(swarm):
    founder, _, _, m = swarm
    newer = m.with_revoked(os.urandom(32)).signed(founder)
    assert m.superseded_by(newer)
    assert not newer.superseded_by(m)  # an older one arriving late is ignored
    changed = dataclasses.replace(newer, version=newer.version + 1, recipe=(("fragments", 8),)).signed(founder)
    with pytest.raises(NotAuthorized, match="changes the recipe"):
        m.superseded_by(changed)


@pytest.mark.parametrize("text", ["", "not toml [", "[swarm]\nname='x'", "[swarm]\nname=1\nfounder='00'",
                                  "x" * (2 << 20)])
def test_bad_manifest_text_is_a_clear_error(text):
    with pytest.raises((DecodeError, Oversize)):
        SwarmManifest.from_toml(text)


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
    other = SwarmManifest(name="two-labs", founder=founder.public_key).with_authority("lab-x", stranger.public_key)
    forged = Certificate.issue(stranger, manifest=other, subject=peer.public_key, roles=["owner"],
                               not_before=NOW - 1, not_after=NOW + 60)
    with pytest.raises(NotAuthorized, match="not an authority of this swarm"):
        check_certificate(m, forged, public_key=peer.public_key, role=None, now=NOW)
    revoked = m.with_revoked(peer.public_key).signed(founder)
    with pytest.raises(NotAuthorized, match="revoked"):
        check_certificate(revoked, c, public_key=peer.public_key, role=None, now=NOW)
    elsewhere = SwarmManifest(name="another", founder=founder.public_key).with_authority("lab-a", lab_a.public_key)
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
@given(st.binary(max_size=300))
def test_certificate_decode_never_crashes(data):
    with contextlib.suppress(DecodeError, Oversize):
        Certificate.decode(data)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_auth_header_parse_never_crashes(text):
    with contextlib.suppress(DecodeError, Oversize):
        RequestAuth.parse(text)
