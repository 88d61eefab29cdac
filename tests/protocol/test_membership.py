"""Swarm manifests: signing, TOML, superseding, bad text (pure, fake time)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import tomli_w

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.wire.membership import SwarmManifest, swarm_id


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
    changed = dataclasses.replace(
        newer, version=newer.version + 1, recipe=(("fragments", 8),)
    ).signed(founder)
    with pytest.raises(NotAuthorized, match="changes the recipe"):
        m.superseded_by(changed)


@pytest.mark.parametrize(
    "text",
    ["", "not toml [", "[swarm]\nname='x'", "[swarm]\nname=1\nfounder='00'", "x" * (2 << 20)],
)
def test_bad_manifest_text_is_a_clear_error(text):
    with pytest.raises((DecodeError, Oversize)):
        SwarmManifest.from_toml(text)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:7000", "https://peer.example.org:443", "https://[2001:db8::1]:7000"]
)
def test_bare_origins_pass_as_they_are(url):
    from protocol.wire.membership import bare_origin

    assert bare_origin(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:7000/x",
        "http://10.0.0.1:7000/",
        "http://10.0.0.1:7000?a",
        "http://10.0.0.1:7000#a",
        "http://u:p@10.0.0.1:7000",
        "http://10.0.0.1",
        "http://10.0.0.1:65536",
        "http://10.0.0.1:0",
        "http://-x:1",
        " http://a:1",
        7,
    ],
)
def test_anything_but_a_bare_origin_is_refused_with_what_to_send(url):
    from protocol.wire.membership import bare_origin

    with pytest.raises(DecodeError, match="bare origin|port"):
        bare_origin(url)
