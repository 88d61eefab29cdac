"""A two-lab swarm for the membership, certificate and request-auth tests: keys, a signed
manifest, certificates (fake time ``NOW``)."""

from __future__ import annotations

import os

from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

NOW = 1_800_000_000.0


def key() -> Signer:
    return Signer.from_seed(os.urandom(32))


def two_labs() -> tuple[Signer, Signer, Signer, SwarmManifest]:
    founder, lab_a, lab_b = key(), key(), key()
    m = SwarmManifest(
        name="two-labs",
        founder=founder.public_key,
        admission="certified",
        created=NOW - 100,
        recipe=(("fragments", 4), ("model", "tiny"), ("outer_lr", 0.7)),
    )
    m = m.with_authority("lab-a", lab_a.public_key).with_authority("lab-b", lab_b.public_key)
    return founder, lab_a, lab_b, m.signed(founder)


def cert(
    authority: Signer,
    manifest: SwarmManifest,
    peer: Signer,
    roles: tuple[str, ...] = ("learner", "owner"),
    days: float = 1.0,
) -> Certificate:
    return Certificate.issue(
        authority,
        manifest=manifest,
        subject=peer.public_key,
        roles=roles,
        not_before=NOW - 10,
        not_after=NOW + days * 86400,
    )
