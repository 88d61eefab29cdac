"""A recipe's data: tokenised shards dealt over the learners, and a fixed validation set.

The recipe's ``[data]`` table (``DataSpec``) names the training text by artifact hash (local
files, text or JSON lines) or by a Hugging Face ``datasets`` name and split, a shard count, and
the validation set's artifacts. ``RecipeData`` turns them into batches:

    train files  [f0 .......... f1 ..... f2 ...............]   bytes, in the recipe's order
    shards       [ s0 | s1 | s2 | s3 | ... | s(n-1) ]           n even byte ranges, each cut
                                                                 at a line end (a record's, for
                                                                 JSON lines), so a shard
                                                                 tokenises alone
    dealt        learner l holds the shards protocol.diloco.shard_deal deals it (rendezvous
                 with bounded loads: disjoint while the learner set holds, shards // learners
                 or one more each, few move when a learner joins or leaves)
    batches      random windows of seq_len + 1 tokens from the dealt shards only (a learner
                 dealt none that holds a window borrows one, in its own rendezvous order)

A shard is tokenised the first time it is dealt here, in chunks of at most 1 MiB, and cached
under ``cache_dir`` as a token file (a 64-byte header with a BLAKE2b digest, then uint16 tokens
when the vocabulary fits, uint32 otherwise) that is memory-mapped, never loaded whole. Cache
folders are keyed by the artifact hashes, the tokenizer file's hash and the shard count; files
are written to a temporary name and renamed, so a crash leaves no half file, and a file whose
digest does not match on reuse is rebuilt. Byte shards mean a peer tokenises only what it is
dealt. ``source = "hf"`` shards by ``datasets``' own streaming shards (or by record index).

Validation is the validation artifacts' whole token stream: every peer holding the same
artifacts and tokenizer scores the same windows. Nothing here runs code from data: tokenizers
are JSON, records are JSON, token files are raw integers.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import logging
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.state.artifacts import sha256_file
from node.state.atomic import atomic_write
from protocol.diloco.shard_deal import MAX_SHARDS, deal, shard_preference

__all__ = [
    "CHUNK_BYTES",
    "DataError",
    "DataSpec",
    "RecipeData",
    "RecipeFiles",
    "TrainStream",
    "read_token_file",
    "write_token_file",
]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # the most bytes read or tokenised at once
MAX_FILES = 4096  # artifacts in one [data] list
MAX_ARTIFACT_BYTES = 1 << 40  # one text or jsonl artifact (1 TiB)
MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizers JSON; GPT-2's is 1.4 MB
MAX_VOCAB = 1 << 31  # token ids are stored as uint32 above 65535
MAX_RECORD_BYTES = 64 << 20  # one JSON line
MAX_SHARD_TOKENS = 1 << 34  # a streamed ("hf") shard stops here
MAX_WINDOWS = 1 << 16  # validation windows in one call
MAX_OPEN_SHARDS = 256  # memory maps a train stream keeps open (each holds a file descriptor)
MAX_HF_NAME = 200
EOT = "<|endoftext|>"  # appended after each document when the tokenizer has it

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HF_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?")
_HF_REVISION = re.compile(r"[\w.\-/]*")
_HF_SPLIT = re.compile(r"[\w.\-\[\]:%+]+")
_TABLE_KEYS = frozenset(
    {
        "source",
        "files",
        "format",
        "text_field",
        "hf_name",
        "hf_split",
        "hf_revision",
        "shards",
        "validation",
    }
)


class DataError(ValueError):
    """A recipe's data cannot be read or used: a missing or oversized artifact, a bad tokenizer,
    a malformed record, too little text for one window. The message is one line and says what
    to do."""


# -----------------------------------------------------------------------------
# the [data] table


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """The recipe's ``[data]`` table.

    source: ``"files"`` (``files`` are artifacts, sha256 hex) or ``"hf"`` (``hf_name`` and
    ``hf_split`` through ``datasets`` streaming, on machines that reach the hub; ``hf_revision``
    pins a commit, since a hub dataset can change under a running swarm).
    format: how the ``files`` and ``validation`` artifacts are read: ``"text"`` (each file one
    document) or ``"jsonl"`` (one JSON object a line, its ``text_field`` string a document).
    shards: how many shards the training text is cut into (deal more shards than learners).
    validation: the validation set's artifacts (same ``format``), required for both sources.
    Raises ValueError with one line naming the bad field.
    """

    source: str = "files"
    files: tuple[str, ...] = ()
    format: str = "text"
    text_field: str = "text"
    hf_name: str = ""
    hf_split: str = "train"
    hf_revision: str = ""
    shards: int = 64
    validation: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.source not in ("files", "hf"):
            raise ValueError(f'data.source must be "files" or "hf", got {self.source!r}')
        if self.format not in ("text", "jsonl"):
            raise ValueError(f'data.format must be "text" or "jsonl", got {self.format!r}')
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"data.shards must be 1 to {MAX_SHARDS}, got {self.shards}")
        if not self.text_field or len(self.text_field) > 100:
            raise ValueError("data.text_field must be a field name of 1 to 100 characters")
        _check_hashes("data.validation", self.validation, required=True)
        if self.source == "files":
            _check_hashes("data.files", self.files, required=True)
            if self.hf_name or self.hf_revision:
                raise ValueError(
                    'data.hf_name and hf_revision are for source = "hf": remove them or change source'
                )
        else:
            if self.files:
                raise ValueError('data.files is for source = "files": remove it or change source')
            if len(self.hf_name) > MAX_HF_NAME or not _HF_NAME.fullmatch(self.hf_name):
                raise ValueError(
                    f'data.hf_name must be a datasets name like "user/name", got {self.hf_name!r}'
                )
            if len(self.hf_split) > 100 or not _HF_SPLIT.fullmatch(self.hf_split):
                raise ValueError(
                    f'data.hf_split must be a split like "train", got {self.hf_split!r}'
                )
            if len(self.hf_revision) > 100 or not _HF_REVISION.fullmatch(self.hf_revision):
                raise ValueError(
                    f"data.hf_revision must be a commit hash, tag or branch, got {self.hf_revision!r}"
                )

    @classmethod
    def from_table(cls, table: Mapping[str, object]) -> DataSpec:
        """The spec of a parsed ``[data]`` table. Raises ValueError (one line) for an unknown
        key, a value of the wrong type, or a bad value."""
        unknown = sorted(set(table) - _TABLE_KEYS)
        if unknown:
            raise ValueError(f"data.{unknown[0]} is not a [data] key: use {sorted(_TABLE_KEYS)}")
        kwargs: dict[str, Any] = {}
        for key, value in table.items():
            if key in ("files", "validation"):
                if not isinstance(value, list | tuple) or not all(
                    isinstance(v, str) for v in value
                ):
                    raise ValueError(f"data.{key} must be a list of sha256 hex strings")
                kwargs[key] = tuple(value)
            elif key == "shards":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"data.shards must be an integer, got {value!r}")
                kwargs[key] = value
            else:
                if not isinstance(value, str):
                    raise ValueError(f"data.{key} must be a string, got {value!r}")
                kwargs[key] = value
        return cls(**kwargs)

    def to_table(self) -> dict[str, object]:
        """The ``[data]`` table that ``from_table`` reads back to this spec (defaults included)."""
        table: dict[str, object] = {"source": self.source, "format": self.format}
        if self.source == "files":
            table["files"] = list(self.files)
        else:
            table |= {"hf_name": self.hf_name, "hf_split": self.hf_split}
            if self.hf_revision:
                table["hf_revision"] = self.hf_revision
        table |= {
            "text_field": self.text_field,
            "shards": self.shards,
            "validation": list(self.validation),
        }
        return table

    def artifacts(self) -> tuple[str, ...]:
        """Every artifact hash a peer must hold to train and validate, each once, in order."""
        return tuple(dict.fromkeys(self.files + self.validation))


def _check_hashes(name: str, hashes: tuple[str, ...], *, required: bool) -> None:
    if required and not hashes:
        raise ValueError(f"{name} is empty: list at least one artifact (sha256 hex)")
    if len(hashes) > MAX_FILES:
        raise ValueError(f"{name} lists {len(hashes)} artifacts, more than {MAX_FILES}: join files")
    for h in hashes:
        if not _HEX64.fullmatch(h):
            raise ValueError(f"{name} holds {h[:80]!r}, not a sha256 hex digest (64 lowercase hex)")


# -----------------------------------------------------------------------------
# token files: a 64-byte header, then the tokens

_MAGIC = b"ATOLLTOK"
_HEADER = struct.Struct("<8sIIQ32s")  # magic, version, itemsize, count, blake2b-256 of the body
_HEADER_BYTES = 64


def write_token_file(path: Path, chunks: Iterable[np.ndarray], *, dtype: np.dtype[Any]) -> int:
    """Write the token ``chunks`` (1-D integer arrays) to ``path`` as ``dtype``, atomically: a
    temporary file in the same folder, fsynced, then renamed over ``path``. Returns the count.
    Raises OverflowError if a token does not fit ``dtype``."""
    with atomic_write(path) as out:
        out.write(bytes(_HEADER_BYTES))
        digest, count = hashlib.blake2b(digest_size=32), 0
        top = np.iinfo(dtype).max
        for chunk in chunks:
            if chunk.size and (int(chunk.max()) > top or int(chunk.min()) < 0):
                raise OverflowError(f"a token id outside 0..{top} for {dtype}")
            body = np.ascontiguousarray(chunk, dtype=dtype).astype(dtype.newbyteorder("<"))
            raw = body.tobytes()
            digest.update(raw)
            out.write(raw)
            count += chunk.size
        header = _HEADER.pack(_MAGIC, 1, dtype.itemsize, count, digest.digest())
        out.seek(0)
        out.write(header.ljust(_HEADER_BYTES, b"\0"))
    return count


def read_token_file(path: Path, *, dtype: np.dtype[Any], verify: bool = True) -> np.ndarray:
    """The tokens of ``path`` as a read-only memory map of ``dtype`` (little-endian).

    ``verify`` checks the body's digest (read in 1 MiB chunks). Raises DataError if the file is
    short, not a token file, of another dtype, or its digest does not match."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES:
            raise DataError(f"token file {path} is shorter than its header: delete it")
        magic, version, itemsize, count, want = _HEADER.unpack_from(head)
        if magic != _MAGIC or version != 1 or itemsize != dtype.itemsize:
            raise DataError(f"{path} is not a version-1 token file of {dtype}: delete it")
        if size != _HEADER_BYTES + count * itemsize:
            raise DataError(f"token file {path} holds {size} bytes, not {count} tokens: delete it")
        if verify:
            digest = hashlib.blake2b(digest_size=32)
            while block := f.read(CHUNK_BYTES):
                digest.update(block)
            if digest.digest() != want:
                raise DataError(f"token file {path} does not match its digest: delete it")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    little = dtype.newbyteorder("<")
    return np.memmap(path, dtype=little, mode="r", offset=_HEADER_BYTES, shape=(count,))


def _cached_tokens(
    path: Path, build: Callable[[], Iterable[np.ndarray]], *, dtype: np.dtype[Any]
) -> np.ndarray:
    """The token file at ``path``, built by ``build`` first if it is missing or damaged."""
    if path.exists():
        try:
            return read_token_file(path, dtype=dtype)
        except DataError as e:
            log.warning("rebuilding a damaged token cache file: %s", e)
    count = write_token_file(path, build(), dtype=dtype)
    log.info("tokenised %d tokens into %s", count, path)
    return read_token_file(path, dtype=dtype, verify=False)


# -----------------------------------------------------------------------------
# the tokenizer


class _Tokenizer:
    """A ``tokenizers`` JSON tokenizer, bounded in size, with its file hash and end-of-text id."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            size = path.stat().st_size
        except OSError as e:
            raise DataError(f"tokenizer file {path} cannot be read ({e.strerror}): fetch it") from e
        if size > MAX_TOKENIZER_BYTES:
            raise DataError(
                f"tokenizer file {path} is {size} bytes, over {MAX_TOKENIZER_BYTES}: "
                "use a tokenizers JSON of a normal vocabulary"
            )
        raw = path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self.inner = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad JSON
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{path} is not a tokenizers JSON file ({first[:200]})") from e
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        if not 1 <= self.vocab_size <= MAX_VOCAB:
            raise DataError(f"tokenizer vocabulary of {self.vocab_size} is outside 1..{MAX_VOCAB}")
        self.dtype: np.dtype[Any] = np.dtype(np.uint16 if self.vocab_size <= 65535 else np.uint32)
        self.eot: int | None = self.inner.token_to_id(EOT)

    def encode(self, texts: list[str], *, end_documents: bool) -> Iterator[np.ndarray]:
        """The ids of ``texts`` in order, one EOT after each when ``end_documents`` (and the
        tokenizer has one), as int64 arrays. Each text is cut into pieces of about 64 K
        characters after a line end, and pieces are encoded in batches of about 1 MiB
        (``tokenizers`` spreads a batch over the cores), so memory stays bounded and the ids are
        a function of the text alone."""
        tail = [self.eot] if end_documents and self.eot is not None else []
        batch: list[str] = []
        ends: set[int] = set()  # indices in batch of a text's last piece
        size = 0
        for text in texts:
            pieces = _line_pieces(text)
            for k, piece in enumerate(pieces):
                if k == len(pieces) - 1:
                    ends.add(len(batch))
                batch.append(piece)
                size += len(piece)
                if size >= CHUNK_BYTES:
                    yield self._encode(batch, ends, tail)
                    batch, ends, size = [], set(), 0
        if batch:
            yield self._encode(batch, ends, tail)

    def _encode(self, batch: list[str], ends: set[int], tail: list[int]) -> np.ndarray:
        encoded = self._encode_batch(batch, add_special_tokens=False)
        out = [
            np.asarray([*e.ids, *tail] if k in ends else e.ids, dtype=np.int64)
            for k, e in enumerate(encoded)
        ]
        return np.concatenate(out)

    @property
    def _encode_batch(self) -> Callable[..., list[Any]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we never read
        return getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)


def _line_pieces(text: str, size: int = 1 << 16) -> list[str]:
    """``text`` cut after the first line end at or past every ``size`` characters ([text] when
    it has none there; [""] for an empty text, so each text keeps one piece)."""
    pieces, start = [], 0
    while start < len(text):
        nl = text.find("\n", start + size)
        end = len(text) if nl < 0 else nl + 1
        pieces.append(text[start:end])
        start = end
    return pieces or [""]


# -----------------------------------------------------------------------------
# byte shards of local files


@dataclass(frozen=True, slots=True)
class _Piece:
    """Bytes [start, end) of one file; ``ends_file`` when ``end`` is the file's end."""

    path: Path
    start: int
    end: int
    ends_file: bool


class _ByteShards:
    """The training files cut into ``n`` byte ranges of about equal size, each cut moved forward
    to just after a line end (so a shard starts at a line or record), and read back as pieces."""

    def __init__(self, files: Sequence[Path], n: int, *, jsonl: bool) -> None:
        self.files = list(files)
        self.sizes = [f.stat().st_size for f in self.files]
        self.offsets = np.cumsum([0, *self.sizes]).tolist()  # global start of each file
        self.total = int(self.offsets[-1])
        self.jsonl = jsonl
        cuts = [0]
        for k in range(1, n):
            cuts.append(max(cuts[-1], self._line_cut(k * self.total // n)))
        self.cuts = [*cuts, self.total]
        empty = sum(1 for a, b in itertools.pairwise(self.cuts) if a == b)
        if empty:  # a learner dealt only empty shards borrows one (TrainStream)
            log.warning(
                "%d of %d shards are empty (%d bytes, lines or records longer than a shard): "
                "fewer data.shards would spread the text evenly",
                empty,
                n,
                self.total,
            )

    def _line_cut(self, at: int) -> int:
        """The global offset just after the first line end at or after ``at`` (or the end of
        its file). A text file scans at most 1 MiB and cuts at a UTF-8 character boundary when
        no line ends there; a JSON-lines file scans at most one record's bound."""
        i = int(np.searchsorted(self.offsets, at, side="right")) - 1
        if i >= len(self.files) or at == self.offsets[i]:
            return at
        local, limit = at - self.offsets[i], MAX_RECORD_BYTES if self.jsonl else CHUNK_BYTES
        with self.files[i].open("rb") as f:
            f.seek(local)
            scanned, block = 0, b""
            while scanned < limit and (block := f.read(min(1 << 16, limit - scanned))):
                if (nl := block.find(b"\n")) >= 0:
                    return at + scanned + nl + 1
                scanned += len(block)
            if not block:
                return int(self.offsets[i + 1])  # the file ends before a line does
            if self.jsonl:
                raise DataError(
                    f"{self.files[i]} has a JSON line longer than {MAX_RECORD_BYTES} bytes "
                    f"near byte {local}: split the record"
                )
            f.seek(local)
            head = f.read(4)
        back = next((j for j in range(len(head)) if head[j] & 0xC0 != 0x80), 0)
        return at + back  # the first byte of a character, not a continuation byte

    def pieces(self, shard: int) -> list[_Piece]:
        """The per-file pieces of ``shard``, in order."""
        lo, hi = self.cuts[shard], self.cuts[shard + 1]
        out = []
        for i, f in enumerate(self.files):
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i + 1])
            if a < b:
                start, end = a - self.offsets[i], b - self.offsets[i]
                out.append(_Piece(f, int(start), int(end), end == self.sizes[i]))
        return out


def _text_blocks(piece: _Piece) -> Iterator[bytes]:
    """The bytes of ``piece`` in blocks of at most 1 MiB, each cut after its last line end (or
    at a character boundary when a block holds none), so no block splits a line needlessly."""
    with piece.path.open("rb") as f:
        f.seek(piece.start)
        left, carry = piece.end - piece.start, b""
        while left > 0 or carry:
            fresh = f.read(min(CHUNK_BYTES - len(carry), left))
            if not fresh and left > 0:
                raise DataError(f"{piece.path} shrank while being read: fetch it again")
            block, left = carry + fresh, left - len(fresh)
            if left <= 0:
                yield block
                return
            cut = block.rfind(b"\n") + 1 or _char_boundary(block)
            carry = block[cut:]
            yield block[:cut]


def _char_boundary(block: bytes) -> int:
    """The last offset in ``block`` where a UTF-8 character starts (len(block) if none can)."""
    for j in range(len(block) - 1, max(len(block) - 4, 0) - 1, -1):
        if block[j] & 0xC0 != 0x80:
            return j or len(block)
    return len(block)


def _jsonl_records(piece: _Piece, text_field: str) -> Iterator[str]:
    """The ``text_field`` strings of the JSON lines in ``piece``, read in 1 MiB blocks.
    Raises DataError for a line that is not a JSON object with that string field."""
    with piece.path.open("rb") as f:
        f.seek(piece.start)
        left, carry, offset = piece.end - piece.start, b"", piece.start
        while left > 0 or carry:
            block = f.read(min(CHUNK_BYTES, left))
            if not block and left > 0:
                raise DataError(f"{piece.path} shrank while being read: fetch it again")
            left -= len(block)
            lines = (carry + block).split(b"\n")
            carry = lines.pop() if left > 0 else b""
            if len(carry) > MAX_RECORD_BYTES:
                raise DataError(f"{piece.path}: a JSON line over {MAX_RECORD_BYTES} bytes")
            for line in lines:
                yield from _record_text(line, text_field, piece.path, offset)
                offset += len(line) + 1


def _record_text(line: bytes, text_field: str, path: Path, offset: int) -> Iterator[str]:
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        first = str(e)[:200] or type(e).__name__
        raise DataError(f"{path} byte {offset}: not a JSON line ({first}): fix the record") from e
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f'{path} byte {offset}: no string field "{text_field}": set data.text_field'
        )
    yield text


def _tokenise_pieces(
    pieces: Sequence[_Piece], tok: _Tokenizer, *, jsonl: bool, text_field: str
) -> Iterator[np.ndarray]:
    """The token stream of ``pieces``, in chunks of at most ~1 MiB of text each."""
    for piece in pieces:
        if not jsonl:
            blocks = _text_blocks(piece)
            block = next(blocks, None)
            while block is not None:  # one block ahead, to know which block ends the file
                following = next(blocks, None)
                last = following is None and piece.ends_file
                yield from tok.encode([block.decode("utf-8", errors="replace")], end_documents=last)
                block = following
            continue
        batch: list[str] = []
        size = 0
        for text in _jsonl_records(piece, text_field):
            batch.append(text)
            size += len(text)
            if size >= CHUNK_BYTES:
                yield from tok.encode(batch, end_documents=True)
                batch, size = [], 0
        if batch:
            yield from tok.encode(batch, end_documents=True)


# -----------------------------------------------------------------------------
# source = "hf"


def _load_hf(name: str, split: str, revision: str) -> Any:
    """The streaming ``datasets`` dataset. Raises DataError (one line) if ``datasets`` is not
    installed or the dataset cannot be opened."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as e:
        raise DataError(
            'data.source = "hf" needs the datasets package: pip install datasets, '
            'or use source = "files"'
        ) from e
    try:
        return datasets.load_dataset(name, split=split, revision=revision or None, streaming=True)
    except Exception as e:  # hub, network and format errors all come here
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise DataError(
            f"hf dataset {name!r} split {split!r} cannot be read ({first}): "
            'check the name and the network, or use source = "files"'
        ) from e


def _tokenise_hf(
    dataset: Any, shard: int, n: int, tok: _Tokenizer, text_field: str
) -> Iterator[np.ndarray]:
    """Shard ``shard`` of ``n`` of a streaming dataset: its own streaming shard when the dataset
    has at least ``n``, else every n-th record; tokenised ~1 MiB of text at a time."""
    own_shards: Any = getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", 0)
    if own_shards >= n:
        records, stride = iter(dataset.shard(num_shards=n, index=shard)), 1
    else:
        records, stride = iter(dataset), n
    batch: list[str] = []
    size = total = 0
    for i, record in enumerate(records):
        if stride > 1 and i % stride != shard:
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f'hf records have no string field "{text_field}": set data.text_field')
        batch.append(text)
        size += len(text)
        if size >= CHUNK_BYTES:
            for ids in tok.encode(batch, end_documents=True):
                yield ids
                total += ids.size
            batch, size = [], 0
            if total >= MAX_SHARD_TOKENS:
                log.warning("hf shard %d stops at %d tokens (the cap)", shard, total)
                return
    if batch:
        yield from tok.encode(batch, end_documents=True)


# -----------------------------------------------------------------------------
# the recipe's data


class _VerifiedArtifacts:
    """Checks that an artifact's file hashes to its name, once: a marker under ``root`` keeps
    the (size, mtime) it had when hashed, so a later start skips rehashing an unchanged file."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def check(self, h: str, path: Path) -> Path:
        """``path``, after checking it. Raises DataError if it is missing, over the size bound,
        or does not hash to ``h``."""
        if not path.is_file():
            raise DataError(
                f"data artifact {h[:16]}… is not at {path}: fetch the recipe's artifacts"
            )
        stat = path.stat()
        if stat.st_size > MAX_ARTIFACT_BYTES:
            raise DataError(
                f"data artifact {h[:16]}… is {stat.st_size} bytes, over {MAX_ARTIFACT_BYTES}: split it"
            )
        marker, seen = self.root / h, f"{stat.st_size} {stat.st_mtime_ns}"
        if marker.is_file() and marker.read_text()[:100] == seen:
            return path
        if sha256_file(path) != h:
            raise DataError(f"{path} does not hash to {h[:16]}…: delete it and fetch it again")
        self.root.mkdir(parents=True, exist_ok=True)
        marker.write_text(seen)
        return path


def _cache_key(**parts: object) -> str:
    # format: bump when the way text becomes tokens changes, so no peer reuses an older cut
    text = json.dumps({"format": 2, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class RecipeFiles:
    """Where a recipe's files lie on this peer: ``tokenizer_file``, the tokenizers JSON;
    ``artifact_path(sha256_hex)``, where an artifact's file lies (it must exist); ``cache_dir``,
    where tokenised shards and the marks of artifacts already hashed are kept."""

    tokenizer_file: Path
    artifact_path: Callable[[str], Path]
    cache_dir: Path


class RecipeData:
    """A recipe's tokenised data for one peer: the validation windows, and ``train_stream``.

    ``files`` says where the tokenizer, the artifacts and the cache lie; each artifact is hashed
    here once, and again whenever its size or mtime changes.
    ``me`` is this peer's id (shards are dealt by it); ``seed`` with ``me`` seeds the window
    sampler. Building one reads the tokenizer, checks every artifact, cuts the shards and
    tokenises (or reuses) the validation set, so a recipe whose data cannot be read fails here,
    before training, with a DataError (a ValueError) of one line.
    """

    def __init__(
        self,
        spec: DataSpec,
        files: RecipeFiles,
        *,
        seq_len: int,
        batch_size: int,
        me: bytes,
        seed: int,
    ) -> None:
        cache_dir, artifact_path = files.cache_dir, files.artifact_path
        if not 1 <= seq_len <= 1 << 20 or not 1 <= batch_size <= 1 << 16:
            raise ValueError(
                f"seq_len must be 1 to {1 << 20} and batch_size 1 to {1 << 16}, "
                f"got {seq_len}, {batch_size}"
            )
        self.spec, self.seq_len, self.batch_size = spec, seq_len, batch_size
        self.me, self.seed = me, seed
        self.tokenizer = _Tokenizer(Path(files.tokenizer_file))
        self.vocab_size = self.tokenizer.vocab_size
        seen = _VerifiedArtifacts(Path(cache_dir) / "verified")
        paths = {h: seen.check(h, Path(artifact_path(h))) for h in spec.artifacts()}
        common = {"tokenizer": self.tokenizer.sha256, "format": spec.format}
        common["text_field"] = spec.text_field
        self.shard_dir = Path(cache_dir) / _cache_key(
            source=spec.source,
            files=spec.files,
            hf=[spec.hf_name, spec.hf_split, spec.hf_revision],
            shards=spec.shards,
            **common,
        )
        jsonl = spec.format == "jsonl"
        self._bytes = (
            _ByteShards([paths[h] for h in spec.files], spec.shards, jsonl=jsonl)
            if spec.source == "files"
            else None
        )
        self._hf = (
            None
            if spec.source == "files"
            else _load_hf(spec.hf_name, spec.hf_split, spec.hf_revision)
        )
        self._ready: dict[int, int] = {}  # shard -> tokens, once built or verified here
        valid = [_Piece(paths[h], 0, paths[h].stat().st_size, True) for h in spec.validation]
        self.validation = _cached_tokens(
            Path(cache_dir) / _cache_key(validation=spec.validation, **common) / "validation.tok",
            lambda: _tokenise_pieces(
                valid, self.tokenizer, jsonl=jsonl, text_field=spec.text_field
            ),
            dtype=self.tokenizer.dtype,
        )
        if self.validation.size < seq_len + 1:
            raise DataError(
                f"the validation set holds {self.validation.size} tokens, fewer than one window "
                f"of {seq_len + 1}: add validation text or lower seq_len"
            )

    def shard_size(self, shard: int) -> int:
        """Shard ``shard``'s token count, tokenising and caching it first if needed (a cached
        file is verified once per process). Raises ValueError for a shard out of range."""
        if not 0 <= shard < self.spec.shards:
            raise ValueError(f"shard {shard} outside 0..{self.spec.shards - 1}")
        if shard not in self._ready:
            tokens = _cached_tokens(
                self._shard_path(shard),
                lambda: self._tokenise_shard(shard),
                dtype=self.tokenizer.dtype,
            )
            self._ready[shard] = int(tokens.size)
            del tokens  # no map kept open: a peer may hold thousands of shards
        return self._ready[shard]

    def shard_tokens(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s tokens: a read-only memory map (an open file while it lives)."""
        self.shard_size(shard)
        return read_token_file(self._shard_path(shard), dtype=self.tokenizer.dtype, verify=False)

    def _shard_path(self, shard: int) -> Path:
        return self.shard_dir / f"shard-{shard:05d}.tok"

    def _tokenise_shard(self, shard: int) -> Iterator[np.ndarray]:
        spec = self.spec
        if self._bytes is not None:
            return _tokenise_pieces(
                self._bytes.pieces(shard),
                self.tokenizer,
                jsonl=spec.format == "jsonl",
                text_field=spec.text_field,
            )
        return _tokenise_hf(self._hf, shard, spec.shards, self.tokenizer, spec.text_field)

    def prepare(self, shards: Iterable[int] | None = None) -> int:
        """Tokenise (or check the cache of) ``shards``, every shard when None, and return their
        tokens: what a founder runs to see that the whole dataset reads."""
        wanted = range(self.spec.shards) if shards is None else shards
        return sum(self.shard_size(s) for s in wanted)

    def validation_windows(self, n: int) -> torch.Tensor:
        """``n`` evenly spaced windows of the validation tokens, int64 (n, seq_len + 1): the
        same on every peer. Raises ValueError for n outside 1..MAX_WINDOWS."""
        if not 1 <= n <= MAX_WINDOWS:
            raise ValueError(f"n must be 1 to {MAX_WINDOWS}, got {n}")
        high = self.validation.size - self.seq_len - 1  # last valid start
        starts = np.linspace(0, high, n).round().astype(np.int64)
        rows = [self.validation[s : s + self.seq_len + 1] for s in starts]
        return torch.from_numpy(np.stack(rows).astype(np.int64))  # (n, T+1) int64

    @property
    def validation_sha256(self) -> str:
        """SHA-256 (hex) of the validation tokens as little-endian int64, which is what
        ``hashlib.sha256(t.numpy().tobytes())`` gives for them as an int64 tensor ``t``: peers
        whose tokenizers library cuts the text differently see different hashes."""
        digest, step = hashlib.sha256(), CHUNK_BYTES // 8
        for i in range(0, self.validation.size, step):
            digest.update(self.validation[i : i + step].astype("<i8").tobytes())
        return digest.hexdigest()

    def train_stream(self, learners: Callable[[], Sequence[bytes]]) -> TrainStream:
        """Batches from this peer's dealt shards; ``learners()`` is asked before each batch and
        the shards are dealt again when its answer changes."""
        return TrainStream(self, learners)


class TrainStream:
    """Random (x, y) windows from the shards dealt to this peer among ``learners()``.

    Before each batch the learner set is read; when it changed, the shards are dealt again
    (``protocol.diloco.shard_deal``), the newly dealt ones tokenised or read from the cache, and
    one line ``shards dealt: [...]`` logged (with the shard borrowed, if the dealt ones hold no
    window). A window never crosses a shard's end; shards are drawn in proportion to their
    window starts. The sampler is seeded by (seed, me), so two
    peers draw different windows and one peer draws the same ones on a rerun.
    """

    def __init__(self, data: RecipeData, learners: Callable[[], Sequence[bytes]]) -> None:
        self.data, self.learners = data, learners
        self.batch_size, self.seq_len = data.batch_size, data.seq_len
        seed = hashlib.blake2b(data.seed.to_bytes(8, "big", signed=True) + data.me, digest_size=8)
        self.generator = torch.Generator().manual_seed(int.from_bytes(seed.digest(), "big") >> 1)
        self.dealt: tuple[int, ...] = ()
        self._order: tuple[int, ...] = ()  # the shards sampled (dealt, or the preferred one)
        self._seen: frozenset[bytes] | None = None
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()  # open shards, LRU first
        self._cum = torch.zeros(1, dtype=torch.long)
        self._window = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _refresh(self) -> None:
        current = frozenset(self.learners())
        if current == self._seen:
            return
        data, n = self.data, self.data.spec.shards
        self._seen, self.dealt = current, deal(n, sorted(current), data.me)
        sampled, note = self._usable(self.dealt)
        log.info(
            "shards dealt: %s of %d among %d learners%s",
            list(self.dealt),
            n,
            len(current | {data.me}),
            note,
        )
        starts = [max(0, data.shard_size(s) - self.seq_len) for s in sampled]  # window starts
        self._order, self._maps = sampled, OrderedDict()
        self._cum = torch.tensor(np.cumsum([0, *starts]), dtype=torch.long)

    def _usable(self, dealt: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
        """The shards to sample and a note for the log: the dealt ones when they hold a window;
        else (none dealt, or all too short) those and the first shard in this peer's rendezvous
        preference that holds one, shared with its owner. Raises DataError when none does."""
        data, T = self.data, self.seq_len
        if any(data.shard_size(s) > T for s in dealt):
            return dealt, ""
        why = (
            "none dealt: more learners than shards" if not dealt else f"no window of {T + 1} tokens"
        )
        for s in shard_preference(data.spec.shards, data.me):
            if s not in dealt and data.shard_size(s) > T:
                return (*dealt, s), f" ({why}; sharing shard {s})"
        raise DataError(
            f"no shard holds a window of {T + 1} tokens: use fewer shards, more text or a "
            "shorter seq_len"
        )

    def _shard(self, shard: int) -> np.ndarray:
        """The memory map of a dealt shard; at most MAX_OPEN_SHARDS stay open (LRU)."""
        if shard in self._maps:
            self._maps.move_to_end(shard)
        else:
            self._maps[shard] = self.data.shard_tokens(shard)
            if len(self._maps) > MAX_OPEN_SHARDS:
                self._maps.popitem(last=False)
        return self._maps[shard]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: x, y int64 (B, T), y shifted one token right of x."""
        self._refresh()
        total = int(self._cum[-1])
        picks = torch.randint(0, total, (self.batch_size,), generator=self.generator)  # (B,)
        which = torch.searchsorted(self._cum, picks, right=True) - 1  # (B,) shard index
        local = picks - self._cum[which]  # (B,) start inside that shard
        T, out = self.seq_len, self._window
        for row, (w, s) in enumerate(zip(which.tolist(), local.tolist(), strict=True)):
            out[row] = self._shard(self._order[w])[s : s + T + 1]  # uint16/32 -> int64 copy
        window = torch.from_numpy(out)  # (B, T+1) int64, reused: x and y below are copies
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    __next__ = next

    def __iter__(self) -> TrainStream:
        return self
