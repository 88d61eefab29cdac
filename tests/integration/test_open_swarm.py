"""An open swarm with `atoll` processes on 127.0.0.1: an uncertified peer learns (its contributions
are merged) but never owns. Its key is ground to win the rendezvous hash for fragment 0 over both
certified members, and its member record is forged to claim the owner role: every peer still
routes fragment 0 to a certified owner, and no learner adopts a version it signs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from node.config import RunConfig
from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import MemberRecord, Membership, config_from_manifest, manifest_hash
from node.dht.route import DHTRouter
from node.wire.identity import generate_key, load_key, load_manifest, save_key
from node.wire.transport import Transport
from protocol.diloco.fragments import owners_of
from tests.integration.swarms import Proc, get_json, make_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECIPE = ["--model", "tiny", "--fragments", "2", "--inner-steps", "10", "--batch-size", "8"]
TRAIN = [
    "--steps",
    "100000",
    "--corpus-max-bytes",
    "300000",
    "--eval-every",
    "1000000",
    "--threads",
    "1",
    "--serve-after-s",
    "0",
    "--listen",
    "127.0.0.1:0",
]


async def forge_owner_claim(boot_url: str, key_path: Path, url: str, cfg: RunConfig) -> int:
    """Publish, with the uncertified peer's own key, a record saying it owns and can be dialled."""
    signer = load_key(key_path)
    transport = Transport("127.0.0.1", 0)
    router = DHTRouter(transport)
    await transport.start()
    dht = DHTNode(signer, transport, transport.url + "/v1/dht", DHTConfig(maintenance_period_s=0))
    router.mount(dht)
    await dht.start()
    try:
        assert await dht.bootstrap([boot_url + "/v1/dht"]) == 1
        record = MemberRecord(
            url=url,
            roles=("learner", "owner"),
            reachable=True,
            manifest=manifest_hash(cfg),
            learning=True,
        )
        return await Membership(dht, cfg.swarm, manifest_hash(cfg), ttl_s=600).publish(record)
    finally:
        await dht.close()
        await transport.close()


def test_an_uncertified_learner_is_merged_but_never_owns(tmp_path: Path) -> None:
    files = make_swarm(
        tmp_path / "swarm", name="open-lab", admission="open", labs=("lab",), recipe=RECIPE
    )
    for peer in ("c1", "c2"):
        files.certify(peer, lab="lab")
    manifest = load_manifest(files.manifest)
    certified = [load_key(files.key(p)).peer_id for p in ("c1", "c2")]
    cfg = config_from_manifest(manifest, RunConfig())
    while True:  # grind a key that the rendezvous hash would make fragment 0's owner
        ground = generate_key()
        members = [*certified, ground.peer_id]
        if (
            owners_of(manifest.swarm_id, 0, members, 1, n_fragments=cfg.fragments)[0]
            == ground.peer_id
        ):
            break
    save_key(ground, files.folder / "u.key")
    files.keys["u"] = files.folder / "u.key"
    u_id = ground.peer_id.hex()

    procs: list[Proc] = []
    try:
        boot = Proc(
            [
                "bootstrap",
                "--manifest",
                str(files.manifest),
                "--key",
                str(files.key("boot")),
                "--listen",
                "127.0.0.1:0",
            ],
            tmp_path / "boot.log",
        )
        procs.append(boot)
        boot_url = boot.wait_line("listening at", 60).rsplit(" ", 1)[-1]
        peers = {
            p: Proc(
                ["join", "--initial-peers", boot_url, *files.args(p), *TRAIN], tmp_path / f"{p}.log"
            )
            for p in ("c1", "c2", "u")
        }
        procs += peers.values()
        urls = {p: j.wait_event("listening", 90)["url"] for p, j in peers.items()}
        for j in peers.values():
            j.wait_event("joined", 90)
        assert asyncio.run(forge_owner_claim(boot_url, files.key("u"), urls["u"], cfg)) >= 1

        merged_from_u, checks = 0, 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            seen: dict[str, dict[str, Any]] = {
                p: get_json(f"{u}/v1/status") for p, u in urls.items()
            }
            for p, s in seen.items():
                owners = {o["peer_id"] for o in s["owners"].values() if o}
                assert u_id not in owners, (p, s["owners"])
                if p != "u":
                    member = next((m for m in s["members"] if m["peer_id"] == u_id), None)
                    if member is not None:
                        assert member["certified_roles"] == [], member
            assert seen["u"]["owned"] == {}, seen["u"]["owned"]
            checks += 1
            merged_from_u = sum(
                s["penalties"].get(u_id, {}).get("merged", 0) for s in seen.values()
            )
            claimed = any(
                "owner" in m["roles"]
                for s in seen.values()
                for m in s["members"]
                if m["peer_id"] == u_id
            )
            if merged_from_u >= 3 and claimed and min(seen["u"]["versions"]) > 0 and checks >= 5:
                break
            time.sleep(1.0)
        assert merged_from_u >= 3, (
            f"the uncertified learner's contributions were not merged: {seen}"
        )
        assert claimed, "the forged owner claim never reached the members"
        assert min(seen["u"]["versions"]) > 0  # it learns: it adopts the certified owners' versions
        assert all(s["version_jumps_refused"] == 0 for s in seen.values())
    finally:
        for p in procs:
            p.stop()
