"""A swarm's recipe on the command line: stored and checked by the founder (``swarm init
--recipe``), fetched and checked by a joiner (``atoll join``), before any training starts.

The founder's ``init_recipe`` reads the recipe TOML, stores every file it names in the artifact
store (``node.state.artifacts``; paths are relative to the recipe's folder), checks what each one
holds (``check_artifacts``), and stores the canonical recipe, whose hash the manifest pins. A
joiner's ``prepare_recipe`` fetches the recipe and every artifact it lacks from peers
(``node.state.artifact_fetch``), verified by hash, and runs the same checks. Every mistake is a
``RecipeError``: one line, said before a socket opens to train.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomli_w

from node.config import RunConfig
from node.run.checks import RECIPE_MODEL  # the manifest's model field for a transformers model
from node.state.artifact_fetch import ArtifactFetcher, Get
from node.state.artifacts import ArtifactError, ArtifactStore
from protocol.errors import RemoteProtocolError
from protocol.wire.membership import SwarmManifest
from protocol.wire.recipe import Recipe, check_safetensors_header

__all__ = [
    "RECIPE_MODEL",
    "LoadedRecipe",
    "RecipeError",
    "check_artifacts",
    "init_recipe",
    "prepare_recipe",
    "recipe_config",
]

log = logging.getLogger("atoll.recipe")


class RecipeError(ValueError):
    """A recipe that cannot be used (one line: what is wrong and what to do)."""


@dataclass(frozen=True, slots=True)
class LoadedRecipe:
    """A recipe whose artifacts are all held and checked: what ``atoll join`` trains."""

    recipe: Recipe
    sha256: str
    store: ArtifactStore
    files: dict[str, Path]  # artifact hash -> its verified file
    vocab_size: int  # the tokenizer's (256: bytes, the built-in GPT without a tokenizer)

    @property
    def cache_dir(self) -> Path:
        """Where tokenised shards are cached (in the artifact folder, apart from the artifacts)."""
        return self.store.root / "tokens"


def recipe_config(recipe: Recipe, base: RunConfig) -> RunConfig:
    """``base`` with the recipe's model, batch size, tokens per step, seed and schedule: the
    flat fields the manifest carries besides the recipe's hash (every peer checks those)."""
    fields: dict[str, Any] = dict(recipe.schedule)
    if recipe.data:  # without [data], the built-in GPT on the standard library: its own context
        fields["max_tokens_per_step"] = recipe.batch_size * recipe.seq_len
    return replace(
        base,
        model=recipe.preset if recipe.model_type == "gpt" else RECIPE_MODEL,
        batch_size=recipe.batch_size,
        seed=recipe.seed,
        **fields,
    )


def _one_line(exc: BaseException) -> str:
    text = exc.reason if isinstance(exc, RemoteProtocolError) else str(exc)
    return " ".join(text.split())


def check_artifacts(recipe: Recipe, files: dict[str, Path]) -> int:
    """Check what each artifact holds: the model config (no code, a model type transformers
    knows), the weights (a safetensors header), the tokenizer (a tokenizers JSON) and [data]
    (``DataSpec``). Returns the tokenizer's vocabulary size. Raises ``RecipeError``."""
    from node.workload.recipe_model import RecipeModelError, hf_config, tokenizer_vocab

    try:
        vocab = tokenizer_vocab(files[recipe.tokenizer]) if recipe.tokenizer else 256
        if recipe.model_type == "hf":
            hf_config(files[recipe.config].read_bytes())
        if recipe.weights:
            path = files[recipe.weights]
            with path.open("rb") as f:
                head = f.read(8)
                head += f.read(min(int.from_bytes(head.ljust(8, b"\0"), "little"), 64 << 20))
            check_safetensors_header(head, path.stat().st_size)
        if recipe.data:
            from node.workload.token_data import DataSpec

            DataSpec.from_table(recipe.data_table)
    except (RemoteProtocolError, RecipeModelError, ValueError, OSError) as exc:
        raise RecipeError(_one_line(exc)) from None
    return vocab


def init_recipe(path: Path, store: ArtifactStore) -> tuple[Recipe, str]:
    """The founder's side: parse the recipe at ``path``, store every file it names and the
    canonical recipe; returns the recipe and the canonical recipe's hash. Raises ``RecipeError``."""
    folder = path.parent

    def resolve(name: str) -> str:
        file = Path(name) if Path(name).is_absolute() else folder / name
        try:
            return store.put_file(file)
        except OSError as exc:
            raise RecipeError(f"recipe: cannot read {file}: {exc.strerror or exc}") from None

    try:
        recipe = Recipe.from_toml(path.read_bytes(), resolve)
    except OSError as exc:
        raise RecipeError(f"cannot read the recipe {path}: {exc.strerror or exc}") from None
    except RemoteProtocolError as exc:
        raise RecipeError(exc.reason) from None
    files = {d: store.open_verified(d) for d in recipe.artifacts()}
    check_artifacts(recipe, files)
    digest = store.put_bytes(tomli_w.dumps(recipe.to_toml_data()).encode())
    return recipe, digest


def prepare_recipe(
    manifest: SwarmManifest, store: ArtifactStore, get: Get, sources: list[str]
) -> LoadedRecipe:
    """The joiner's side: the manifest's recipe and every artifact it names, fetched from
    ``sources`` (and the members they name) where this peer lacks them, verified, checked.
    Raises ``RecipeError`` with one line."""
    fetcher = ArtifactFetcher(store, get)
    try:
        (text_path,) = fetcher.ensure([manifest.recipe_sha256], sources).values()
        recipe = Recipe.from_toml(text_path.read_bytes())
        files = fetcher.ensure(recipe.artifacts(), sources)
    except ArtifactError as exc:
        raise RecipeError(_one_line(exc)) from None
    except RemoteProtocolError as exc:
        raise RecipeError(exc.reason) from None
    if fetcher.fetched:
        log.info(
            "fetched %d artifact(s) (%d bytes) from %s",
            len(fetcher.fetched),
            fetcher.bytes_received,
            sorted(set(fetcher.fetched.values())),
        )
    vocab = check_artifacts(recipe, files)
    return LoadedRecipe(recipe, manifest.recipe_sha256, store, files, vocab)
