"""The ``atoll`` command line.

``atoll local``      a multi-process swarm on 127.0.0.1 training a byte-level GPT on a real corpus.
``atoll join``       join a running swarm from any machine: sync the global model, then train.
``atoll bootstrap``  a DHT-only node: a stable entry point for a swarm.
``atoll status``     what a peer sees: members, roles, reachability, owners, versions; with
                     ``--serve``, its page and metrics on this machine, signed for.
``atoll simulate``   expected goodput under failures: your swarm, or the paper's Table 1.
``atoll peer``       one peer of a local swarm (started by ``atoll local``; not for direct use).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from node.config import (
    SCHEDULE_FIELDS,
    SWARM_WIDE_FIELDS,
    RunConfig,
    add_run_arguments,
    config_from_args,
)
from node.diloco.allocator import tune_allocator

if TYPE_CHECKING:
    from node.run.chaos import ChaosSpec
    from node.status.serve import StatusProxy

__all__ = ["main"]

# RunConfig fields only a launcher uses: how many peer processes it starts
LAUNCHER_FIELDS = ("peers",)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default, once: not where the help already says it, nor where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "(default" in text
            or action.default is None
            or action.default is False
            or action.default in ("", [])
        ):
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """A usage mistake ends in one line (the flag, what is wrong, where the flags are listed), not
    in the whole usage text; every sub-command's parser is one too, with ``_Help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _log_level(name: str) -> str:
    level = name.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"{name!r} is not a level: DEBUG, INFO, WARNING or ERROR")
    return level


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="atoll", description="Peer-to-peer Decoupled DiLoCo training.")
    parser.add_argument("--log-level", type=_log_level, default="WARNING", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    local = sub.add_parser("local", help="run a local multi-process swarm and write a report")
    add_run_arguments(local)
    local.add_argument(
        "--report",
        type=Path,
        default=None,
        help="where to write the JSON report (a PNG plot goes beside it); "
        "default runs/<time>/report.json",
    )
    local.add_argument(
        "--baseline",
        action="store_true",
        help="also train the synchronous data-parallel baseline at equal tokens and report the gap",
    )
    local.add_argument(
        "--alone",
        action="store_true",
        help="also train peer 0's island alone (same model, shard and steps) and report "
        "what merging gained",
    )
    local.add_argument("--quiet", action="store_true", help="no live progress lines")
    local.add_argument(
        "--spawn",
        choices=("fork", "exec"),
        default="fork",
        help="how peers start: fork (default) from one process that has imported torch once "
        "(Linux 5.3+; elsewhere, or if it fails, exec), or exec: each peer a fresh interpreter",
    )
    local.add_argument(
        "--may-own",
        type=int,
        default=None,
        metavar="N",
        help="only peers 0..N-1 may own fragments; the others are learners only and read a "
        "bounded view of the members (default: every peer may, and an open swarm's roster of "
        "candidate owners is capped at 8 all the same: docs/scale_peers.md)",
    )
    local.add_argument(
        "--admission",
        choices=("open", "certified"),
        default="open",
        help="the throw-away swarm's admission: certified runs every peer over HTTPS with "
        "certificate checks on every request",
    )
    local.add_argument(
        "--attack",
        action="append",
        default=[],
        metavar="PEER:KIND[=X]",
        help="peer PEER sends malicious contributions: scale=X, random, signflip, stale, "
        "lie-tokens=X, alie=Z, ipm=E or steps=X (repeatable: several attackers collude, "
        "e.g. --attack 3:alie --attack 5:alie); the report counts what the merge did about it; "
        "or acts as a hostile member: forge-handoffs (forged ReplicaStates for fragments "
        "it does not own) or claim-address (a learner-only member claiming an owner's "
        "address)",
    )
    local.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="PEER@STEP",
        help="fault injection: SIGKILL peer PEER once it reports inner step STEP (repeatable)",
    )
    local.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="PEER@FACTOR",
        help="fault injection: peer PEER takes FACTOR times as long per inner step (repeatable)",
    )
    local.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="train for this wall-clock time, counted from the start of training (every peer "
        "joined), instead of --steps",
    )
    local.add_argument(
        "--chaos",
        default=None,
        metavar="SPEC",
        help="kill, restart, slow and shape peers on a schedule (seconds from the start of "
        "training). SPEC: 'default' (kill=learner@every60s+restart20s,"
        "kill=owner@every90s+restart20s,calm=60s) or comma-separated items: "
        "kill=TARGET@WHEN[+restartDELAY] with TARGET learner (owns nothing), owner, any "
        "or a peer index and WHEN 30s (once) or every60s; slow=PEERxFACTOR; "
        "link=PEER:latency=50ms,bandwidth=10mbit; calm=DURATION (no new kill in the "
        "last DURATION; default min(60s, a quarter of the run)). A kill never takes one of the "
        "last 2 live peers. E.g. --duration 300 --chaos default, or --duration 60 "
        "--chaos kill=1@15s+restart10s,kill=learner@every25s+restart10s,slow=3x3",
    )

    join = sub.add_parser("join", help="join a running swarm and train")
    join.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="URL",
        help="addresses of any swarm members or bootstrap nodes, e.g. http://host:port",
    )
    join.add_argument(
        "--listen",
        default="0.0.0.0:0",
        metavar="HOST:PORT",
        help="where to listen (port 0: any free port)",
    )
    join.add_argument(
        "--public-address",
        default=None,
        metavar="HOST:PORT",
        help="the address others dial (default: the listen address); "
        "peers that cannot be dialled back train as learners only",
    )
    join.add_argument(
        "--serve-after-s",
        type=float,
        default=3600.0,
        help="after training, keep serving the fragments this peer owns this long",
    )
    join.add_argument(
        "--final-sync",
        action="store_true",
        help="after training, wait until no member learns and end on the owners' final "
        "versions: every peer that passes it ends on the same model (its final_param_hash)",
    )
    join.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save the island here every H steps, and resume from it after a crash or restart",
    )
    join.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="processes in this island, launched with torchrun (DDP inside, gloo on CPU, NCCL "
        "on GPUs); rank 0 speaks for the island on the swarm",
    )
    join.add_argument(
        "--shard",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="how the --nproc ranks hold the model: ddp, each a whole replica; fsdp, each 1/N of "
        "the parameters, gradients and AdamW state (FSDP2 fully_shard; needs --nproc 2 or more "
        "and --validate-windows 0; docs/islands.md)",
    )
    join.add_argument(
        "--wait-members",
        type=int,
        default=1,
        metavar="N",
        help="start training once N members of the swarm (this island included) are visible, "
        "e.g. islands started together that should also finish together with --final-sync",
    )
    _add_may_own(join)
    join.add_argument(
        "--schedule",
        choices=("swarm", "own"),
        default="swarm",
        help="swarm: start the learning-rate schedule at the step the swarm's learners are at "
        "(their median), warming up again from there, and train to --steps with them; "
        "own: this island's own schedule from step 0 (ignored when resuming a checkpoint)",
    )
    _add_swarm_arguments(join, key_required=True)
    _add_artifact_dir(
        join,
        "where the swarm recipe's artifacts are kept and served from; "
        "missing ones are fetched from peers by hash before training",
    )
    join.add_argument(
        "--swarm",
        default=None,
        metavar="ID",
        help="the swarm id (instead of --manifest): its manifest is fetched from an initial "
        "peer and checked against the id",
    )
    _add_json_logs(join)
    add_run_arguments(
        join,
        exclude=SWARM_WIDE_FIELDS + LAUNCHER_FIELDS,  # the recipe is the manifest's
        **dict.fromkeys(SCHEDULE_FIELDS),
    )  # None: not given, the swarm's schedule applies
    for action in join._actions:
        if action.dest in SCHEDULE_FIELDS:
            action.help = (
                f"{action.help} (default: the swarm's, from its manifest; "
                f"{getattr(RunConfig(), action.dest)} where the manifest has none)"
            )

    boot = sub.add_parser("bootstrap", help="run a DHT-only entry node for a swarm")
    boot.add_argument("--listen", default="0.0.0.0:0", metavar="HOST:PORT", help="where to listen")
    boot.add_argument(
        "--public-address", default=None, metavar="HOST:PORT", help="the address others dial"
    )
    boot.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="URL",
        help="other bootstrap nodes or members to connect to",
    )
    _add_swarm_arguments(boot, key_required=False)
    _add_artifact_dir(
        boot,
        "serve the recipe artifacts held here (the founder's: atoll swarm "
        "init --recipe stores them there)",
        default=None,
    )
    _add_json_logs(boot)

    rep = sub.add_parser(
        "replay", help="re-run an owner's merger log and show every decision that differs"
    )
    rep.add_argument(
        "log", type=Path, help="an owner's event log (JSON lines, from --event-log-dir)"
    )
    rep.add_argument(
        "--json",
        action="store_true",
        help='print {"decisions", "versions", "mismatches"} as JSON (exit 1 on a mismatch)',
    )

    from node.run.simulate import add_simulate_arguments

    add_simulate_arguments(
        sub.add_parser(
            "simulate",
            help="expected goodput under failures (your swarm, or the paper's Table 1), simulated",
        )
    )

    status = sub.add_parser("status", help="show what a peer sees of its swarm")
    status.add_argument("--peer", required=True, metavar="URL", help="a member's address")
    status.add_argument("--json", action="store_true", help="print the raw JSON (default: tables)")
    status.add_argument(
        "--serve",
        nargs="?",
        const="127.0.0.1:0",
        default=None,
        metavar="HOST:PORT",
        help="instead of printing, serve the peer's status page and /metrics here, each request to "
        "the peer signed with --key and --cert (a certified swarm's peer answers nothing else), "
        "for a browser or Prometheus; PORT alone listens on 127.0.0.1 (default 127.0.0.1, any "
        "free port)",
    )
    _add_swarm_arguments(status, key_required=False)

    from node.run.admin import add_admin_commands

    add_admin_commands(sub)

    peer = sub.add_parser("peer", help="one peer of a local swarm (used by atoll local)")
    peer.add_argument("--config", type=Path, required=True, help="the swarm's config.json")
    peer.add_argument("--index", type=int, required=True, help="this peer's index in the swarm")
    peer.add_argument(
        "--initial-peers", nargs="*", default=[], help="addresses of peers to join through"
    )
    peer.add_argument("--t0", type=float, default=0.0, help="wall-clock origin of the eval curves")
    peer.add_argument(
        "--initial-peers-from-stdin",
        action="store_true",
        help='read {"initial_peers": [...]} from stdin after loading the model and data',
    )
    peer.add_argument(
        "--wait-members", type=int, default=1, help="start training once this many members joined"
    )
    _add_may_own(peer)
    peer.add_argument(
        "--slow-factor", type=float, default=1.0, help="emulate a slower machine (fault injection)"
    )
    peer.add_argument(
        "--event-log-dir",
        type=Path,
        default=None,
        help="owners log their mergers' events and decisions here (atoll replay)",
    )
    peer.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save the island here every H steps, and resume from it when it holds one",
    )
    peer.add_argument(
        "--until",
        type=float,
        default=0.0,
        help="stop training at this unix time (0: run all steps)",
    )
    peer.add_argument("--key", type=Path, default=None, help="this peer's key (PEM)")
    peer.add_argument("--cert", type=Path, default=None, help="this peer's certificate")
    peer.add_argument("--manifest", type=Path, default=None, help="the swarm's signed manifest")
    peer.add_argument(
        "--attack",
        default="",
        metavar="KIND[=X]",
        help="send malicious contributions (measurement): scale=X, random, signflip, stale, lie-tokens=X, "
        "alie=Z, ipm=E, steps=X",
    )
    return parser


def _add_may_own(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--may-own",
        choices=("yes", "no"),
        default="yes",
        help="no: never offer to own fragments (a learner only, reading a bounded view of the "
        "members: the candidate owners, and others by id as needed; docs/scale_peers.md)",
    )


def _add_artifact_dir(parser: argparse.ArgumentParser, text: str, **kw: Any) -> None:
    from node.state.artifacts import default_artifact_dir

    default = kw.get("default", default_artifact_dir())
    parser.add_argument(
        "--artifact-dir",
        type=Path,
        default=default,
        metavar="DIR",
        help=f"{text} (default: {default or 'none'})",
    )


def _add_json_logs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json-logs",
        action="store_true",
        help="log one JSON object per record on stderr (time, level, logger, message and "
        "the record's fields) instead of text, and no progress line",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # atoll join --nproc relaunches it
    tune_allocator()  # large tensors reuse warm pages round after round (node/diloco/allocator.py)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command in ("keygen", "swarm"):
        from node.run.admin import run_admin

        return run_admin(args)
    if args.command == "local":
        return _local(args)
    if args.command == "join":
        from node.run.join import join_main

        return join_main(args)
    if args.command == "bootstrap":
        from node.run.join import bootstrap_main

        return bootstrap_main(args)
    if args.command == "simulate":
        from node.run.simulate import simulate_main

        return simulate_main(args)
    if args.command == "replay":
        from node.run.replay import replay_main

        return replay_main(args)
    if args.command == "status":
        if args.serve is not None:
            return _status_serve(args)
        from node.run.join import status_main

        return status_main(args)
    if args.command == "peer":
        try:  # before torch comes: a config that is not one is one line, at once
            cfg = RunConfig.load(args.config)
        except OSError as exc:
            print(
                f"atoll peer: --config {args.config}: cannot read it: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
        except ValueError as exc:
            print(
                f"atoll peer: --config {args.config}: {' '.join(str(exc).split())}", file=sys.stderr
            )
            return 2
        from node.run.train import PeerOptions, run_peer

        logging.getLogger().setLevel(min(logging.INFO, logging.getLogger().level))
        from node.dht.swarm import SwarmCredentials
        from node.wire.identity import load_certificate, load_key, load_manifest

        signer = load_key(args.key) if args.key else None
        credentials = None
        if args.manifest:
            if signer is None:
                print("atoll peer: --manifest needs --key", file=sys.stderr)
                return 2
            credentials = SwarmCredentials(
                load_manifest(args.manifest),
                signer,
                load_certificate(args.cert) if args.cert else None,
            )
        opts = PeerOptions(
            index=args.index,
            initial_peers=tuple(args.initial_peers),
            t0=args.t0,
            initial_peers_from_stdin=args.initial_peers_from_stdin,
            wait_members=args.wait_members,
            slow_factor=args.slow_factor,
            attack=args.attack,
            signer=signer,
            credentials=credentials,
            checkpoint_dir=args.checkpoint_dir,
            until=args.until,
            event_log_dir=args.event_log_dir,
            may_own=args.may_own == "yes",
        )
        run_peer(cfg, opts)
        from node.diloco.ranks import exit_without_teardown  # torch is loaded by now

        exit_without_teardown(0)  # its only thread is this one, its results are out
    return 2


def _local(args: argparse.Namespace) -> int:
    """``atoll local``: every flag checked before a peer starts; a failure is one line."""
    try:
        cfg = config_from_args(
            args
        )  # before the imports that bring torch: a flag's mistake is told at once
    except ValueError as exc:
        print(f"atoll local: {exc}", file=sys.stderr)
        return 2
    from node.run.checks import check_local, check_run
    from node.run.local_command import run_local

    try:
        check_local(cfg)
        check_run(cfg)
        kill_at = _parse_kills(args.kill, cfg.peers)
        slow = _parse_slow(args.slow, cfg.peers)
        attacks = _parse_attacks(args.attack, cfg.peers)
        chaos = _parse_chaos(args.chaos, args.duration, cfg.peers)
    except ValueError as exc:
        print(f"atoll local: {exc}", file=sys.stderr)
        return 2
    extra: dict[int, list[str]] = {i: ["--slow-factor", str(f)] for i, f in slow.items()}
    if args.may_own is not None:
        if not 1 <= args.may_own <= cfg.peers:
            print(
                f"atoll local: --may-own must be 1..{cfg.peers}, got {args.may_own}",
                file=sys.stderr,
            )
            return 2
        for i in range(args.may_own, cfg.peers):
            extra.setdefault(i, []).extend(["--may-own", "no"])
    for i, attack in attacks.items():
        extra.setdefault(i, []).extend(["--attack", attack])
    try:
        run_local(
            cfg,
            report_path=args.report,
            baseline=args.baseline,
            alone=args.alone,
            quiet=args.quiet,
            kill_at=kill_at,
            extra_peer_args=extra,
            attacks=attacks,
            admission=args.admission,
            chaos=chaos,
            duration_s=args.duration,
            spawn=args.spawn,
        )
    except Exception as exc:  # a peer's failure is one line; _one_line re-raises the rest
        print(f"atoll local: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _status_serve(args: argparse.Namespace) -> int:
    """``atoll status --serve``: the peer's page and metrics on this machine, signed for
    (``node.status.serve``), until SIGINT or SIGTERM. A mistake, or a peer that refuses or does not
    answer at start, is one line and exit 1."""
    import asyncio

    from node.run.checks import CheckError, peer_url
    from node.run.join import SwarmError, load_swarm
    from node.status.serve import PeerUnavailable, StatusProxy

    try:
        host, port = _serve_address(args.serve)
        peer = peer_url(args.peer, "--peer")
        if not (args.key and args.manifest):
            raise SwarmError(
                "--serve signs its requests to the peer: pass --manifest and --key "
                "(and --cert in a certified swarm)"
            )
        swarm = load_swarm(args, initial_peers=[])
        proxy = StatusProxy(
            peer, swarm=swarm.manifest.swarm_id, signer=swarm.signer, cert=swarm.cert
        )
        return asyncio.run(_serve_status(proxy, host, port))
    except (SwarmError, CheckError, PeerUnavailable) as exc:
        why = exc.reason_text if isinstance(exc, PeerUnavailable) else str(exc)
        print(f"atoll status: {' '.join(why.split())}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"atoll status: --serve {args.serve}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _serve_address(spec: str) -> tuple[str, int]:
    """``--serve``'s ``HOST:PORT``; ``PORT`` or ``:PORT`` alone listens on 127.0.0.1."""
    from node.run.checks import CheckError

    host, _, port = spec.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise CheckError(
            f"--serve {spec!r} is not HOST:PORT or PORT, e.g. 127.0.0.1:9100 (port 0: any free port)"
        )
    return host.strip("[]") or "127.0.0.1", int(port)


async def _serve_status(proxy: StatusProxy, host: str, port: int) -> int:
    import asyncio
    import signal

    url = await proxy.start(host, port)
    try:
        print(
            f"atoll status: {proxy.peer}'s status page at {url} and its metrics at {url}metrics "
            "(each request signed with --key); Ctrl-C stops",
            flush=True,
        )
        if not host.startswith("127.") and host not in ("localhost", "::1"):
            print(
                f"atoll status: listening on {host}: whoever reaches it reads what your key may",
                file=sys.stderr,
            )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await proxy.close()
    return 0


def _one_line(exc: BaseException) -> str:
    """A launcher's failure in one line: the first failure inside a task group; raises ``exc``
    again when it holds anything but a peer's failure (a bug: its traceback is wanted)."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]  # an ExceptionGroup (asyncio.TaskGroup)
    if not isinstance(exc, RuntimeError | OSError | TimeoutError):
        raise exc
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out waiting for the peers; their logs are in the folder printed above"
    return " ".join(str(exc).split())


def _host_port(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"bad address {spec!r}: expected HOST:PORT, e.g. 0.0.0.0:7000")
    return host or "0.0.0.0", int(port)


def _add_swarm_arguments(parser: argparse.ArgumentParser, *, key_required: bool) -> None:
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        metavar="swarm.toml",
        help="the swarm's manifest, signed by its founder",
    )
    parser.add_argument(
        "--key",
        type=Path,
        required=key_required,
        default=None,
        metavar="KEY",
        help="this peer's key (PEM, from atoll keygen)",
    )
    parser.add_argument(
        "--cert",
        type=Path,
        default=None,
        metavar="CERT",
        help="this peer's certificate from a lab's authority (atoll swarm certify); "
        "without one a peer may only learn, and only in an open swarm",
    )


def _parse_kills(specs: list[str], peers: int) -> dict[int, int]:
    """``["1@100"]`` -> ``{1: 100}``; raises ValueError with the expected form."""
    out: dict[int, int] = {}
    for spec in specs:
        index, sep, step = spec.partition("@")
        if not (sep and index.isdigit() and step.isdigit()) or not 0 < int(index) < peers:
            raise ValueError(
                f"bad --kill {spec!r}: expected PEER@STEP with 0 < PEER < {peers} "
                "(peer 0 founds the swarm), e.g. --kill 1@100"
            )
        out[int(index)] = int(step)
    return out


def _parse_chaos(spec: str | None, duration: float | None, peers: int) -> ChaosSpec | None:
    """``--chaos`` and ``--duration`` checked together; raises ValueError with the expected form."""
    from node.run.chaos import parse_chaos

    if duration is not None and not 0 < duration < math.inf:
        raise ValueError(f"bad --duration {duration:g}: expected SECONDS > 0, e.g. --duration 300")
    return parse_chaos(spec, peers) if spec is not None else None


def _parse_attacks(specs: list[str], peers: int) -> dict[int, str]:
    """``["2:scale=1000"]`` -> ``{2: "scale=1000"}``; raises ValueError with the expected form."""
    if not specs:
        return {}  # no attack: the attacks' module (and torch) stays unimported in the launcher
    from node.run.attack import parse_local_attack

    out: dict[int, str] = {}
    for spec in specs:
        index, attack = parse_local_attack(spec)
        if not 0 <= index < peers:
            raise ValueError(f"bad --attack {spec!r}: peer {index} is not one of 0..{peers - 1}")
        if index in out:
            raise ValueError(
                f"bad --attack {spec!r}: peer {index} already attacks ({out[index]}); one kind a peer"
            )
        out[index] = attack
    return out


def _parse_slow(specs: list[str], peers: int) -> dict[int, float]:
    """``["2@3"]`` -> ``{2: 3.0}``; raises ValueError with the expected form."""
    out: dict[int, float] = {}
    for spec in specs:
        index, sep, factor = spec.partition("@")
        try:
            ok = (
                bool(sep)
                and index.isdigit()
                and 0 <= int(index) < peers
                and 1.0 <= float(factor) < math.inf
            )
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"bad --slow {spec!r}: expected PEER@FACTOR with 0 <= PEER < {peers} "
                "and FACTOR >= 1 (finite), e.g. --slow 2@3"
            )
        out[int(index)] = float(factor)
    return out
