"""The ``atoll`` command line.

``atoll local``  — a multi-process swarm on 127.0.0.1 training a byte-level GPT on a real corpus.
``atoll peer``   — one peer of a local swarm (started by ``atoll local``; not for direct use).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from node.config import RunConfig, add_run_arguments, config_from_args

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atoll", description="Peer-to-peer Decoupled DiLoCo training.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    local = sub.add_parser("local", help="run a local multi-process swarm and write a report",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_arguments(local)
    local.add_argument("--report", type=Path, default=None,
                       help="where to write the JSON report (a PNG plot goes beside it); "
                            "default runs/<time>/report.json")
    local.add_argument("--baseline", action="store_true",
                       help="also train the synchronous data-parallel baseline at equal tokens and report the gap")
    local.add_argument("--quiet", action="store_true", help="no live progress lines")

    peer = sub.add_parser("peer", help="one peer of a local swarm (used by atoll local)")
    peer.add_argument("--config", type=Path, required=True, help="the swarm's config.json")
    peer.add_argument("--index", type=int, required=True, help="this peer's index in the swarm")
    peer.add_argument("--initial-peers", nargs="*", default=[], help="addresses of peers to join through")
    peer.add_argument("--t0", type=float, default=0.0, help="wall-clock origin of the eval curves")
    peer.add_argument("--initial-peers-from-stdin", action="store_true",
                      help="read {\"initial_peers\": [...]} from stdin after loading the model and data")
    peer.add_argument("--wait-members", type=int, default=1, help="start training once this many members joined")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "local":
        from node.swarm import run_local

        try:
            cfg = config_from_args(args)
        except ValueError as exc:
            print(f"atoll local: {exc}", file=sys.stderr)
            return 2
        try:
            run_local(cfg, report_path=args.report, baseline=args.baseline, quiet=args.quiet)
        except KeyboardInterrupt:
            return 130
        return 0
    if args.command == "peer":
        from node.train import PeerOptions, run_peer

        logging.getLogger().setLevel(min(logging.INFO, logging.getLogger().level))
        opts = PeerOptions(index=args.index, initial_peers=tuple(args.initial_peers), t0=args.t0,
                           initial_peers_from_stdin=args.initial_peers_from_stdin,
                           wait_members=args.wait_members)
        run_peer(RunConfig.load(args.config), opts)
        return 0
    return 2
