"""``atoll join``, ``atoll bootstrap`` and ``atoll status``: a peer's identity and swarm, checked first.

Every command that speaks to a swarm starts the same way (``load_swarm``): read the key, the
certificate and the manifest (from a file, or fetched by swarm id from an initial peer and
checked against the id), take any newer manifest an initial peer holds (how a revocation reaches
a joiner), and check the certificate against it. A mistake is one line that says what to do and a
non-zero exit, before a socket opens to train.

A peer is asked with ``http_fetch`` (``node.run.peer_http``: the whole answer within a deadline,
re-exported here); a status answer's shape is checked by ``node.run.status_shape``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Any

from node.config import (
    FSDP_CANNOT_VALIDATE,
    FSDP_NEEDS_RANKS,
    SCHEDULE_FIELDS,
    RunConfig,
    config_from_args,
)
from node.dht.membership import config_from_manifest
from node.dht.swarm import MANIFEST_PATH
from node.run.checks import CheckError, check_listen, check_run, host_port, peer_url
from node.run.console import JoinView, ProgressLine, render_status, setup_logging
from node.run.peer_http import SlowAnswer, http_fetch
from node.run.recipes import LoadedRecipe
from node.run.status_shape import _not_a_status
from node.wire.admission import request_headers
from node.wire.identity import IdentityError, load_certificate, load_key, load_manifest
from protocol.errors import RemoteProtocolError
from protocol.wire.certificates import Certificate, admit
from protocol.wire.membership import MAX_MANIFEST_BYTES, SwarmManifest
from protocol.wire.signing import Signer

__all__ = [
    "LoadedSwarm",
    "SlowAnswer",
    "SwarmError",
    "bootstrap_main",
    "http_fetch",
    "join_main",
    "load_swarm",
    "signed_request",
    "status_main",
]

log = logging.getLogger("atoll.join")

STATUS_TIMEOUT_S = 10.0  # atoll status: the whole answer, not each read
MANIFEST_TIMEOUT_S = 10.0  # an initial peer's manifest, likewise
STATUS_MAX_BYTES = 16 << 20
ARTIFACT_TIMEOUT_S = 60.0  # one piece of an artifact (4 MiB), the whole answer


class SwarmError(Exception):
    """A one-line reason the command cannot go on, and what to do."""


@dataclass(frozen=True)
class LoadedSwarm:
    """What a command speaks to a swarm with, as ``load_swarm`` read and checked it: this peer's
    key, the swarm's manifest (the newest an initial peer handed over) and its certificate."""

    signer: Signer
    manifest: SwarmManifest
    cert: Certificate | None


def signed_request(
    url: str,
    *,
    swarm: str,
    signer: Signer,
    cert: Certificate | None,
    method: str = "GET",
    body: bytes | None = None,
    limit: int = 16 << 20,
    timeout: float = 10.0,
    extra: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One signed request (``Atoll-Auth`` and the certificate, and the ``extra`` headers); TLS
    without a pin: the answer's contents are checked by signature (or hash). Returns (status,
    body) for any HTTP status."""
    headers = request_headers(
        signer,
        cert.to_header() if cert is not None else "",
        swarm=swarm,
        method=method,
        url=url,
        now=time.time(),
    ) | (extra or {})
    return http_fetch(url, method=method, body=body, headers=headers, limit=limit, timeout=timeout)


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body).get("reason", body[:200].decode(errors="replace")))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _unanswered(exc: BaseException) -> str:
    """Why a request got no HTTP answer, in a few words ("connection refused", "no answer in 10 s")."""
    reason = getattr(exc, "reason", exc)  # URLError wraps the socket's error
    if isinstance(reason, SlowAnswer):
        return str(reason)
    if isinstance(reason, TimeoutError | socket.timeout):
        return "no answer within 10 s"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    return str(getattr(reason, "strerror", None) or reason).lower()


def _their_manifest(base: str) -> SwarmManifest | None:
    """The manifest a peer hands anyone (unsigned ``GET``), verified; None when it has none."""
    try:
        status, body = http_fetch(
            base.rstrip("/") + MANIFEST_PATH, limit=MAX_MANIFEST_BYTES, timeout=5
        )
        if status != 200:
            return None
        m = SwarmManifest.from_toml(body)
        m.verify()
    except (OSError, ssl.SSLError, RemoteProtocolError):
        return None
    return m


def _refused(base: str, body: bytes, *, swarm: str, named: str) -> SwarmError:
    """A peer refused our signed request: say why, and name its swarm when it is another one
    (a request signed for another swarm does not verify there)."""
    theirs = _their_manifest(base)
    if theirs is not None and theirs.swarm_id != swarm:
        return SwarmError(
            f"{base} is a peer of swarm {theirs.name!r} ({theirs.swarm_id}), not of {named}: "
            "pass that swarm's manifest, or --initial-peers of your swarm"
        )
    return SwarmError(f"refused by {base}: {_reason(body)}")


def fetch_manifest(
    initial_peers: list[str],
    *,
    swarm: str,
    signer: Signer,
    cert: Certificate | None,
    named: str = "",
    require_answer: bool = False,
) -> SwarmManifest | None:
    """The newest verified manifest of swarm ``swarm`` that an initial peer hands over, or None.

    Raises ``SwarmError`` when a peer refuses us (its reason: revoked, expired, another swarm …)
    and, with ``require_answer``, when no initial peer answers at all. ``named``: how the user
    named the swarm, for those messages."""
    best: SwarmManifest | None = None
    silent: list[str] = []
    for base in initial_peers:
        if not base.startswith(("http://", "https://")):
            raise SwarmError(f"initial peer {base!r} is not an http(s) URL, e.g. https://host:7000")
        try:
            status, body = signed_request(
                base.rstrip("/") + MANIFEST_PATH,
                swarm=swarm,
                signer=signer,
                cert=cert,
                limit=MAX_MANIFEST_BYTES,
                timeout=MANIFEST_TIMEOUT_S,
            )
        except (OSError, ssl.SSLError) as exc:
            silent.append(f"{base} ({_unanswered(exc)})")
            continue
        if status in (401, 403):
            raise _refused(base, body, swarm=swarm, named=named or f"swarm {swarm}")
        if status != 200:
            log.info("%s answered %d for the manifest: %s", base, status, _reason(body))
            continue
        try:
            m = SwarmManifest.from_toml(body)
            m.verify(expected_id=swarm)
        except RemoteProtocolError as exc:
            print(
                f"atoll: {base} handed over a manifest that does not check out: {exc.reason}",
                file=sys.stderr,
            )
            continue
        if best is None or m.version > best.version:
            best = m
    if silent and len(silent) == len(initial_peers) and require_answer:
        raise SwarmError(
            f"no initial peer answered: {', '.join(silent)}; check --initial-peers "
            "and that those peers are running"
        )
    for what in silent:
        print(f"atoll: {what} did not answer; going on with the others", file=sys.stderr)
    return best


def load_swarm(
    args: argparse.Namespace, *, initial_peers: list[str], require_answer: bool = False
) -> LoadedSwarm:
    """Key, certificate and manifest from ``args`` (``--key``, ``--cert``, ``--manifest`` or
    ``--swarm``), the manifest updated from ``initial_peers``, and the certificate checked.
    ``require_answer``: fail when no initial peer answers (``fetch_manifest``)."""
    try:
        signer = load_key(args.key)
        cert = load_certificate(args.cert) if args.cert else None
        manifest = load_manifest(args.manifest) if getattr(args, "manifest", None) else None
    except IdentityError as exc:
        raise SwarmError(str(exc)) from None
    swarm_id = manifest.swarm_id if manifest is not None else getattr(args, "swarm", None)
    if swarm_id is None:
        raise SwarmError(
            "say which swarm: --manifest swarm.toml, or --swarm ID with --initial-peers"
        )
    named = (
        f"swarm {manifest.name!r} ({swarm_id}) that --manifest names"
        if manifest is not None
        else f"swarm {swarm_id} that --swarm names"
    )
    if initial_peers:
        fetched = fetch_manifest(
            initial_peers,
            swarm=swarm_id,
            signer=signer,
            cert=cert,
            named=named,
            require_answer=require_answer,
        )
        if manifest is None:
            manifest = fetched
        elif fetched is not None:
            try:
                if manifest.superseded_by(fetched):
                    print(
                        f"atoll: using manifest version {fetched.version} from the swarm "
                        f"(the file holds {manifest.version})",
                        file=sys.stderr,
                    )
                    manifest = fetched
            except RemoteProtocolError as exc:
                raise SwarmError(f"the swarm's manifest does not fit yours: {exc.reason}") from None
    if manifest is None:
        raise SwarmError(
            f"no initial peer handed over the manifest of swarm {swarm_id}; "
            "check --initial-peers, or pass --manifest swarm.toml"
        )
    try:
        admit(manifest, cert, public_key=signer.public_key, role=None, now=time.time())
    except RemoteProtocolError as exc:
        raise SwarmError(f"cannot join swarm {manifest.name!r}: {exc.reason}") from None
    return LoadedSwarm(signer, manifest, cert)


def _scheme(manifest: SwarmManifest) -> str:
    return "https" if manifest.admission == "certified" else "http"


def _listen_address(args: argparse.Namespace) -> tuple[str, int]:
    """``--listen`` parsed and bindable, ``--public-address`` well-formed, ``--initial-peers`` URLs."""
    for url in getattr(args, "initial_peers", []):
        peer_url(url)
    host, port = host_port(args.listen, "--listen")
    if args.public_address:
        host_port(args.public_address, "--public-address")
    check_listen(host, port)
    return host, port


def join_config(manifest: SwarmManifest, args: argparse.Namespace) -> RunConfig:
    """The run configuration of ``atoll join``: the flags, the manifest's recipe over them, and
    the swarm's learning-rate schedule (``SCHEDULE_FIELDS``) where the manifest has one, but for
    the schedule flags given on the command line (``None`` in ``args`` when not given).
    Raises ``ValueError`` for a recipe this Atoll cannot run (see ``config_from_manifest``)."""
    given = _schedule_given(args)
    flags = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if not (k in SCHEDULE_FIELDS and v is None)}
    )
    return config_from_manifest(manifest, config_from_args(flags), keep=given)


def _schedule_given(args: argparse.Namespace) -> list[str]:
    """The schedule fields given on the command line, in ``SCHEDULE_FIELDS`` order."""
    return [name for name in SCHEDULE_FIELDS if getattr(args, name, None) is not None]


def schedule_source(manifest: SwarmManifest, args: argparse.Namespace) -> str:
    """Where ``join_config`` took the schedule from, in words for the banner."""
    recipe = manifest.recipe_dict
    flags = [f"--{n.replace('_', '-')}" for n in _schedule_given(args)]
    if not any(n in recipe for n in SCHEDULE_FIELDS):
        return "this peer's schedule: the swarm's manifest has none"
    return "the swarm's schedule" + (
        f", but {', '.join(flags)} from the command line" if flags else ""
    )


def join_main(args: argparse.Namespace) -> int:
    """``atoll join``: every check first (flags, files, the swarm, the corpus), then train."""
    if args.nproc < 1:
        print(f"atoll join: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 1
    if (why := _shard_refusal(args)) is not None:
        print(f"atoll join: {why}", file=sys.stderr)
        return 1
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_ranks(args.nproc, args.argv, args.shard)
    code = _join(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from node.diloco.ranks import exit_without_teardown  # a rank: torch is loaded

        exit_without_teardown(code)  # after leave_process_group, on every rank
    return code


def _shard_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--shard fsdp`` cannot run with these flags (None: it can, or it is not asked for).
    Checked before torchrun starts; the ranks see the flags without ``--nproc``."""
    if getattr(args, "shard", "ddp") != "fsdp":
        return None
    if args.nproc < 2 and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return FSDP_NEEDS_RANKS
    if args.validate_windows > 0:
        return FSDP_CANNOT_VALIDATE
    if args.checkpoint_dir is not None:
        return (
            "--checkpoint-dir is not supported for islands of several processes yet: leave it out"
        )
    if args.compute != "real":
        return "--compute standin runs one process per island: use --compute real with --shard fsdp"
    return None


def _join(args: argparse.Namespace) -> int:
    """One island's (or one rank's) ``atoll join``: the checks, then training."""
    if int(os.environ.get("RANK", "0")) > 0:  # a follower rank of a multi-process island: quiet
        args.json_logs = False
    line = ProgressLine(sys.stderr) if sys.stderr.isatty() and not args.json_logs else None
    setup_logging(
        min(args.log_level, "INFO", key=logging.getLevelName),
        sys.stderr,
        json_logs=args.json_logs,
        line=line,
    )
    try:
        host, port = _listen_address(args)
        if args.serve_after_s < 0:
            raise CheckError(f"--serve-after-s must be >= 0, got {args.serve_after_s:g}")
        swarm = load_swarm(args, initial_peers=list(args.initial_peers), require_answer=True)
        cfg = join_config(swarm.manifest, args)
        check_run(cfg)
        if swarm.manifest.recipe_sha256 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SwarmError("a recipe swarm runs one process per island: leave out --nproc")
        recipe = _recipe(swarm, args) if swarm.manifest.recipe_sha256 else None
    except (SwarmError, ValueError) as exc:
        print(f"atoll join: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    from node.dht.swarm import SwarmCredentials  # after the checks: torch comes with the trainer
    from node.run.train import PeerOptions, data_seed_of, run_peer

    m = swarm.manifest
    lab = (
        f", lab {swarm.cert.lab} ({','.join(swarm.cert.roles)})"
        if swarm.cert
        else ", uncertified learner"
    )
    model = cfg.model if recipe is None else _recipe_model(recipe)
    print(
        f"atoll join: swarm {m.name!r} ({m.swarm_id}, {m.admission}, manifest v{m.version}){lab}; "
        f"model {model}, {cfg.fragments} fragments, H={cfg.inner_steps}; {cfg.steps} steps at lr "
        f"{cfg.lr:g} ({schedule_source(m, args)})",
        flush=True,
    )
    scheme = _scheme(m)
    public = f"{scheme}://{args.public_address}" if args.public_address else None
    if public is None and host in ("0.0.0.0", "::"):
        public = f"{scheme}://127.0.0.1:{port}" if port else None
        if port == 0:
            host = "127.0.0.1"
            print(
                "atoll join: no --public-address; listening on 127.0.0.1 only "
                "(others on this machine can reach it)",
                file=sys.stderr,
            )
    view = JoinView(line, json_events=args.json_logs or not sys.stdout.isatty(), steps=cfg.steps)
    opts = PeerOptions(
        index=int.from_bytes(os.urandom(2), "big") % max(cfg.peers, 1),
        initial_peers=tuple(args.initial_peers),
        host=host,
        port=port,
        public_address=public,
        wait_for_stop=False,
        final_sync=args.final_sync,
        serve_after_s=args.serve_after_s,
        signer=swarm.signer,
        credentials=SwarmCredentials(m, swarm.signer, swarm.cert),
        checkpoint_dir=args.checkpoint_dir,
        events=view,
        own_data_seed=data_seed_of(swarm.signer.peer_id),
        schedule=args.schedule,
        shard=args.shard,
        wait_members=args.wait_members,
        may_own=args.may_own == "yes",
        recipe=recipe,
        artifacts=recipe.store if recipe is not None else None,
    )
    try:
        run_peer(cfg, opts)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, RemoteProtocolError, TimeoutError, RuntimeError, OSError) as exc:
        if line is not None:
            line.close()
        why = exc.reason if isinstance(exc, RemoteProtocolError) else str(exc) or type(exc).__name__
        print(f"atoll join: {' '.join(why.split())}", file=sys.stderr)
        return 1
    finally:
        if line is not None:
            line.close()
    return 0


def _recipe(swarm: LoadedSwarm, args: argparse.Namespace) -> LoadedRecipe:
    """The swarm's recipe with every artifact held and checked: fetched by hash from the initial
    peers (and the members they name) where missing. Raises ``RecipeError`` with one line."""
    from node.run.recipes import prepare_recipe
    from node.state.artifact_serve import ARTIFACT_PIECE
    from node.state.artifacts import ArtifactStore

    m = swarm.manifest

    def get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return signed_request(
            url,
            swarm=m.swarm_id,
            signer=swarm.signer,
            cert=swarm.cert,
            limit=ARTIFACT_PIECE,
            timeout=ARTIFACT_TIMEOUT_S,
            extra=headers,
        )

    store = ArtifactStore(args.artifact_dir)
    return prepare_recipe(m, store, get, list(args.initial_peers))


def _recipe_model(loaded: LoadedRecipe) -> str:
    r = loaded.recipe
    what = f"GPT preset {r.preset}" if r.model_type == "gpt" else "a transformers model"
    if not r.data:  # the built-in GPT on the standard library, as without a recipe
        return f"{what} of recipe {loaded.sha256[:16]} (the standard library's bytes)"
    return f"{what} of recipe {loaded.sha256[:16]} (seq_len {r.seq_len}, vocab {loaded.vocab_size})"


def _launch_ranks(nproc: int, given: list[str], shard: str = "ddp") -> int:
    """``atoll join --nproc N``: the same command as N processes of one island under torchrun
    (``torch.distributed.run``, standalone: rendezvous on this machine)."""
    import subprocess

    argv, skip = [], False
    for arg in given:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        argv.append(arg)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "node",
        *argv,
    ]
    holds = (
        f"FSDP, each rank 1/{nproc} of the model" if shard == "fsdp" else "DDP, each rank a replica"
    )
    print(
        f"atoll join: an island of {nproc} processes (torchrun; {holds}); rank 0 joins the swarm",
        file=sys.stderr,
    )
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


def bootstrap_main(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from node.dht.bootstrap import run_bootstrap
    from node.dht.swarm import SwarmCredentials

    setup_logging(args.log_level, sys.stderr, json_logs=args.json_logs)
    try:
        host, port = _listen_address(args)
        credentials, signer, scheme = None, None, "http"
        if args.manifest or args.key or args.cert:
            if not (args.manifest and args.key):
                raise SwarmError(
                    "a swarm's bootstrap node needs --manifest and --key (and --cert in a certified swarm)"
                )
            swarm = load_swarm(args, initial_peers=list(args.initial_peers))
            signer, scheme = swarm.signer, _scheme(swarm.manifest)
            credentials = SwarmCredentials(swarm.manifest, swarm.signer, swarm.cert)
    except (SwarmError, CheckError) as exc:
        print(f"atoll bootstrap: {exc}", file=sys.stderr)
        return 1
    public = f"{scheme}://{args.public_address}" if args.public_address else None
    if public is None and host in ("0.0.0.0", "::"):
        print(
            "atoll bootstrap: listening on all interfaces; pass --public-address HOST:PORT "
            "so the node advertises an address others can dial",
            file=sys.stderr,
        )
    from node.state.artifact_serve import ArtifactServer
    from node.state.artifacts import ArtifactStore
    from node.wire.transport import Transport

    def routes(transport: Transport) -> None:  # the founder's bootstrap seeds the artifacts
        if args.artifact_dir:
            ArtifactServer(ArtifactStore(args.artifact_dir), transport).install()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            run_bootstrap(
                host,
                port,
                public,
                args.initial_peers,
                signer=signer,
                credentials=credentials,
                routes=routes,
            )
        )
    return 0


def status_main(args: argparse.Namespace) -> int:
    """``atoll status``: a peer's ``/v1/status`` as tables (``render_status``), or ``--json``."""
    try:
        url = peer_url(args.peer, "--peer").rstrip("/") + "/v1/status"
        if args.key:
            if not args.manifest:
                raise SwarmError("--key needs --manifest (the swarm whose peer this is)")
            swarm = load_swarm(args, initial_peers=[])
            code, body = signed_request(
                url,
                swarm=swarm.manifest.swarm_id,
                signer=swarm.signer,
                cert=swarm.cert,
                limit=STATUS_MAX_BYTES,
                timeout=STATUS_TIMEOUT_S,
            )
        else:
            code, body = http_fetch(url, limit=STATUS_MAX_BYTES, timeout=STATUS_TIMEOUT_S)
        if code != 200:
            raise SwarmError(
                f"{url} answered {code}: {_reason(body)}"
                + (
                    "; a certified swarm's peer needs --manifest, --key and --cert"
                    if code in (401, 403)
                    else ""
                )
            )
        status = _status_of(url, body)
    except (OSError, ssl.SSLError) as exc:
        print(
            f"atoll status: {args.peer} did not answer ({_unanswered(exc)}); check --peer and that the "
            "peer is running",
            file=sys.stderr,
        )
        return 1
    except (SwarmError, ValueError) as exc:  # CheckError too
        print(f"atoll status: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(render_status(status))
    return 0


# --- what a /v1/status must look like (the shape checks: node.run.status_shape) -----------------
def _status_of(url: str, body: bytes) -> dict[str, Any]:
    """``body`` as a ``/v1/status`` that ``render_status`` can draw; raises ``SwarmError`` saying
    what is wrong with it (a peer's bad answer is one line, not a traceback)."""
    try:
        status = json.loads(body)
    except RecursionError:
        why: str | None = "JSON nested too deeply"
    except ValueError as exc:  # not UTF-8, not JSON
        why = f"not JSON ({' '.join(str(exc).split())[:100]})"
    else:
        why = _not_a_status(status)
    if why is not None:
        raise SwarmError(f"{url} answered a status that is not Atoll's: {why}; check --peer")
    return dict(status)
