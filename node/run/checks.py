"""What ``atoll local`` and ``atoll join`` check before they start a peer.

A peer that dies on a bad flag dies after seconds of start-up, in a log file, as a traceback. The
launchers run these checks first instead, on the same code the peers run (the model presets, the
corpus loader and splitter, the link emulator's parser), and turn every mistake into one line
that names the flag and says what to do: ``CheckError``.

``check_run``      the run's numbers, swarm name, model preset, device, emulated link and corpus
``check_recipe``   a swarm's recipe (``atoll swarm init``): its numbers, model preset and fragments
``check_local``    ``atoll local``'s own: how many peer processes this machine is asked for
``check_listen``   that this machine can listen at HOST:PORT (a free port, an address of its own)
``peer_url``       an initial peer's address: http(s)://HOST:PORT
``host_port``      ``--listen`` / ``--public-address``: HOST:PORT
"""

from __future__ import annotations

import errno
import math
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from node.config import SCHEDULE_FIELDS, SWARM_WIDE_FIELDS, RunConfig
from protocol.errors import DecodeError
from protocol.wire.membership import MAX_NAME, check_name

__all__ = [
    "CheckError",
    "check_listen",
    "check_local",
    "check_recipe",
    "check_run",
    "host_port",
    "peer_url",
]

CORPUS_CHECK_BYTES = 4 << 20  # the corpus check reads at most this much (a peer reads it all)
CORES = os.cpu_count() or 1
# atoll local starts every peer as a process on this machine: 32 tiny peers run on 2 cores here;
# a typo of 100000 started processes until the machine ran out of them
MAX_LOCAL_PEERS = 256

# (field, test, what it must be): the numbers a RunConfig leaves to the training loop; a float
# that inf makes no sense for must be finite (--lr inf was taken, and the island's loss went NaN)
_RANGES = (
    ("seed", lambda v: 0 <= v < 2**32, "in 0..4294967295"),
    ("batch_size", lambda v: v >= 1, ">= 1"),
    ("threads", lambda v: 1 <= v <= CORES, f"1..{CORES} (the cores of this machine)"),
    ("lr", lambda v: 0 < v < math.inf, "finite and > 0"),
    ("warmup_steps", lambda v: v >= 0, ">= 0"),
    ("weight_decay", lambda v: 0 <= v < math.inf, "finite and >= 0"),
    ("eval_every", lambda v: v >= 1, ">= 1"),
    ("eval_batches", lambda v: v >= 1, ">= 1"),
    ("corpus_max_bytes", lambda v: v is None or v > 0, "> 0"),
    ("block_size", lambda v: v >= 1, ">= 1"),
    ("grace_gamma", lambda v: 0 <= v < math.inf, "finite and >= 0"),
    ("grace_tau", lambda v: v >= 0, ">= 0"),
    ("grace_cap_s", lambda v: 0 <= v < math.inf, "finite and >= 0"),
    ("staleness_bound", lambda v: v >= 0, ">= 0"),
    ("overlap_block", lambda v: v >= 0, ">= 0"),
)


class CheckError(ValueError):
    """One line: what is wrong and what to do about it."""


def check_local(cfg: RunConfig) -> None:
    """Raise ``CheckError`` when ``atoll local`` would start more peer processes than it allows."""
    if cfg.peers > MAX_LOCAL_PEERS:
        raise CheckError(
            f"--peers must be at most {MAX_LOCAL_PEERS} for atoll local, which starts every peer "
            f"as a process on this machine, got {cfg.peers}; a larger swarm is many machines "
            f"running atoll join"
        )


def check_run(cfg: RunConfig) -> None:
    """Raise ``CheckError`` naming every flag of ``cfg`` a peer would fail on; reads the corpus
    (at most ``CORPUS_CHECK_BYTES``) when ``--corpus`` names one."""
    problems = _range_problems(cfg)
    problems += filter(
        None,
        (
            _swarm_problem(cfg.swarm),
            _model_problem(cfg),
            _device_problem(cfg.device),
            _link_problem(cfg.link),
        ),
    )
    if problems:
        raise CheckError("; ".join(problems))
    _check_corpus(cfg)


def check_recipe(cfg: RunConfig) -> None:
    """Raise ``CheckError`` naming every swarm-wide or schedule field of ``cfg`` (a manifest's
    recipe) a peer would refuse: ``check_run``'s ranges, the model preset, and whether the model cuts into
    ``--fragments`` fragments as every peer cuts it (imports torch: the model is built on the
    meta device, no memory)."""
    problems = _range_problems(cfg, SWARM_WIDE_FIELDS + SCHEDULE_FIELDS)
    problems += filter(None, (_model_problem(cfg),))
    if not problems:
        problems += filter(None, (_fragments_problem(cfg),))
    if problems:
        raise CheckError("; ".join(problems))


def _range_problems(cfg: RunConfig, fields: tuple[str, ...] | None = None) -> list[str]:
    """What ``_RANGES`` finds wrong with ``cfg`` (only ``fields`` of it, when given)."""
    return [
        f"--{name.replace('_', '-')} must be {want}, got {getattr(cfg, name)}"
        for name, ok, want in _RANGES
        if (fields is None or name in fields) and not ok(getattr(cfg, name))
    ]


def _swarm_problem(swarm: str) -> str | None:
    """The swarm's name as the manifest (``protocol.wire.membership``) takes it: checked here, or
    the first peer dies on it with a traceback."""
    try:
        check_name(swarm, "--swarm", MAX_NAME)
    except DecodeError as exc:
        return exc.reason
    return None


RECIPE_MODEL = "recipe"  # node.run.recipes.RECIPE_MODEL: the model is the recipe's


def _fragments_problem(cfg: RunConfig) -> str | None:
    """Whether every peer can cut the model into ``cfg.fragments`` fragments (``plan_fragments``)."""
    import torch

    from node.workload.model import GPT, embedding_parameter_names
    from node.workload.presets import GPTConfig
    from protocol.diloco.fragments import plan_fragments
    from protocol.errors import LocalProtocolError

    if cfg.model == RECIPE_MODEL:
        return None  # a recipe's model: cut (and checked) once built from its artifacts
    with torch.device("meta"):  # shapes and names only: no memory, no init cost
        model = GPT(GPTConfig.preset(cfg.model))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    try:
        plan_fragments(shapes, cfg.fragments, embeddings=embedding_parameter_names(model))
    except LocalProtocolError as exc:
        return f"--fragments {cfg.fragments}: {exc}"
    return None


def _model_problem(cfg: RunConfig) -> str | None:
    from node.workload.presets import GPTConfig

    if cfg.model == RECIPE_MODEL:
        return None  # the swarm's recipe names the model (node.run.recipes)
    try:
        GPTConfig.preset(cfg.model)
    except ValueError as exc:
        return f"--model: {exc}"
    return None


def _device_problem(device: str) -> str | None:
    if device == "cpu":  # always there: no torch import (a mistake elsewhere is told at once)
        return None
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"--device {device!r} is not a device: use cpu or cuda (cuda:1 for the second GPU)"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: torch sees no CUDA device here; use --device cpu"
    return None


def _link_problem(link: str) -> str | None:
    from node.wire.link import LinkProfile

    try:
        LinkProfile.parse(link)
    except ValueError as exc:
        return f"--link: {exc}"
    return None


def _check_corpus(cfg: RunConfig) -> None:
    """Read the corpus as a peer does (capped) and cut it as a peer does: it must exist, be
    readable, hold text, and be long enough for a held-out split and one window per island."""
    if cfg.corpus is None:
        return  # the Python standard library: always there
    from node.workload.corpus_files import load_corpus
    from node.workload.presets import GPTConfig

    cap = min(cfg.corpus_max_bytes or CORPUS_CHECK_BYTES, CORPUS_CHECK_BYTES)
    block = GPTConfig.preset(cfg.model).block_size
    try:
        data = load_corpus(Path(cfg.corpus), max_bytes=cap)  # a missing corpus is told before torch
        _check_corpus_cuts(cfg, data, block)
    except FileNotFoundError as exc:
        raise CheckError(str(exc)) from None
    except OSError as exc:
        raise CheckError(
            f"cannot read the corpus: {exc.strerror or exc}: {exc.filename or cfg.corpus}"
        ) from None
    except ValueError as exc:
        advice = "" if "bigger corpus" in str(exc) else "; pass a longer text"
        raise CheckError(f"--corpus {cfg.corpus}: {exc}{advice}") from None


def _check_corpus_cuts(cfg: RunConfig, data: bytes, block: int) -> None:
    """Cut ``data`` as a peer does (imports torch); raises ValueError when it is too short."""
    from node.workload.corpus import BatchSampler, CorpusShard, heldout_windows, split_corpus

    train, heldout = split_corpus(data)
    heldout_windows(heldout, block_size=block, n_windows=1)
    BatchSampler(
        train,
        CorpusShard(max(cfg.peers, 1) - 1, max(cfg.peers, 1), cfg.sharding),
        batch_size=cfg.batch_size,
        block_size=block,
        seed=0,
    )


def host_port(spec: str, flag: str) -> tuple[str, int]:
    """``"0.0.0.0:7000"`` -> ``("0.0.0.0", 7000)``; ``":0"`` -> ``("0.0.0.0", 0)``."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise CheckError(
            f"{flag} {spec!r} is not HOST:PORT, e.g. 0.0.0.0:7000 (port 0: any free port)"
        )
    return host.strip("[]") or "0.0.0.0", int(port)


def check_listen(host: str, port: int, flag: str = "--listen") -> None:
    """Bind (and release) ``host:port`` as the node will (address reuse on, as aiohttp does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror:
            raise CheckError(
                f"{flag} {host}:{port}: {host!r} is not an address of this machine"
            ) from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CheckError(
                    f"{flag} {host}:{port}: port {port} is in use; pick another port, "
                    f"or {host}:0 for any free one"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise CheckError(
                    f"{flag} {host}:{port}: {host} is not an address of this machine; "
                    "listen on 0.0.0.0 and give others --public-address"
                ) from None
            raise CheckError(
                f"{flag} {host}:{port}: cannot listen there: {exc.strerror or exc}"
            ) from None


def peer_url(url: str, flag: str = "--initial-peers") -> str:
    """``url`` when it is a peer's address (http(s)://HOST:PORT, no path); raises ``CheckError``."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise CheckError(
            f"{flag} {url!r} is not a peer's address: expected http(s)://HOST:PORT, "
            "e.g. http://203.0.113.5:7000"
        )
    return url
