"""A recipe swarm end to end, through the command line (issue 51's must-show).

The founder trains a byte-level BPE tokenizer on local text (the standard library's), writes a
recipe for a 2-layer, 64-wide transformers GPT-2 model, and ``atoll swarm init --recipe`` stores
its artifacts. A bootstrap node serves them; three ``atoll join --swarm ID`` peers that start with
no artifact fetch all of them from it, train on disjoint shards (their ``shards dealt`` lines),
and a fourth joining late fetches them from one of the three (not the founder), is dealt shards
of its own and trains. All four end on one model (one ``final_param_hash``) whose loss on the
recipe's validation set fell by more than ``MARGIN`` nats/token.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.integration.swarms import ENV, ROOT, Proc, admin, get_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SHARDS = 12
STEPS = 400  # long enough that the late peer starts while the three still train
LATE_STEPS = 60  # the late peer's own schedule from step 0
MARGIN = 0.5  # nats/token the global model's validation loss falls at least (ln 512 = 6.24)
TEXT_BYTES = 300_000
RECIPE = f"""
[recipe]
name = "tiny-gpt2-stdlib"
seq_len = 64
batch_size = 8

[model]
type = "hf"
config = "model.json"

[tokenizer]
file = "tokenizer.json"

[data]
source = "files"
files = ["train.txt"]
validation = ["valid.txt"]
shards = {SHARDS}

[schedule]
steps = {STEPS}
lr = 3e-3
warmup_steps = 10
inner_steps = 20
fragments = 4
"""
MODEL = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "n_positions": 64,
    "vocab_size": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
JOIN = [
    "--listen",
    "127.0.0.1:0",
    "--threads",
    "1",
    "--eval-every",
    "1000000",
    "--final-sync",
    "--serve-after-s",
    "30",
]
_DEALT = re.compile(r"shards dealt: \[([0-9, ]*)\] of (\d+) among (\d+) learners")


def _founder_files(folder: Path) -> Path:
    """The founder's text, model config, tokenizer (trained here by tokenizers) and recipe."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = b""
    for f in sorted(lib.glob("*.py")):
        text += f.read_bytes()
        if len(text) >= TEXT_BYTES:
            break
    cut = len(text) * 9 // 10
    (folder / "train.txt").write_bytes(text[:cut])
    (folder / "valid.txt").write_bytes(text[cut:])
    (folder / "model.json").write_text(json.dumps(MODEL))
    subprocess.run(
        [sys.executable, "-m", "node.workload.tokenizer_train", "--files", "train.txt"]
        + ["--vocab", "512", "--out", "tokenizer.json"],
        cwd=folder,
        env=ENV,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (folder / "recipe.toml").write_text(RECIPE)
    return folder / "recipe.toml"


def _dealt(log: Path, learners: int) -> set[int]:
    """The shards a peer's log says it was last dealt among ``learners`` learners."""
    found = [m for m in _DEALT.finditer(log.read_text()) if int(m.group(3)) == learners]
    assert found, f"{log.name}: no 'shards dealt ... among {learners} learners' line"
    return {int(s) for s in found[-1].group(1).split(",") if s.strip()}


def _wait_dealt(log: Path, learners: int, timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return _dealt(log, learners)
        except AssertionError:
            time.sleep(0.5)
    return _dealt(log, learners)


def _fetched_from(log: Path) -> set[str]:
    return set(re.findall(r"artifact [0-9a-f]{16} fetched from (\S+)", log.read_text()))


def test_recipe_swarm_fetches_artifacts_trains_disjoint_shards_ends_on_one_model(
    tmp_path: Path,
) -> None:
    founder = tmp_path / "founder"
    founder.mkdir()
    recipe = _founder_files(founder)
    keys = {n: tmp_path / f"{n}.key" for n in ("founder", "lab", "j0", "j1", "j2", "late")}
    for key in keys.values():
        admin("keygen", "--out", str(key))
    manifest, store = tmp_path / "swarm.toml", founder / "artifacts"
    admin(
        "swarm", "init", "--name", "recipes", "--founder", str(keys["founder"]),
        "--recipe", str(recipe), "--artifact-dir", str(store), "--out", str(manifest),
    )  # fmt: skip
    admin(
        "swarm", "add-authority", str(manifest), "--founder", str(keys["founder"]),
        "--lab", "lab", "--key", str(keys["lab"]),
    )  # fmt: skip
    certs = {}
    for peer in ("j0", "j1", "j2", "late"):
        certs[peer] = tmp_path / f"{peer}.cert"
        admin(
            "swarm", "certify", "--manifest", str(manifest), "--authority", str(keys["lab"]),
            "--peer", str(keys[peer]), "--roles", "learner,owner", "--out", str(certs[peer]),
        )  # fmt: skip
    swarm_id = str(_show(manifest)["id"])
    shown = _show(manifest, store)
    assert shown["recipe"]["manifest_format"] == 3 and "recipe_document" in shown

    def join(peer: str, initial: str, *extra: str) -> Proc:
        own = tmp_path / f"{peer}-artifacts"
        assert not own.exists()  # starts with none of the artifacts
        return Proc(
            ["join", "--initial-peers", initial, "--swarm", swarm_id, "--key", str(keys[peer])]
            + ["--cert", str(certs[peer]), "--artifact-dir", str(own), *JOIN, *extra],
            tmp_path / f"{peer}.log",
        )

    procs: list[Proc] = []
    try:
        boot = Proc(
            ["bootstrap", "--listen", "127.0.0.1:0", "--manifest", str(manifest)]
            + ["--key", str(keys["founder"]), "--artifact-dir", str(store)],
            tmp_path / "boot.log",
        )
        procs.append(boot)
        boot_url = boot.wait_line("listening at", 60).rsplit(" ", 1)[-1]
        peers = [join(f"j{i}", boot_url) for i in range(3)]
        procs += peers
        urls = [p.wait_event("listening", 120)["url"] for p in peers]
        for p in peers:
            p.wait_event("joined", 120)

        # the three fetched every artifact from the founder's bootstrap, and share the shards
        for i in range(3):
            assert _fetched_from(tmp_path / f"j{i}.log") == {boot_url}
        # disjoint, complete and even: 12 shards over 3 learners is 4 each
        dealt = [_wait_dealt(tmp_path / f"j{i}.log", 3, 90) for i in range(3)]
        assert sum(map(len, dealt)) == SHARDS and set().union(*dealt) == set(range(SHARDS))
        assert sorted(map(len, dealt)) == [4, 4, 4], dealt

        # once they train, a fourth joins through one of them
        late = join("late", urls[0], "--schedule", "own", "--steps", str(LATE_STEPS))
        procs.append(late)
        late.wait_event("joined", 120)
        assert _fetched_from(tmp_path / "late.log") == {urls[0]}  # peer to peer
        late_dealt = _wait_dealt(tmp_path / "late.log", 4, 60)
        four = [_wait_dealt(tmp_path / f"j{i}.log", 4, 60) for i in range(3)] + [late_dealt]
        assert sum(map(len, four)) == SHARDS, four  # dealt again among four, disjoint
        assert set().union(*four) == set(range(SHARDS))
        assert sorted(map(len, four)) == [3, 3, 3, 3], four  # and even
        late.wait_event("progress", 60)
        assert min(get_json(f"{urls[0]}/v1/status")["versions"]) > 0  # the swarm merged work

        results = [p.wait_event("done", 300)["result"] for p in (*peers, late)]
        assert results[-1]["steps"] == LATE_STEPS and results[-1]["tokens_trained"] > 0
        assert len({r["final_param_hash"] for r in results}) == 1, [
            r["final_param_hash"] for r in results
        ]
        start, end = results[0]["eval_loss_start"], results[0]["eval_loss_end"]
        assert end < start - MARGIN, (start, end)
        assert all(r["validation"]["on"] for r in results)
        print(  # the figures docs/recipes.md quotes (pytest -s shows them)
            json.dumps(
                {
                    "eval_loss_start": start,
                    "eval_loss_end": end,
                    "final_param_hash": results[0]["final_param_hash"][:16],
                    "steps": [r["steps"] for r in results],
                    "dealt_3": [sorted(d) for d in dealt],
                    "dealt_4": [sorted(d) for d in four],
                }
            )
        )
    finally:
        for p in procs:
            p.stop()


def _show(manifest: Path, store: Path | None = None) -> dict:
    args = [sys.executable, "-m", "node", "swarm", "show", str(manifest), "--json"]
    if store is not None:
        args += ["--artifact-dir", str(store)]
    out = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))
