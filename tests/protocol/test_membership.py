"""Swarm manifests: signing, TOML, superseding, bad text (pure, fake time)."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest
import tomli_w

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.wire import membership
from protocol.wire.membership import SwarmManifest, swarm_id
from protocol.wire.signing import Signer


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


# --- formats: a format-1 manifest keeps its bytes; format 2 pins the validation set -----------
# A manifest signed by a fixed key, as ``atoll swarm init`` and ``add-authority`` / ``revoke`` make
# it; the hashes below were computed with the code of a2262f6 (main before manifest formats).
GOLDEN_RECIPE = (
    ("aggregate", "normed"),
    ("batch_size", 16),
    ("block_size", 64),
    ("codec", "int4"),
    ("download_codec", "none"),
    ("fragments", 4),
    ("full_every", 0),
    ("grace_cap_s", 10.0),
    ("grace_gamma", 0.8),
    ("grace_tau", 2),
    ("inner_steps", 200),
    ("late_policy", "carry"),
    ("lr", 0.006),
    ("max_tokens_per_step", 0),
    ("mode", "decoupled"),
    ("model", "tiny"),
    ("outer_lr", 1.0),
    ("outer_momentum", 0.0),
    ("quorum", 1),
    ("quorum_fraction", -1.0),
    ("rda_max_gain", 0.0),
    ("seed", 0),
    ("staleness_bound", 2),
    ("sync_growth", "constant"),
    ("update_codec", "int4"),
)
PIN = hashlib.sha256(b"the swarm's validation set").hexdigest()


def golden_manifest(**changes: object) -> tuple[Signer, SwarmManifest]:
    founder, lab = Signer.from_seed(bytes(range(32))), Signer.from_seed(bytes(range(1, 33)))
    m = SwarmManifest(
        name="golden",
        founder=founder.public_key,
        admission="certified",
        created=1_800_000_000.0,
        recipe=GOLDEN_RECIPE,
        **changes,  # type: ignore[arg-type]
    )
    return founder, m.with_authority("lab-a", lab.public_key).with_revoked(bytes(32)).signed(
        founder
    )


def test_a_format_1_manifest_keeps_its_signed_bytes_text_and_id():
    _, m = golden_manifest()
    text = tomli_w.dumps(m.to_toml_data())
    assert m.format == 1 and m.validation_sha256 == ""
    assert m.swarm_id == "f8df3ccf6bcfdbdf27398f415ceecb8c"
    assert (
        hashlib.sha256(m.signing_bytes()).hexdigest()
        == "5cc6cc0fce2b6304976926d3915480fb60b4f9cd34b52491d8d4a8280b0f1571"
    )
    assert (
        hashlib.sha256(text.encode()).hexdigest()
        == "7e609f015c21322f2d9a226a3c1d3fc945cbbf1af8ac3dfbcf761ee40db97eb1"
    )
    assert m.signature.hex().startswith("8cf81690241467a1cd2107aa5008e9c0")
    assert "manifest_format" not in text and "validation_sha256" not in text
    SwarmManifest.from_toml(text).verify(expected_id=m.swarm_id)


def test_a_format_2_manifest_pins_the_validation_set_under_the_founders_signature():
    founder, m = golden_manifest(format=2, validation_sha256=PIN)
    _, old = golden_manifest()
    assert m.swarm_id == old.swarm_id  # the id is the founder's key and the name
    text = tomli_w.dumps(m.to_toml_data())
    back = SwarmManifest.from_toml(text)
    assert back == m and back.format == 2 and back.validation_sha256 == PIN
    back.verify(expected_id=old.swarm_id)
    assert back.recipe == GOLDEN_RECIPE  # the recipe proper: what config_from_manifest applies
    data = m.to_toml_data()
    assert data["recipe"]["manifest_format"] == 2 and data["recipe"]["validation_sha256"] == PIN
    data["recipe"]["validation_sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    with pytest.raises(BadSignature):
        SwarmManifest.from_toml(tomli_w.dumps(data)).verify()
    repinned = dataclasses.replace(
        m, version=m.version + 1, validation_sha256=data["recipe"]["validation_sha256"]
    ).signed(founder)
    with pytest.raises(NotAuthorized, match="validation set's pin"):
        m.superseded_by(repinned)


def test_a_reader_of_older_formats_says_to_upgrade(monkeypatch):
    _, m = golden_manifest(format=2, validation_sha256=PIN)
    text = tomli_w.dumps(m.to_toml_data())
    monkeypatch.setattr(membership, "MANIFEST_FORMAT", 1)
    with pytest.raises(
        DecodeError, match="format 2; this Atoll reads formats up to 1: upgrade atoll"
    ):
        SwarmManifest.from_toml(text)
    monkeypatch.undo()
    data = m.to_toml_data()
    data["recipe"]["manifest_format"] = 4
    with pytest.raises(DecodeError, match="format 4; .* up to 3: upgrade atoll"):
        SwarmManifest.from_toml(tomli_w.dumps(data))


@pytest.mark.parametrize(
    "changes",
    [
        {"manifest_format": 1},  # format 1 is written without it (its bytes stay as they were)
        {"manifest_format": "2"},
        {"manifest_format": 1, "validation_sha256": PIN},  # a pin needs format 2
        {"validation_sha256": PIN},
        {"manifest_format": 2, "validation_sha256": PIN.upper()},
        {"manifest_format": 2, "validation_sha256": PIN[:-2]},
        {"manifest_format": 2, "validation_sha256": 7},
    ],
)
def test_a_malformed_format_or_pin_is_refused_with_what_is_wrong(changes):
    _, m = golden_manifest()
    data = m.to_toml_data()
    data["recipe"].update(changes)
    with pytest.raises(DecodeError):
        SwarmManifest.from_toml(tomli_w.dumps(data))
