"""A swarm's recipe document: which model, tokenizer and data its peers train, each named by hash.

Theory of operation. A founder writes a recipe in TOML (docs/recipes.md): a ``[model]`` (a
built-in GPT preset, or ``type = "hf"``: a ``transformers`` config JSON, optional initial weights
as safetensors), a ``[tokenizer]`` (a ``tokenizers`` JSON), a ``[data]`` table (read by
``node.workload.token_data.DataSpec``), the sequence length, the batch size and a ``[schedule]``.
Every file it names is an *artifact*: in the author's recipe a path, in the *canonical* recipe
(``Recipe.to_toml_data``, what ``atoll swarm init --recipe`` stores and pins in the manifest by
its SHA-256, ``SwarmManifest.recipe_sha256``) the file's SHA-256. Peers fetch the canonical
recipe and each artifact from members by hash and check every byte against it.

Nothing in a recipe is code. Parsing refuses, with one line naming what is wrong: an unknown
table or key, ``trust_remote_code`` anywhere, a pickle-ish file (``.bin``, ``.pt``, ``.pth``,
``.pkl``, ``.pickle``, ``.ckpt``, ``.joblib``) or weights that are not safetensors, a hash that
is not 64 hex digits, and any value past its cap. ``check_hf_config`` and
``check_safetensors_header`` look inside the artifacts themselves (a config with an ``auto_map``
would load code; a "safetensors" file that is really a pickle has no safetensors header).

Pure: text and bytes in, values or ``DecodeError`` out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import DecodeError, Oversize
from protocol.wire.toml_text import load_bounded_toml

__all__ = [
    "DATA_ARTIFACT_KEYS",
    "MAX_RECIPE_BYTES",
    "MODEL_TYPES",
    "Recipe",
    "check_hf_config",
    "check_safetensors_header",
    "is_sha256",
]

MAX_RECIPE_BYTES = 64 << 10
MAX_STRING = 256
MAX_LIST = 1024
MAX_CONFIG_BYTES = 1 << 20  # a transformers config JSON: a few KB in practice
MAX_SAFETENSORS_HEADER = 64 << 20  # safetensors' own limit is 100 MB; ours is lower
MODEL_TYPES = ("gpt", "hf")
# [data] keys whose values are artifacts (lists of files); the rest of the table is DataSpec's
DATA_ARTIFACT_KEYS = ("files", "validation")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[a-z][a-z0-9_]{0,39}")
_PRESET = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")
_TOP = {"recipe", "model", "tokenizer", "data", "schedule"}
_RECIPE_KEYS = {"name", "seq_len", "batch_size", "seed"}
_MODEL_KEYS = {"type", "preset", "config", "weights"}
_TOKENIZER_KEYS = {"file"}
# the inner schedule a recipe may set, and each value's bounds (type, low, high)
SCHEDULE_BOUNDS: dict[str, tuple[type, float, float]] = {
    "steps": (int, 1, 2**40),
    "lr": (float, 0.0, 10.0),
    "warmup_steps": (int, 0, 2**40),
    "min_lr_ratio": (float, 0.0, 1.0),
    "inner_steps": (int, 1, 2**31),
    "fragments": (int, 1, 4096),
}
_INT_BOUNDS = {"seq_len": (1, 1 << 16), "batch_size": (1, 1 << 16), "seed": (0, 2**63 - 1)}

Scalar = str | int | float | bool
DataValue = Scalar | tuple[str, ...]


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 as recipes write it: 64 lower-case hex digits."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _fail(what: str) -> DecodeError:
    return DecodeError(f"recipe: {what}")


def _refuse_code(node: object, where: str) -> None:
    """Refuse ``trust_remote_code`` under any key, at any depth, and any pickle-ish file name."""
    if isinstance(node, dict):
        for key, value in node.items():
            if str(key).lower().replace("-", "_") == "trust_remote_code":
                raise _fail(
                    f"{where}{key} is refused: a recipe names data, never code "
                    "(no trust_remote_code)"
                )
            _refuse_code(value, f"{where}{key}.")
    elif isinstance(node, list):
        for item in node:
            _refuse_code(item, where)
    elif isinstance(node, str) and node.lower().endswith(_PICKLE_SUFFIXES):
        raise _fail(
            f"{where.rstrip('.')} = {node[:80]!r} is a pickle-ish file, which could run code "
            "when loaded: give weights as .safetensors and data as text"
        )


def _table(data: Mapping[str, Any], name: str, allowed: set[str]) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise _fail(f"[{name}] must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(f"unknown key {name}.{unknown[0]}; [{name}] takes {', '.join(sorted(allowed))}")
    return dict(table)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_STRING:
        raise _fail(f"{where} must be a string of 1-{MAX_STRING} characters")
    return value


def _integer(value: object, where: str, low: float, high: float) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(f"{where} must be an integer in [{low:g}, {high:g}], got {value!r}")
    return value


def _artifact(value: object, where: str, resolve: Callable[[str], str] | None) -> str:
    """An artifact's hash: a 64-hex value as it is, a path through ``resolve`` (the founder's
    ``swarm init``); without ``resolve`` (a canonical recipe) only hashes are taken."""
    text = _string(value, where)
    if is_sha256(text):
        return text
    if resolve is None:
        raise _fail(
            f"{where} must be the artifact's SHA-256 (64 lower-case hex digits), got {text[:80]!r}"
        )
    digest = resolve(text)
    if not is_sha256(digest):
        raise LookupError(f"resolving {where} gave {digest[:80]!r}, not a SHA-256")
    return digest


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """A recipe, every artifact named by its SHA-256 (see the module docstring)."""

    name: str = ""
    model_type: str = "gpt"
    preset: str = ""  # gpt: the built-in preset's name
    config: str = ""  # hf: the transformers config JSON's hash
    weights: str = ""  # hf: initial weights (safetensors) hash; "": the config's seeded init
    tokenizer: str = ""  # a tokenizers JSON's hash; "": bytes (the built-in GPT only)
    seq_len: int = 128
    batch_size: int = 16
    seed: int = 0
    data: tuple[tuple[str, DataValue], ...] = ()  # [data], sorted; () : the standard library
    schedule: tuple[tuple[str, int | float], ...] = ()  # sorted

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise _fail(
                f"unknown model type {self.model_type[:40]!r}; choose one of {', '.join(MODEL_TYPES)}"
            )
        if self.model_type == "gpt" and not _PRESET.fullmatch(self.preset):
            raise _fail('model.preset must name a built-in GPT preset (type = "gpt")')
        if self.model_type == "hf" and (not self.config or not self.tokenizer):
            raise _fail('type = "hf" needs model.config and tokenizer.file')
        if self.model_type == "gpt" and (self.config or self.weights):
            raise _fail('model.config and model.weights are for type = "hf"')
        if self.data and not self.tokenizer:
            raise _fail("a recipe with [data] needs tokenizer.file")
        for where, digest in (
            ("model.config", self.config),
            ("model.weights", self.weights),
            ("tokenizer.file", self.tokenizer),
        ):
            if digest and not is_sha256(digest):
                raise _fail(f"{where} must be 64 lower-case hex digits")

    # -- what a peer must hold ------------------------------------------------------------------
    def artifacts(self) -> tuple[str, ...]:
        """Every artifact's hash (model, tokenizer, data), each once, in recipe order."""
        found = [self.config, self.weights, self.tokenizer]
        for key, value in self.data:
            if key in DATA_ARTIFACT_KEYS and isinstance(value, tuple):
                found += value
        return tuple(dict.fromkeys(d for d in found if d))

    @property
    def data_table(self) -> dict[str, Any]:
        """[data] as ``DataSpec.from_table`` reads it (lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.data}

    @property
    def schedule_dict(self) -> dict[str, int | float]:
        return dict(self.schedule)

    # -- TOML -------------------------------------------------------------------------------------
    def to_toml_data(self) -> dict[str, Any]:
        """The canonical recipe as TOML-ready data: every artifact by hash."""
        recipe: dict[str, Any] = {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }
        if self.name:
            recipe["name"] = self.name
        model: dict[str, Any] = {"type": self.model_type}
        for key in ("preset", "config", "weights"):
            if getattr(self, key):
                model[key] = getattr(self, key)
        out: dict[str, Any] = {"recipe": recipe, "model": model}
        if self.tokenizer:
            out["tokenizer"] = {"file": self.tokenizer}
        if self.data:
            out["data"] = self.data_table
        if self.schedule:
            out["schedule"] = dict(self.schedule)
        return out

    @classmethod
    def from_toml(cls, text: str | bytes, resolve: Callable[[str], str] | None = None) -> Recipe:
        """Parse a recipe. Without ``resolve`` it must be canonical (every artifact a hash); with
        it (``swarm init``), a path is handed to ``resolve``, which returns the file's hash.
        Raises ``Oversize`` or ``DecodeError`` (one line, ``recipe: ...``)."""
        data = load_bounded_toml(text, limit=MAX_RECIPE_BYTES, what="recipe")
        return cls.from_data(data, resolve)

    @classmethod
    def from_data(
        cls, data: Mapping[str, Any], resolve: Callable[[str], str] | None = None
    ) -> Recipe:
        """``from_toml`` on parsed TOML."""
        _refuse_code(dict(data), "")
        unknown = sorted(set(data) - _TOP)
        if unknown:
            raise _fail(f"unknown table [{unknown[0]}]; a recipe has {', '.join(sorted(_TOP))}")
        top = _table(data, "recipe", _RECIPE_KEYS)
        model = _table(data, "model", _MODEL_KEYS)
        tokenizer = _table(data, "tokenizer", _TOKENIZER_KEYS)
        kind = _string(model.get("type", "gpt"), "model.type")
        if "weights" in model and not is_sha256(model["weights"]):
            weights = _string(model["weights"], "model.weights")
            if not weights.lower().endswith(".safetensors"):
                raise _fail(
                    f"model.weights = {weights[:80]!r} is not a .safetensors file; "
                    "weights travel only as safetensors"
                )
        ints = {
            k: _integer(top[k], f"recipe.{k}", *_INT_BOUNDS[k]) for k in _INT_BOUNDS if k in top
        }
        return cls(
            name=_string(top["name"], "recipe.name") if "name" in top else "",
            model_type=kind,
            preset=_string(model["preset"], "model.preset") if "preset" in model else "",
            config=_artifact(model["config"], "model.config", resolve) if "config" in model else "",
            weights=(
                _artifact(model["weights"], "model.weights", resolve) if "weights" in model else ""
            ),
            tokenizer=(
                _artifact(tokenizer["file"], "tokenizer.file", resolve)
                if "file" in tokenizer
                else ""
            ),
            data=_data(data.get("data", {}), resolve),
            schedule=_schedule(data.get("schedule", {})),
            **ints,
        )


def _data(table: object, resolve: Callable[[str], str] | None) -> tuple[tuple[str, DataValue], ...]:
    """[data]: scalars and lists of strings, bounded; the artifact keys resolved to hashes. Its
    keys' meaning is ``DataSpec``'s (node side), which refuses the ones it does not know."""
    if not isinstance(table, dict):
        raise _fail("[data] must be a table")
    if len(table) > 32:
        raise _fail("[data] holds at most 32 keys")
    out: list[tuple[str, DataValue]] = []
    for key, value in table.items():
        if not _KEY.fullmatch(key):
            raise _fail(f"data key {key[:40]!r} is not a lower-case identifier")
        where = f"data.{key}"
        if isinstance(value, list):
            if len(value) > MAX_LIST:
                raise _fail(f"{where} holds at most {MAX_LIST} entries, got {len(value)}")
            if key in DATA_ARTIFACT_KEYS:
                out.append(
                    (
                        key,
                        tuple(_artifact(v, f"{where}[{i}]", resolve) for i, v in enumerate(value)),
                    )
                )
            else:
                out.append((key, tuple(_string(v, f"{where}[{i}]") for i, v in enumerate(value))))
        elif key in DATA_ARTIFACT_KEYS:
            raise _fail(f"{where} must be a list of files")
        elif isinstance(value, str):
            out.append((key, _string(value, where)))
        elif isinstance(value, bool):
            out.append((key, value))
        elif isinstance(value, int):
            out.append((key, _integer(value, where, -(2**63), 2**63 - 1)))
        elif isinstance(value, float) and math.isfinite(value):
            out.append((key, value))
        else:
            raise _fail(f"{where} must be a string, a finite number, a bool or a list of strings")
    return tuple(sorted(out))


def _schedule(table: object) -> tuple[tuple[str, int | float], ...]:
    if not isinstance(table, dict):
        raise _fail("[schedule] must be a table")
    out: list[tuple[str, int | float]] = []
    for key, value in table.items():
        if key not in SCHEDULE_BOUNDS:
            raise _fail(
                f"unknown key schedule.{str(key)[:40]}; [schedule] takes "
                f"{', '.join(sorted(SCHEDULE_BOUNDS))}"
            )
        kind, low, high = SCHEDULE_BOUNDS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int:
            out.append((key, _integer(value, f"schedule.{key}", low, high)))
        elif isinstance(value, float) and math.isfinite(value) and low <= value <= high:
            out.append((key, value))
        else:
            raise _fail(f"schedule.{key} must be a number in [{low:g}, {high:g}], got {value!r}")
    return tuple(sorted(out))


# --- inside the artifacts ------------------------------------------------------------------------
def _refuse_remote_code(node: object, where: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("auto_map", "trust_remote_code"):
                raise _fail(
                    f"the model config has {where}{key}, which makes transformers load code: refused"
                )
            _refuse_remote_code(value, f"{where}{key}.")
    elif isinstance(node, list):
        for item in node:
            _refuse_remote_code(item, where)


def check_hf_config(raw: bytes) -> dict[str, Any]:
    """A transformers config JSON (an artifact's bytes) as a dict; raises ``DecodeError`` for one
    that is not a JSON object with a ``model_type``, or that would load code (``auto_map``,
    ``trust_remote_code``), and ``Oversize`` past ``MAX_CONFIG_BYTES``."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise Oversize(f"recipe: the model config is {len(raw)} bytes, over {MAX_CONFIG_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _fail(f"the model config is not JSON: {' '.join(str(exc).split())[:120]}") from None
    if not isinstance(data, dict):
        raise _fail("the model config must be a JSON object")
    _refuse_remote_code(data, "")
    kind = data.get("model_type")
    if not isinstance(kind, str) or not _PRESET.fullmatch(kind):
        raise _fail('the model config needs a model_type such as "gpt2"')
    return data


def check_safetensors_header(head: bytes, size: int) -> dict[str, Any]:
    """The JSON header of a safetensors file whose first bytes are ``head`` (at least 8, and the
    whole header) and whose length is ``size``; raises ``DecodeError`` for anything else (a pickle
    renamed .safetensors included). Returns the header (tensor name -> dtype, shape, offsets)."""
    if len(head) < 8:
        raise _fail("the weights are not a safetensors file (shorter than its 8-byte header size)")
    n = int.from_bytes(head[:8], "little")
    if not 2 <= n <= MAX_SAFETENSORS_HEADER or 8 + n > size:
        raise _fail(
            f"the weights are not a safetensors file (header size {n} of a {size}-byte file)"
        )
    if len(head) < 8 + n:
        raise LookupError(f"need the first {8 + n} bytes to check the header")
    try:
        header = json.loads(head[8 : 8 + n])
    except (ValueError, RecursionError):
        raise _fail("the weights are not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise _fail("the weights are not a safetensors file (its header is not an object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _fail(f"the weights' tensor {str(name)[:60]!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise _fail(f"the weights' tensors end at byte {8 + n + end}, past the file's {size}")
    return header
