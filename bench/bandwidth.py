"""Bytes on the wire per trained token, per codec and sync interval H, against ring all-reduce.

    python -m bench.bandwidth [--full] [--h 10,100] [--codecs none,int8,int4,topk2] [--peers 3]
                              [--steps 300] [--model tiny] [--tau 2] [--topk-block 64] [--no-baseline]

The default grid (H = 10 and 100, four codecs, 300 steps: 8 runs) took 7 minutes on a loaded
2-core machine; ``--full`` runs H = 10, 30, 100, 300 for 600 steps (16 runs, 18 minutes there),
so that even at H = 300 every fragment is due more than once.

Runs ``atoll local`` once per (H, codec) with everything else equal (same seed, peers, model,
steps, so equal tokens) and reads each run's report and its owners' event logs:

``up``     pseudo-gradient uploads: every contribution the owners logged as it arrived (the
           encoded message, plus its signed envelope), summed per sender;
``down``   everything else the peers sent: owners handing out global fragments (``--download-codec``,
           fp32 by default; with a codec ``UP/DOWN``, e.g. ``int8/int4``, versions go down as
           DOWN-compressed updates over the version before, ``--update-codec``), replica handoffs, state sync at join, DHT and membership traffic. Every byte is counted
           once, by the peer that sent it (``bytes_sent`` of each peer's transport, request and
           reply bodies), including a learner's contributions to a fragment it owns (loopback);
``ddp``    what ring all-reduce data-parallel would send for the same steps: each of the N
           workers sends 2(N-1)/N x params x 4 bytes (fp32) or 2 bytes (bf16) every step.

All per trained token (the report's ``tokens_trained``, summed over islands). Link rates: a
learner hides a sync behind tau steps of compute when its contribution goes up, and the new
version of that fragment comes down, within ``tau x t_step`` each: ``up`` is the mean logged
contribution, ``down`` one version of a fragment as an owner publishes it (``encode_flat`` with
the run's download codec into a sealed ``FragmentState``, or the update codec into a sealed
``FragmentUpdate``, for the fragment shapes in the owners'
logs, averaged over fragments). Data-parallel hides one step's all-reduce behind one ``t_step``.
``t_step`` is the median over the grid's runs of each run's median inner-step time (peers sharing
the machine's cores), one value for every row, so rates are for this model on this machine;
their ratios carry over.
``eval_loss`` is the global model's final eval loss (nats per byte); the first run also trains
synchronous data-parallel at equal tokens (``--baseline``) for reference.

Progress goes to stderr, a markdown table to stdout, and one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from node.diloco.eventlog import payload_dir
from node.diloco.flat import content_hash, encode_flat
from node.run.report import ddp_bytes
from protocol.diloco.updates import encode_update
from protocol.wire.codec import Encoded, encode
from protocol.wire.messages import FragmentState, FragmentUpdate
from protocol.wire.signing import Signer, seal

CODECS = ("none", "int8", "int4", "topk2")
FULL_H, FULL_STEPS = (10, 30, 100, 300), 600
_SIGNER = Signer.from_seed(bytes(32))  # sizes only: an envelope's length does not depend on the key


@dataclass(frozen=True)
class Config:
    h: tuple[int, ...] = (10, 100)  # inner steps between two syncs of a fragment
    codecs: tuple[str, ...] = CODECS
    peers: int = 3
    steps: int = 300  # inner steps per island
    model: str = "tiny"
    fragments: int = 4
    tau: int = 2  # steps a fragment may stay in flight (--grace-tau)
    block_size: int = 64  # int8/int4 absmax block
    topk_block: int = 64  # topk2: elements per value sent (density 1/64)
    corpus_max_bytes: int = 2_000_000
    seed: int = 0
    baseline: bool = True
    timeout_s: float = 900.0
    keep: str = ""  # a folder to keep every run's report and logs in ("": a temporary one)
    reuse: bool = False  # read a run's report from ``keep`` when it is there instead of running it


# ---------------------------------------------------------------- one run


def split_codec(spec: str) -> tuple[str, str]:
    """``"int8"`` -> ("int8", "none"): pseudo-gradients up in int8, full fp32 versions down;
    ``"int8/int4"`` -> ("int8", "int4"): versions down as int4 updates (``--update-codec``)."""
    up, _, down = spec.partition("/")
    return up, down or "none"


def run_one(cfg: Config, h: int, codec: str, workdir: Path, *, baseline: bool) -> dict[str, Any]:
    """Run one local swarm (or, with ``reuse``, read its kept report); return its report.
    ``codec``: the upload codec, or ``UP/DOWN`` with the update codec of downloads.

    Raises RuntimeError if the run failed or a kept report was made with another config."""
    up, down = split_codec(codec)
    block = cfg.topk_block if "topk2" in (up, down) else cfg.block_size
    name = codec.replace("/", "-")
    report = (
        workdir / f"h{h}-{name}-b{block}-s{cfg.steps}-p{cfg.peers}-{cfg.model}-seed{cfg.seed}.json"
    )
    if cfg.reuse and report.exists():
        return checked(json.loads(report.read_text()), cfg, h, codec, block)
    cmd = [
        sys.executable,
        "-m",
        "node",
        "local",
        "--quiet",
        "--report",
        str(report),
        "--model",
        cfg.model,
        "--peers",
        str(cfg.peers),
        "--steps",
        str(cfg.steps),
        "--fragments",
        str(cfg.fragments),
        "--inner-steps",
        str(h),
        "--codec",
        up,
        "--update-codec",
        down,
        "--block-size",
        str(block),
        "--grace-tau",
        str(cfg.tau),
        "--seed",
        str(cfg.seed),
        "--corpus-max-bytes",
        str(cfg.corpus_max_bytes),
        "--eval-every",
        str(cfg.steps),
    ]
    if baseline:
        cmd.append("--baseline")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"H={h} codec={codec} failed:\n{proc.stderr[-3000:]}")
    return checked(json.loads(report.read_text()), cfg, h, codec, block)


def checked(report: dict[str, Any], cfg: Config, h: int, codec: str, block: int) -> dict[str, Any]:
    """``report`` if its run had this config; raises RuntimeError otherwise."""
    up, down = split_codec(codec)
    want = {
        "inner_steps": h,
        "codec": up,
        "update_codec": down,
        "block_size": block,
        "steps": cfg.steps,
        "peers": cfg.peers,
        "model": cfg.model,
        "seed": cfg.seed,
        "fragments": cfg.fragments,
        "grace_tau": cfg.tau,
    }
    got = {k: report["config"].get(k, "none" if k == "update_codec" else None) for k in want}
    if got != want:
        raise RuntimeError(f"report of H={h} {codec} was made with {got}, not {want}")
    return report


def uploads(report: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per sender (peer id hex): (bytes, count) of the contributions the owners logged."""
    out: dict[str, tuple[int, int]] = {}
    sizes: dict[Path, int] = {}
    for log in map(Path, report["event_logs"]):
        payloads = payload_dir(log)
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "contribution":
                continue
            if rec.get("payload") is None:
                raise RuntimeError(
                    f"{log}: a contribution's payload was not kept; cannot count its bytes"
                )
            path = payloads / rec["payload"]
            if path not in sizes:
                sizes[path] = sealed_size(path.read_bytes())
            total, count = out.get(rec["peer"], (0, 0))
            out[rec["peer"]] = (total + sizes[path], count + 1)
    return out


def sealed_size(message: bytes) -> int:
    """Bytes of ``message`` on the wire once sealed (length prefix, signed envelope, message)."""
    encoded = Encoded(parts=[memoryview(message)], size=len(message))
    return seal(encoded, _SIGNER, now=time.time(), nonce=bytes(16), recipient=bytes(32)).size


# ---------------------------------------------------------------- one row


def version_sizes(report: dict[str, Any]) -> dict[int, int]:
    """Per fragment: sealed bytes of one version as its owner publishes it to learners holding
    the version before, from the shapes and download codec in the owners' logs: the full state,
    or the update with ``--update-codec`` (an all-zero state: the codecs' sizes do not depend on
    the values)."""
    sizes: dict[int, int] = {}
    for log in map(Path, report["event_logs"]):
        start = json.loads(log.read_text().split("\n", 1)[0])
        p, content = int(start["fragment"]), start.get("content")
        if p in sizes or content is None:
            continue
        shapes = [tuple(s) for s in content["shapes"]]
        zeros = torch.zeros(sum(int(torch.Size(s).numel()) for s in shapes))
        msg: FragmentState | FragmentUpdate
        if content.get("update_codec"):
            tensors, _, _ = encode_update(
                zeros,
                zeros,
                None,
                shapes,
                content["update_codec"],
                block_size=int(content.get("block_size", 64)),
            )
            msg = FragmentUpdate(
                swarm=report["config"]["swarm"],
                fragment=p,
                version=2,
                base_version=1,
                base_digest=bytes(32),
                state_digest=bytes(32),
                tensors=tuple(tensors),
            )
        else:
            tensors = encode_flat(zeros, shapes, content["codec"])
            msg = FragmentState(
                swarm=report["config"]["swarm"],
                fragment=p,
                version=1,
                tensors=tuple(tensors),
                content_hash=content_hash(tensors),
            )
        sizes[p] = seal(encode(msg), _SIGNER, now=time.time(), nonce=bytes(16)).size
    return sizes


def measure(h: int, codec: str, report: dict[str, Any]) -> dict[str, Any]:
    """The row of the table for one run."""
    ups = uploads(report)
    tokens, total = int(report["tokens_trained"]), int(report["bytes_sent"])
    up = sum(b for b, _ in ups.values())
    syncs = sum(n for _, n in ups.values())
    ddp32 = ddp_bytes(int(report["n_params"]), int(report["peers"]), int(report["steps"]), 4)
    return {
        "h": h,
        "codec": codec,
        "tokens": tokens,
        "contributions": syncs,
        "up_bytes": up,
        "down_bytes": total - up,
        "bytes": total,
        "ddp_fp32_bytes": ddp32,
        "up_per_token": up / tokens,
        "down_per_token": (total - up) / tokens,
        "per_token": total / tokens,
        "ddp_fp32_per_token": ddp32 / tokens,
        "ddp_bf16_per_token": ddp32 / 2 / tokens,
        "vs_ddp_fp32": ddp32 / total,
        "vs_ddp_bf16": ddp32 / 2 / total,
        "t_step_run_s": statistics.median(float(p["median_step_s"]) for p in report["per_peer"]),
        "up_message_bytes": up / max(syncs, 1),
        "down_message_bytes": mean(version_sizes(report).values()),
        "n_params": int(report["n_params"]),
        "peers": int(report["peers"]),
        "eval_loss": float(report["eval_loss"]["end"]),
        "hashes_agree": bool(report["hashes_agree"]),
        "wall_s": float(report["wall_s"]),
    }


def mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def rates(row: dict[str, Any], tau: int, t_step: float) -> dict[str, float]:
    """Link rates (Mbit/s) that move one contribution up, and one version down, within ``tau``
    steps of ``t_step`` seconds, and one step's ring all-reduce within one step."""
    n = row["peers"]
    ring_bits = 2 * (n - 1) / n * row["n_params"] * 8  # per step, per byte per element
    return {
        "t_step_s": t_step,
        "rate_up_mbit": row["up_message_bytes"] * 8 / (tau * t_step) / 1e6,
        "rate_down_mbit": row["down_message_bytes"] * 8 / (tau * t_step) / 1e6,
        "rate_ddp_fp32_mbit": 4 * ring_bits / t_step / 1e6,
        "rate_ddp_bf16_mbit": 2 * ring_bits / t_step / 1e6,
    }


# ---------------------------------------------------------------- output


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = (
        "| H | codec | up B/token | down + control B/token | total B/token | fp32 DDP / this | "
        "bf16 DDP / this | up Mbit/s | down Mbit/s | eval loss |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['h']} | {r['codec']} | {r['up_per_token']:.3g} | {r['down_per_token']:.3g} | "
        f"{r['per_token']:.3g} | {r['vs_ddp_fp32']:.0f} | {r['vs_ddp_bf16']:.0f} | "
        f"{r['rate_up_mbit']:.3g} | {r['rate_down_mbit']:.3g} | {r['eval_loss']:.3f} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_args(argv)
    rows: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-bandwidth-") as tmp:
        work = Path(cfg.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for h in cfg.h:
            for codec in cfg.codecs:
                print(
                    f"[{time.monotonic() - t0:6.0f} s] H={h:<4} {codec:<6} running ...",
                    file=sys.stderr,
                    flush=True,
                )
                report = run_one(cfg, h, codec, work, baseline=cfg.baseline and baseline is None)
                baseline = baseline or report.get("baseline")
                rows.append(measure(h, codec, report))
                r = rows[-1]
                print(
                    f"[{time.monotonic() - t0:6.0f} s] H={h:<4} {codec:<6} {r['per_token']:9.3g} B/token "
                    f"(up {r['up_per_token']:.3g}), {r['vs_ddp_fp32']:7.0f}x fewer than fp32 DDP, "
                    f"eval {r['eval_loss']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
    t_step = statistics.median(r["t_step_run_s"] for r in rows)
    for r in rows:
        r.update(rates(r, cfg.tau, t_step))
    first = rows[0] if rows else {}
    print(table(rows))
    print(
        f"\nring all-reduce data-parallel: {first.get('ddp_fp32_per_token', 0):.3g} B/token fp32, "
        f"{first.get('rate_ddp_fp32_mbit', 0):.3g} Mbit/s fp32 and {first.get('rate_ddp_bf16_mbit', 0):.3g} "
        f"bf16 to hide one step's all-reduce behind one step of {t_step * 1e3:.1f} ms"
    )
    out = {
        "bench": "bandwidth",
        "config": {**asdict(cfg), "h": list(cfg.h), "codecs": list(cfg.codecs)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "ddp": {
            k: first.get(k)
            for k in (
                "ddp_fp32_per_token",
                "ddp_bf16_per_token",
                "rate_ddp_fp32_mbit",
                "rate_ddp_bf16_mbit",
            )
        },
        "baseline_eval_loss": baseline["eval_loss_end"] if baseline else None,
        "rows": rows,
        "wall_s": time.monotonic() - t0,
    }
    print(json.dumps(out))
    return out


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m bench.bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--full", action="store_true", help=f"H = {FULL_H}, {FULL_STEPS} steps (unless given)"
    )
    p.add_argument("--h", default=None, help=f"comma-separated H values (default {d.h})")
    p.add_argument(
        "--codecs",
        default=",".join(d.codecs),
        help="comma-separated pseudo-gradient codecs; UP/DOWN (e.g. int8/int4) also sends versions "
        "down as updates in DOWN (--update-codec)",
    )
    p.add_argument("--peers", type=int, default=d.peers, help="islands (processes)")
    p.add_argument(
        "--steps", type=int, default=None, help=f"inner steps per island (default {d.steps})"
    )
    p.add_argument("--model", default=d.model, help="model preset")
    p.add_argument("--fragments", type=int, default=d.fragments, help="P: fragments")
    p.add_argument("--tau", type=int, default=d.tau, help="steps a fragment may stay in flight")
    p.add_argument("--block-size", type=int, default=d.block_size, help="int8/int4 absmax block")
    p.add_argument(
        "--topk-block", type=int, default=d.topk_block, help="topk2: elements per value sent"
    )
    p.add_argument(
        "--corpus-max-bytes", type=int, default=d.corpus_max_bytes, help="corpus bytes to read"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every run")
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the data-parallel reference run"
    )
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="limit per run")
    p.add_argument(
        "--keep", default=d.keep, metavar="DIR", help="keep every run's report and logs here"
    )
    p.add_argument("--reuse", action="store_true", help="with --keep: read the runs already there")
    a = p.parse_args(argv)
    h = tuple(int(x) for x in a.h.split(",")) if a.h else FULL_H if a.full else d.h
    steps = a.steps or (FULL_STEPS if a.full else d.steps)
    if a.reuse and not a.keep:
        p.error("--reuse needs --keep DIR")
    return Config(
        h=h,
        codecs=tuple(a.codecs.split(",")),
        peers=a.peers,
        steps=steps,
        model=a.model,
        fragments=a.fragments,
        tau=a.tau,
        block_size=a.block_size,
        topk_block=a.topk_block,
        corpus_max_bytes=a.corpus_max_bytes,
        seed=a.seed,
        baseline=not a.no_baseline,
        timeout_s=a.timeout_s,
        keep=a.keep,
        reuse=a.reuse,
    )


if __name__ == "__main__":
    main()
