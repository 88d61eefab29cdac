"""``atoll swarm init --recipe`` and a joiner's recipe checks: mistakes are one line and a
non-zero exit before anything trains; a good recipe is stored by hash and pinned (format 3)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from node.cli import main
from node.run.recipes import RecipeError, prepare_recipe
from node.state.artifacts import ArtifactStore
from node.wire.identity import load_manifest
from protocol.wire.recipe import Recipe

pytestmark = pytest.mark.timeout(120)

RECIPE = """
[recipe]
seq_len = 16
batch_size = 2

[model]
type = "hf"
config = "model.json"

[tokenizer]
file = "tokenizer.json"

[data]
files = ["train.txt"]
validation = ["valid.txt"]
shards = 4

[schedule]
steps = 10
fragments = 2
"""
MODEL = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 16}


def _atoll(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "def f(x):\n    return x + 1\n" * 200
    (tmp_path / "train.txt").write_text(text)
    (tmp_path / "valid.txt").write_text(text[:2000])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "model.json").write_text(json.dumps({**MODEL, "vocab_size": 320}))
    (tmp_path / "recipe.toml").write_text(RECIPE)
    assert _atoll("keygen", "--out", str(tmp_path / "founder.key"))[0] == 0
    return tmp_path


def _init(folder: Path, recipe: str | None = None) -> tuple[int, str, str]:
    if recipe is not None:
        (folder / "recipe.toml").write_text(recipe)
    return _atoll(
        "swarm", "init", "--name", "r", "--founder", str(folder / "founder.key"),
        "--recipe", str(folder / "recipe.toml"), "--artifact-dir", str(folder / "art"),
        "--out", str(folder / "swarm.toml"), "--force",
    )  # fmt: skip


def test_init_stores_the_artifacts_and_pins_the_recipe(folder: Path) -> None:
    code, out, err = _init(folder)
    assert code == 0, err
    manifest = load_manifest(folder / "swarm.toml")
    assert manifest.format == 3 and manifest.recipe_dict["model"] == "recipe"
    assert manifest.recipe_dict["steps"] == 10 and manifest.recipe_dict["max_tokens_per_step"] == 32
    store = ArtifactStore(folder / "art")
    recipe = Recipe.from_toml(store.open_verified(manifest.recipe_sha256).read_bytes())
    assert all(store.has(d) for d in recipe.artifacts()) and len(recipe.artifacts()) == 4
    code, shown, _ = _atoll(
        "swarm", "show", str(folder / "swarm.toml"), "--artifact-dir", str(store.root)
    )
    assert code == 0 and f"recipe document {manifest.recipe_sha256}" in shown
    assert f'config = "{recipe.config}"' in shown


@pytest.mark.parametrize(
    ("edit", "model", "reason"),
    [
        (
            ('type = "hf"', 'type = "hf"\ntrust_remote_code = true'),
            {},
            "trust_remote_code is refused",
        ),
        (('config = "model.json"', 'config = "model.json"\nweights = "w.bin"'), {}, "pickle-ish"),
        (('"train.txt"', '"train.pickle"'), {}, "pickle-ish"),
        (("", ""), {"model_type": "no-such-model"}, "unknown model type 'no-such-model'"),
        (("", ""), {"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map, which"),
        (("shards = 4", "shards = 4\nsplit = 3"), {}, "data.split is not a \\[data\\] key"),
        (('"valid.txt"', '"missing.txt"'), {}, "cannot read .*missing.txt"),
    ],
)
def test_a_bad_recipe_is_one_line_and_exit_1(
    folder: Path, edit: tuple[str, str], model: dict[str, object], reason: str
) -> None:
    (folder / "model.json").write_text(json.dumps({**MODEL, "vocab_size": 320, **model}))
    code, _, err = _init(folder, RECIPE.replace(*edit) if edit[0] else RECIPE)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("atoll swarm init: ") and re.search(reason, err), err
    assert not (folder / "swarm.toml").exists()


def test_a_joiner_refuses_an_artifact_changed_on_disk_before_training(folder: Path) -> None:
    assert _init(folder)[0] == 0
    manifest = load_manifest(folder / "swarm.toml")
    store = ArtifactStore(folder / "art")
    recipe = Recipe.from_toml(store.open_verified(manifest.recipe_sha256).read_bytes())

    def no_peer(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        raise ConnectionRefusedError("no peer in this test")

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    assert prepare_recipe(manifest, store, no_peer, []).vocab_size == vocab
    tok = store.path(recipe.tokenizer)
    raw = bytearray(tok.read_bytes())
    raw[10] ^= 1
    tok.write_bytes(bytes(raw))
    with pytest.raises(RecipeError, match=f"artifact {recipe.tokenizer[:16]} .* refused") as info:
        prepare_recipe(manifest, store, no_peer, [])
    assert "\n" not in str(info.value)
    # and it is fetched again, refused again when no peer has it right
    with pytest.raises(RecipeError, match="could not be fetched: no peer to ask"):
        prepare_recipe(manifest, store, no_peer, [])


def test_the_examples_in_recipes_parse_and_the_built_in_one_founds_a_swarm(tmp_path: Path) -> None:
    import hashlib

    root = Path(__file__).resolve().parents[3] / "recipes"
    bpe = Recipe.from_toml(
        (root / "gpt2-stdlib-bpe.toml").read_text(),
        lambda path: hashlib.sha256(path.encode()).hexdigest(),
    )
    assert bpe.model_type == "hf" and len(bpe.artifacts()) == 4 and bpe.seq_len == 256
    assert _atoll("keygen", "--out", str(tmp_path / "f.key"))[0] == 0
    code, _, err = _atoll(
        "swarm", "init", "--name", "stdlib-gpt", "--founder", str(tmp_path / "f.key"),
        "--recipe", str(root / "stdlib-gpt.toml"), "--artifact-dir", str(tmp_path / "art"),
        "--out", str(tmp_path / "swarm.toml"),
    )  # fmt: skip
    assert code == 0, err
    manifest = load_manifest(tmp_path / "swarm.toml")
    assert manifest.recipe_dict["model"] == "tiny" and manifest.recipe_dict["steps"] == 9000
