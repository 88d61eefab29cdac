"""The recipe document: parsing, the canonical form, and every refusal as one line."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import tomli_w

from protocol.errors import DecodeError, NotAuthorized, Oversize
from protocol.wire.membership import SwarmManifest
from protocol.wire.recipe import (
    MAX_RECIPE_BYTES,
    Recipe,
    check_hf_config,
    check_safetensors_header,
)
from protocol.wire.signing import Signer

H = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("cfg", "tok", "w", "t", "v")}

AUTHOR = """
[recipe]
name = "tiny"
seq_len = 64
batch_size = 8

[model]
type = "hf"
config = "model.json"
weights = "init.safetensors"

[tokenizer]
file = "tokenizer.json"

[data]
source = "files"
files = ["train.txt"]
validation = ["valid.txt"]
shards = 12

[schedule]
steps = 200
lr = 3e-3
fragments = 4
"""
PATHS = {
    "model.json": H["cfg"],
    "init.safetensors": H["w"],
    "tokenizer.json": H["tok"],
    "train.txt": H["t"],
    "valid.txt": H["v"],
}


def _author(text: str = AUTHOR) -> Recipe:
    return Recipe.from_toml(text, PATHS.__getitem__)


def test_an_authors_recipe_names_its_files_by_hash_and_round_trips_canonically() -> None:
    r = _author()
    assert (r.model_type, r.config, r.weights, r.tokenizer) == ("hf", H["cfg"], H["w"], H["tok"])
    assert r.artifacts() == (H["cfg"], H["w"], H["tok"], H["t"], H["v"])
    assert r.data_table == {
        "files": [H["t"]],
        "shards": 12,
        "source": "files",
        "validation": [H["v"]],
    }
    assert r.schedule_dict == {"fragments": 4, "lr": 0.003, "steps": 200}
    canonical = tomli_w.dumps(r.to_toml_data())
    assert Recipe.from_toml(canonical) == r  # no resolver: hashes only
    assert Recipe.from_toml(canonical.encode()) == r


def test_a_canonical_recipe_takes_hashes_only() -> None:
    with pytest.raises(DecodeError, match="model.config must be the artifact's SHA-256"):
        Recipe.from_toml(AUTHOR)


def test_the_built_in_gpt_needs_no_artifact() -> None:
    r = Recipe.from_toml('[model]\ntype = "gpt"\npreset = "tiny"\n')
    assert r.artifacts() == () and r.preset == "tiny"


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (('type = "hf"', 'type = "llama-remote"'), "unknown model type 'llama-remote'"),
        (("[schedule]", "[optimizer]"), r"unknown table \[optimizer\]"),
        (("shards = 12", "shards = 12\n[model.extra]\nx = 1"), "unknown key model.extra"),
        (("steps = 200", "steps = 200\nmomentum = 0.9"), "unknown key schedule.momentum"),
        (("seq_len = 64", "seq_len = 100000000"), r"recipe.seq_len must be an integer in"),
        (("lr = 3e-3", "lr = nan"), "schedule.lr must be a number"),
        (('"init.safetensors"', '"init.bin"'), "pickle-ish file"),
        (('"init.safetensors"', '"init.pt"'), "pickle-ish file"),
        (('"init.safetensors"', '"init.ckpt"'), "pickle-ish file"),
        (('"train.txt"', '"train.pkl"'), "pickle-ish file"),
        (('"init.safetensors"', '"init.h5"'), "not a .safetensors file"),
        (
            ('type = "hf"', 'type = "hf"\ntrust_remote_code = true'),
            "model.trust_remote_code is refused",
        ),
        (
            ("shards = 12", "shards = 12\n[data.options]\nTrust-Remote-Code = false"),
            "Trust-Remote-Code is refused",
        ),
        (("shards = 12", 'shards = 12\nhf_split = "' + "x" * 300 + '"'), "data.hf_split must be"),
    ],
)
def test_mistakes_are_refused_with_one_line(edit: tuple[str, str], reason: str) -> None:
    with pytest.raises(DecodeError, match=reason) as info:
        _author(AUTHOR.replace(*edit))
    assert "\n" not in info.value.reason and info.value.reason.startswith("recipe: ")


def test_a_hash_that_is_not_64_hex_is_no_hash() -> None:
    short = tomli_w.dumps(_author().to_toml_data()).replace(H["tok"], H["tok"][:-1])
    with pytest.raises(DecodeError, match="tokenizer.file must be the artifact's SHA-256"):
        Recipe.from_toml(short)
    upper = tomli_w.dumps(_author().to_toml_data()).replace(H["tok"], H["tok"].upper())
    with pytest.raises(DecodeError, match="tokenizer.file must be"):
        Recipe.from_toml(upper)


def test_oversize_and_malformed_text_are_refused() -> None:
    with pytest.raises(Oversize):
        Recipe.from_toml("#" * (MAX_RECIPE_BYTES + 1))
    with pytest.raises(DecodeError, match="not valid TOML"):
        Recipe.from_toml("[model\n")
    with pytest.raises(DecodeError, match="at most 1024 entries"):
        _author(AUTHOR.replace('["train.txt"]', json.dumps(["train.txt"] * 1025)))


def test_a_model_config_that_loads_code_is_refused() -> None:
    good = {"model_type": "gpt2", "n_layer": 2}
    assert check_hf_config(json.dumps(good).encode())["n_layer"] == 2
    for bad in (
        {**good, "auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}},
        {**good, "trust_remote_code": True},
        {**good, "text_config": {"auto_map": {}}},
    ):
        with pytest.raises(DecodeError, match="load code: refused"):
            check_hf_config(json.dumps(bad).encode())
    with pytest.raises(DecodeError, match="needs a model_type"):
        check_hf_config(b"{}")
    with pytest.raises(DecodeError, match="not JSON"):
        check_hf_config(b"\x80\x04K\x01.")  # a pickle


def _safetensors(n_floats: int) -> bytes:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}
    )
    head = header.encode()
    return struct.pack("<Q", len(head)) + head + bytes(4 * n_floats)


def test_weights_must_be_safetensors_not_a_renamed_pickle() -> None:
    good = _safetensors(3)
    assert check_safetensors_header(good, len(good))["w"]["shape"] == [3]
    pickled = b"\x80\x04\x95" + bytes(64)  # what torch.save / pickle writes first
    with pytest.raises(DecodeError, match="not a safetensors file"):
        check_safetensors_header(pickled, len(pickled))
    with pytest.raises(DecodeError, match="past the file's"):
        check_safetensors_header(good, len(good) - 1)


def test_a_format_3_manifest_pins_the_recipe_and_keeps_it() -> None:
    founder = Signer.from_seed(bytes(32))
    digest = hashlib.sha256(b"recipe").hexdigest()
    m = SwarmManifest(name="r", founder=founder.public_key, format=3, recipe_sha256=digest).signed(
        founder
    )
    back = SwarmManifest.from_toml(tomli_w.dumps(m.to_toml_data()))
    back.verify(expected_id=m.swarm_id)
    assert (back.format, back.recipe_sha256) == (3, digest)
    assert back.signed_recipe() == (("manifest_format", 3), ("recipe_sha256", digest))
    other = SwarmManifest(
        name="r", founder=founder.public_key, version=2, format=3, recipe_sha256=H["cfg"]
    ).signed(founder)
    with pytest.raises(NotAuthorized, match="recipe's"):
        m.superseded_by(other)
    with pytest.raises(DecodeError, match="format 3 or above"):
        SwarmManifest(name="r", founder=founder.public_key, format=2, recipe_sha256=digest)
