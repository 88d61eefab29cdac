"""Averaging against hivemind: one full-model cycle through Atoll vs one hivemind all-reduce.

N peer processes on 127.0.0.1 each hold a model of P fp32 values (``--fragments`` equal
tensors, one Atoll fragment each; by default one per peer). Interleaved, the bench times:

``atoll``     one full-model cycle through Atoll: every peer contributes every fragment, each
              fragment's owner merges all N contributions (``sync`` mode, quorum N), and every
              peer has adopted the new version of every fragment (``bench.averaging_atoll``);
``hivemind``  one ``DecentralizedAverager.step()`` of hivemind 1.1.12 over the same tensors,
              target group size N (``bench.averaging_hivemind``);
``raw``       the same bytes in Atoll's pattern over bare aiohttp, nothing else done: the
              limit (``bench.averaging_raw``).

By default (``--isolate``) hivemind runs in N processes of its own and Atoll and raw share
another N, and the two sets take turns (``--blocks``, each starting afresh and warming up):
hivemind's DHT, averager and p2pd processes keep using CPU between its rounds (~0.25 of this
2-core box's cores), which otherwise lands in the other systems' rounds. ``--no-isolate`` runs
every system in the same processes, alternating round by round (atoll, hivemind, raw, ...).

Times run from the launcher's "go" to the last peer's "done"; inputs are prepared before.
Every round is checked: peer 0 recomputes the merge from the seeded inputs and every Atoll
peer must hold bit-identical fragments. Medians over ``--repeats`` rounds, after ``--warmup``
rounds of each (default three). Codecs: ``none`` (fp32), ``fp16`` (Atoll's bf16 up and down against
hivemind's Float16Compression), and ``int8``: Atoll as it can ship, int8 pseudo-gradients up
and each version down as an int8 update over the previous one (``update_codec``), against
hivemind's fp32 and the raw fp32 bytes (hivemind's 8-bit codecs are broken with numpy >= 2.4,
so fp32 is its best working codec here; ``none`` stays the like-for-like comparison).
Then, per case, a peer is killed (SIGKILL to its process group) ``--kill-at`` of the way into a
round, on fresh processes running one system at a time (Atoll's side elastic: decoupled mode,
every live learner the quorum, no grace window; sync mode, the paper's baseline, waits for a dead
learner until it is back): the seconds until every survivor holds a merged model, and which
peers' inputs each fragment (Atoll) or chunk (hivemind) matches ("all", "survivors", "subset
0,1,3" for an Atoll version that merged exactly those peers' whole contributions, or "neither":
a silently partial or wrong merge).

Progress goes to stderr; the last line of stdout is the JSON result.

    python -m bench.averaging [--cases 4x10M,4x50M,8x50M,4x124M] [--codecs none,fp16,int8] [--repeats 3]

``4x124M`` is a GPT-2-small-sized model (124M fp32 values, ~496 MB a peer) cut in 4 fragments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.averaging_hivemind import hivemind_missing
from bench.averaging_workers import PeerFailed, Workers, available_mb

__all__ = ["main", "parse_case"]

SYSTEMS = ("atoll", "hivemind", "raw")
DEFAULT_CASES = "4x10M,4x50M,8x50M,4x124M"  # 4x124M: GPT-2 small's size
HEADROOM_MB = 1536  # left to the machine's other users (the memory guard stops a case below it)
# the bench's codec -> what each system sends (atoll: up / down), and Atoll's bytes per value
# each way (int8: one byte per value and an fp32 scale per block of 64)
CODECS: dict[str, dict[str, Any]] = {
    "none": {
        "atoll_codec": "fp32 up / fp32 down",
        "hivemind_codec": "none",
        "raw_codec": "fp32",
        "atoll_bytes_per_value": 4.0,
    },
    "fp16": {
        "atoll_codec": "bf16 up / bf16 down",
        "hivemind_codec": "fp16 (Float16Compression)",
        "raw_codec": "16-bit",
        "atoll_bytes_per_value": 2.0,
    },
    "int8": {
        "atoll_codec": "int8 up / int8 update down",
        "hivemind_codec": "none",
        "raw_codec": "fp32",
        "atoll_bytes_per_value": 1 + 4 / 64,
    },
    "int4": {
        "atoll_codec": "int4 up / int4 update down (Atoll's defaults)",
        "hivemind_codec": "none",
        "raw_codec": "fp32",
        "atoll_bytes_per_value": 0.5 + 4 / 64,
    },
}


def parse_case(text: str) -> tuple[int, int]:
    """``"4x50M"`` -> (4, 50_000_000); suffixes k, M, G."""
    peers, _, size = text.lower().partition("x")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(size[-1:], 1)
    number = size[:-1] if size[-1:] in "kmg" else size
    return int(peers), int(float(number) * scale)


def _say(msg: str) -> None:
    print(f"[averaging] {msg}", file=sys.stderr, flush=True)


class Round:
    """Numbers the rounds of each system; checks them."""

    def __init__(self, workers: Workers, args: argparse.Namespace, codec: str) -> None:
        self.w, self.args, self.codec = workers, args, codec
        self.counter = dict.fromkeys(SYSTEMS, 0)

    def run(self, system: str, *, kill: tuple[int, float] | None = None) -> dict[str, Any]:
        r = self.counter[system]
        self.counter[system] += 1
        everyone = list(self.w.alive)
        self.w.ask_all(
            # only peer 0 checks Atoll's merges (``check``), so only it keeps the round's base
            # state: at 4 x 124M a copy on every peer was 1.5 GB of the box's 23 GiB
            {"cmd": "prepare", "system": system, "round": r, "keep_base_peers": [0]},
            self.args.timeout,
        )
        seconds, replies = self.w.timed(
            {"cmd": "go", "system": system, "round": r, "timeout_s": self.args.timeout},
            self.args.timeout + 30,
            kill,
        )
        out: dict[str, Any] = {
            "seconds": round(seconds, 4),
            "ok": all(x.get("ok") for x in replies),
            "cpu_s": round(self.w.last_cpu_s, 3) if kill is None else None,
            "busiest_peer_cpu_s": (
                round(max(self.w.last_peer_cpu_s), 3)
                if kill is None and self.w.last_peer_cpu_s
                else None
            ),
            "load_avg": round(os.getloadavg()[0], 2),
            "wall": [round(x, 3) for x in self.w.last_wall],
        }
        if (
            system == "atoll" and kill is None
        ):  # versions received as int8 updates (update_codec) or full
            for key in (
                "versions_received",
                "updates_applied",
                "update_mismatches",
                "versions_replica",
            ):
                out[key] = sum(x.get(key, 0) for x in replies)
            out["updates_applied_per_peer"] = [x.get("updates_applied", 0) for x in replies]
            out["versions_replica_per_peer"] = [x.get("versions_replica", 0) for x in replies]
        if kill is None:  # where the round's CPU went, by thread role, summed over the peers
            out["cpu_by_thread"] = _summed(x.get("threads", {}) for x in replies)
        if system == "atoll" and kill is None:
            out["messages"] = _added(x.get("messages", {}) for x in replies)
        errors = [x.get("error") for x in replies if not x.get("ok")]
        if errors:
            out["errors"] = errors[:3]
        if system == "hivemind" and not out["ok"] and kill is not None:
            # hivemind's answer to a failed round is another round: the survivors try once more
            more, replies = self.w.timed(
                {"cmd": "go", "system": system, "round": r, "timeout_s": self.args.timeout},
                self.args.timeout + 30,
            )
            out.update(
                seconds=round(seconds + more, 4),
                retried=True,
                ok=all(x.get("ok") for x in replies),
                retry_errors=[x.get("error") for x in replies if not x.get("ok")][:3],
            )
        if system != "raw":
            out["check"] = self.check(system, r, everyone, kill)
        return out

    def check(
        self, system: str, r: int, everyone: list[int], kill: tuple[int, float] | None
    ) -> dict[str, Any]:
        sets = {"all": everyone}
        if kill is not None:
            sets["survivors"] = [i for i in everyone if i != kill[0]]
        cmd = {"cmd": "check", "system": system, "round": r, "sets": sets}
        if (
            system == "hivemind" and kill is not None
        ):  # every survivor checks a quarter of its chunks
            replies = self.w.ask_all({**cmd, "stride": 4}, 3600)
            return {
                "per_peer": [
                    {k: x.get(k) for k in ("chunks", "worst_errors", "error")} for x in replies
                ],
                "matches": sorted({m for x in replies for m in x.get("matches", ["error"])}),
            }
        reply = self.w.ask(0, cmd, 3600)
        out: dict[str, Any] = {"matches": reply.get("matches", ["error"])}
        if system == "atoll":
            digests = {
                json.dumps(x["digests"])
                for x in self.w.ask_all({"cmd": "digests", "system": system}, 600)
            }
            out["identical_on_every_peer"] = len(digests) == 1
            out["fragments"] = reply.get("fragments")
        else:
            out["chunks"], out["worst_errors"] = reply.get("chunks"), reply.get("worst_errors")
        if "error" in reply:
            out["error"] = reply["error"]
        return out


def _added(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The peers' counts by key, added (keys in order)."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(sorted(total.items()))


def _summed(per_peer: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The peers' ``bench.averaging_threads`` figures by role, added (roles in order)."""
    total: dict[str, dict[str, float]] = {}
    for roles in per_peer:
        for role, figures in roles.items():
            mine = total.setdefault(role, {})
            for key, value in figures.items():
                mine[key] = round(mine.get(key, 0) + value, 3)
    return dict(sorted(total.items()))


def _median(runs: list[dict[str, Any]], key: str = "seconds") -> float | None:
    good = [x[key] for x in runs if x["ok"]]
    return round(statistics.median(good), 4) if good else None


def _spec(
    args: argparse.Namespace,
    peers: int,
    params: int,
    codec: str,
    systems: list[str],
    *,
    elastic: bool = False,
) -> dict[str, Any]:
    """The workers' spec. ``elastic``: Atoll's side in decoupled mode (a round waits for the
    live learners only, all of them), as the kill test runs it; else sync mode."""
    fragments = fragments_of(args, peers)
    spec = {
        "peers": peers,
        "params": params,
        "fragments": fragments,
        "seed": args.seed,
        "codec": codec,
        "systems": systems,
        "elastic": elastic,
        "owner_fanout": getattr(args, "owner_fanout", 1),
    }
    if "atoll" in systems and args.swarm == "signed":
        from bench.averaging_atoll import swarm_credentials
        from bench.averaging_inputs import Layout

        spec["atoll_credentials"] = swarm_credentials(
            peers=peers,
            seed=args.seed,
            codec=codec,
            layout=Layout(params, fragments),
            elastic=elastic,
            owner_fanout=spec["owner_fanout"],
        )
    return spec


def fragments_of(args: argparse.Namespace, peers: int) -> int:
    """The fragments (= tensors) of a case's model: ``--fragments``, or one per peer (0)."""
    return args.fragments if args.fragments > 0 else peers


def _settle(w: Workers, args: argparse.Namespace) -> list[int]:
    """Wait until every Atoll peer sees the same owners; hand them to the raw sides. Returns
    each fragment's owner (peer index)."""
    for _ in range(5):
        owners = [x["owners"] for x in w.ask_all({"cmd": "settle"}, args.timeout)]
        if all(o == owners[0] for o in owners) and all(owners[0]):
            break
    else:
        raise PeerFailed(f"the peers disagree on fragment owners: {owners}")
    atoll_urls = [x["atoll"] for x in w.ready]
    raw_urls = [x["raw"] for x in w.ready] if "raw" in w.ready[0] else []
    if raw_urls:
        w.ask_all(
            {"cmd": "owners", "owners": owners[0], "atoll_urls": atoll_urls, "raw_urls": raw_urls},
            60,
        )
    return [atoll_urls.index(u) for u in owners[0]]


def groups_of(systems: list[str], isolate: bool) -> list[list[str]]:
    """The sets of systems that share peer processes. Isolated: Atoll and raw (raw follows
    Atoll's owners and costs nothing while idle: an aiohttp server on a thread) in one set, and
    hivemind in its own, so each system's rounds run with no other system's processes on the
    box (hivemind's DHT, averager and p2pd processes keep using CPU between its rounds)."""
    if not isolate:
        return [list(systems)]
    own = [s for s in systems if s in ("atoll", "raw")]
    return [g for g in (own, [s for s in systems if s == "hivemind"]) if g]


def measure(
    args: argparse.Namespace, peers: int, params: int, codec: str, systems: list[str], log_dir: Path
) -> dict[str, Any]:
    """``--warmup`` untimed rounds, then ``--repeats`` timed rounds of each system, interleaved:
    medians and every run. With ``--isolate`` the systems run in separate sets of processes,
    alternating in ``--blocks`` blocks (each block starts its processes afresh and warms them up);
    without, every peer process hosts every system and the rounds alternate one by one."""
    groups = groups_of(systems, args.isolate)
    blocks = args.blocks if len(groups) > 1 else 1
    per_block = [
        args.repeats // blocks + (1 if b < args.repeats % blocks else 0) for b in range(blocks)
    ]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    counter = dict.fromkeys(SYSTEMS, 0)  # round numbers (the inputs' seeds) run on across blocks
    owners: list[int] = []
    peak: list[int] = [0] * peers
    sessions: list[int] = [0] * peers
    held: list[Any] = []
    for b, repeats in enumerate(per_block):
        if repeats == 0:
            continue
        for group in groups if b % 2 == 0 else groups[::-1]:
            label = f" (block {b + 1} of {blocks})" if blocks > 1 else ""
            _say(
                f"{peers} x {params:,} codec {codec}: starting {peers} peers ({', '.join(group)}){label}"
            )
            w = Workers(_spec(args, peers, params, codec, group), log_dir)
            try:
                if "atoll" in group:
                    owners = _settle(w, args)
                rounds = Round(w, args, codec)
                rounds.counter = counter
                for rep in range(1 - args.warmup, repeats + 1):
                    for s in group:
                        out = rounds.run(s)
                        _say(
                            f"  {'warm-up' if rep <= 0 else f'round {rep}'} {s:8} {out['seconds']:8.3f} s "
                            f"(cpu {out['cpu_s']:.2f} s, busiest peer {out['busiest_peer_cpu_s']:.2f} s, load {out['load_avg']}) ok={out['ok']} "
                            f"{out.get('check', {}).get('matches', '')} {out.get('errors', '')}"
                            + (
                                f" updates {out['updates_applied']}/{out['versions_received']} versions"
                                if out.get("updates_applied")
                                else ""
                            )
                        )
                        if rep > 0:
                            runs[s].append(out)
                memory = w.ask_all({"cmd": "memory", "detail": args.memory_detail}, 600)
                now = [w.session_rss_mb(i) for i in w.alive]
                _say(
                    f"  peak RSS per peer {[m.get('peak_rss_mb') for m in memory]} MiB; each peer's processes "
                    f"now {now} MiB"
                    + (f"; held {[m.get('held_mb') for m in memory]}" if args.memory_detail else "")
                )
                peak = [
                    max(a, m.get("peak_rss_mb") or 0) for a, m in zip(peak, memory, strict=True)
                ]
                sessions = [max(a, n) for a, n in zip(sessions, now, strict=True)]
                if args.memory_detail:
                    held = [m.get("held_mb") for m in memory]
            finally:
                w.close()
    result: dict[str, Any] = {f"{s}_s": _median(runs[s]) for s in systems}
    result.update({f"{s}_cpu_s": _median(runs[s], "cpu_s") for s in systems})
    result.update(
        {f"{s}_busiest_peer_cpu_s": _median(runs[s], "busiest_peer_cpu_s") for s in systems}
    )
    result.update(
        {f"{s}_runs": runs[s] for s in systems},
        owners=owners,
        peak_rss_mb=peak,
        processes_rss_mb=sessions,
        isolated=len(groups) > 1,
        blocks=blocks,
    )
    if args.memory_detail:
        result["held_mb"] = held
    return result


def kill_test(
    args: argparse.Namespace,
    peers: int,
    params: int,
    system: str,
    normal_s: float | None,
    log_dir: Path,
) -> dict[str, Any]:
    """One warm-up round, then a round in which the last peer is killed ``--kill-at`` into it."""
    _say(f"{peers} x {params:,}: kill test on {system}")
    w = Workers(_spec(args, peers, params, "none", [system], elastic=True), log_dir)
    try:
        owners = _settle(w, args) if system == "atoll" else []
        rounds = Round(w, args, "none")
        warm = rounds.run(system)
        after = args.kill_at * (normal_s or warm["seconds"])
        out = rounds.run(system, kill=(peers - 1, after))
    finally:
        w.close()
    matches = out.get("check", {}).get("matches", ["error"])
    # "neither": a merged model that is no correct merge of any set of peers' inputs; "not
    # merged": a fragment that got no new version (the survivors are still waiting: not silent)
    result = {
        "killed_peer": peers - 1,
        "killed_after_s": round(after, 3),
        "recovered": out["ok"],
        "seconds_to_merged": out["seconds"] if out["ok"] else None,
        "merged_from": matches,
        "silently_partial": "neither" in matches,
        "mixed": len(set(matches) - {"error", "not merged"}) > 1,
        **out,
    }
    if system == "atoll":
        result["fragments_owned_by_killed_peer"] = sum(1 for o in owners if o == peers - 1)
    _say(f"  {system} kill: recovered={out['ok']} in {out['seconds']:.2f} s, merged from {matches}")
    return result


def memory_needed_mb(
    peers: int, params: int, systems: tuple[str, ...] | list[str] = SYSTEMS, codec: str = "none"
) -> int:
    """What N peers running ``systems`` with ``codec`` hold at their peak (MiB), from this
    bench's own measurements of each peer's processes (shared pages count in each, so it errs
    high; the memory guard stops a case that leaves the machine under ``HEADROOM_MB`` anyway):

    - Atoll and raw, fp32: 3985-4243 MiB per peer at 4 x 124M (2026-12-06, after the checker alone
      kept a base state and raw one buffer per fragment), ~0.6 GiB plus ~30 bytes per parameter:
      counted as 31, and peer 0, which recomputes every merge to check it, ~17 more (6132 MiB);
    - Atoll and raw with bf16 (``fp16``): 3.0-3.3 GiB per peer at 4 x 50M: counted as 58; with
      ``int8``/``int4`` (peers read 4.3-6.6 GiB at 50M with hivemind's processes): 72;
    - hivemind alone: 1.4-1.85 GiB per peer's processes at 4 x 50M, ~1.0 GiB at 10M: 0.8 GiB
      plus 24 bytes per parameter;
    - all of them in the same processes (``--no-isolate``): the two added."""
    mib = params / (1 << 20)
    per_peer, checker = 0.0, 0.0
    if {"atoll", "raw"} & set(systems):
        per_peer += 600 + {"none": 31, "fp16": 58}.get(codec, 72) * mib
        checker = 17 * mib if codec == "none" else 0.0
    if "hivemind" in systems:
        per_peer += 800 + 24 * mib
    return int(peers * per_peer + checker)


def memory_shortfall(
    peers: int, params: int, systems: list[str], isolate: bool, codec: str
) -> str | None:
    """Why a case cannot run here with ``codec`` (its largest group of systems would need more
    memory than the machine has available, less ``HEADROOM_MB``), or None."""
    need = max(memory_needed_mb(peers, params, g, codec) for g in groups_of(systems, isolate))
    free = available_mb()
    if need <= free - HEADROOM_MB:
        return None
    return (
        f"not run: {peers} peers x {params:,} parameters with codec {codec} need ~{need / 1024:.0f} GiB "
        f"at their peak (~{need // peers} MiB per peer), the machine has {free / 1024:.0f} GiB available"
    )


def run_case(
    args: argparse.Namespace,
    peers: int,
    params: int,
    systems: list[str],
    log_dir: Path,
    hivemind_reason: str | None,
) -> dict[str, Any]:
    case: dict[str, Any] = {
        "peers": peers,
        "params": params,
        "fragments": fragments_of(args, peers),
    }
    measured: set[str] = set()
    for codec in args.codecs:
        shortfall = (
            memory_shortfall(peers, params, systems, args.isolate, codec)
            if args.memory_guard
            else None
        )
        if shortfall is not None:  # checked per codec: 8 x 50M fits here in fp32, not in bf16
            _say(shortfall)
            got: dict[str, Any] = {"error": shortfall}
        else:
            try:
                got = measure(args, peers, params, codec, systems, log_dir)
                measured.add(codec)
            except (
                PeerFailed
            ) as exc:  # a case that cannot run here is data, not the end of the bench
                _say(f"  {peers} x {params:,} codec {codec} failed: {exc}")
                got = {"error": str(exc)[:2000]}
        if "hivemind_s" not in got:
            got["hivemind_s"], got["hivemind_error"] = None, hivemind_reason
        got = {
            "atoll_s": got.get("atoll_s"),
            "hivemind_s": got.get("hivemind_s"),
            "raw_s": got.get("raw_s"),
            **got,
        }
        a, h, r = got["atoll_s"], got["hivemind_s"], got["raw_s"]
        got["hivemind_over_atoll"] = round(h / a, 3) if a and h else None
        got["atoll_throughput_vs_raw"] = round(r / a, 3) if a and r else None
        labels = {k: v for k, v in CODECS[codec].items() if k != "atoll_bytes_per_value"}
        bpv = CODECS[codec]["atoll_bytes_per_value"]
        got["atoll_gbytes_per_s_per_peer"] = round(2 * params * bpv / a / 1e9, 3) if a else None
        if codec == args.codecs[0]:
            case.update(codec=codec, **labels, **got)
        else:
            case[codec] = {"codec": codec, **labels, **got}
    if args.kill and "none" in measured:
        case["kill"] = {}
        for s in systems:
            if s == "raw":
                continue
            try:
                case["kill"][s] = kill_test(args, peers, params, s, case.get(f"{s}_s"), log_dir)
            except PeerFailed as exc:
                _say(f"  {s} kill test failed: {exc}")
                case["kill"][s] = {"error": str(exc)[:2000]}
    return case


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help="PEERSxPARAMS, comma-separated (4x124M: GPT-2 small's size)",
    )
    parser.add_argument(
        "--codecs",
        default="none,fp16",
        help="none (fp32), fp16 (Atoll bf16, hivemind Float16Compression), int8 (Atoll "
        "int8 up and int8 updates down, against hivemind and raw in fp32)",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="atoll, hivemind, raw")
    # 3 + 5 per block: the method of every figure in docs/benchmarks.md since 2026-12-03 (with one
    # warm-up round a block's second round could still be growing its heap, and 3 timed rounds
    # a block left one slow round a third of the median's votes)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds per system and block (after the warm-up)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed rounds of each system first (interleaved as the timed ones); a "
        "peer's heap grows over its first few rounds, to the versions it keeps",
    )
    parser.add_argument(
        "--swarm",
        choices=("signed", "development"),
        default="signed",
        help="Atoll's swarm: signed (a founder's manifest and a certificate per peer, every "
        "request signed, as atoll local and atoll join run) or development (no "
        "manifest: no admission, requests still signed by each peer's key)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run hivemind in processes of its own, apart from Atoll's and raw's, so no "
        "system's idle processes take CPU from another's rounds (--no-isolate: every "
        "peer process hosts every system, as before 2026-12-02)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=2,
        help="with --isolate: alternate the two sets of processes this many times, "
        "splitting --repeats among them (each block starts afresh and warms up)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="Atoll fragments (= tensors of the model, for every system); 0: one per peer, so "
        "that every peer owns one, as ring all-reduce's reduce-scatter gives each its shard "
        "(8 until 2026-12-05: 3.65 against 3.83 at 4 x 50M, docs/benchmarks.md)",
    )
    parser.add_argument(
        "--owner-fanout",
        type=int,
        default=1,
        help="Atoll's owner_fanout (the learners an owner uploads each version to itself; the "
        "rest fetch it from a holder): 1, Atoll's default; peers - 1 sends every version "
        "straight from its owner, as raw's owners answer every peer",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one round may take")
    parser.add_argument(
        "--kill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the kill test (codec none only)",
    )
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="kill this fraction into a normal round"
    )
    parser.add_argument(
        "--memory-detail",
        action="store_true",
        help="also report the MiB each peer holds in tensors and buffers (slow)",
    )
    parser.add_argument(
        "--memory-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip a case whose estimated peak (memory_needed_mb) leaves the machine under "
        f"{HEADROOM_MB} MiB (--no-memory-guard: run it anyway, to measure a new size's peak)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="peer logs (default: a temporary folder)"
    )
    parser.add_argument(
        "--json", action="store_true", help="accepted for symmetry: the JSON is always printed last"
    )
    args = parser.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if any(c not in CODECS for c in args.codecs):
        parser.error(f"--codecs takes {', '.join(CODECS)}")
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    if args.fragments < 0:
        parser.error("--fragments must be >= 1, or 0 for one per peer")
    if args.blocks < 1:
        parser.error("--blocks must be >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "atoll" not in systems and "raw" in systems:
        parser.error("raw follows Atoll's fragment owners: --systems must include atoll")
    hivemind_reason = hivemind_missing() if "hivemind" in systems else "not run (--systems)"
    if "hivemind" in systems and hivemind_reason is not None:
        _say(f"hivemind is not run: {hivemind_reason}")
        systems.remove("hivemind")
    with tempfile.TemporaryDirectory(prefix="bench-averaging-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        cases = [
            run_case(args, *parse_case(c), systems, log_dir, hivemind_reason)
            for c in args.cases.split(",")
            if c.strip()
        ]
    out = {
        "bench": "averaging",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, python {platform.python_version()}",
        "config": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "swarm": args.swarm,
            "isolate": args.isolate,
            "blocks": args.blocks,
            "fragments": args.fragments,
            "owner_fanout": args.owner_fanout,
            "codecs": args.codecs,
            "kill_at": args.kill_at,
            "seed": args.seed,
            "memory_guard": args.memory_guard,
        },
        "cases": cases,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
