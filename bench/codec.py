"""Throughput of the wire path for one large tensor, against a plain memory copy.

For each codec (none, bf16, int8, int4, topk2) this measures, on one fp32 tensor:

``send``  compress + encode + seal (sha256 over the parts, Ed25519) + iterate the sealed chunks
          into a reused 1 MiB buffer, as a sender writing to a socket would;
``recv``  open_sealed (envelope, signature, sha256, replay window, decode) + decompress into a
          preallocated fp32 tensor, from the received bytes in one buffer;

and, in the same run, ``copy``: ``dst.copy_(src)`` of the same fp32 bytes into a preallocated
``dst``. Throughputs are GB/s of the fp32 input bytes (1 GB = 1e9 B), the best of ``--repeats``
runs; ratios are ``codec / copy`` (1.0 means as fast as a memcpy). ``compression`` is fp32 bytes
over sealed wire bytes.

Run from the repository root::

    python -m bench.codec --json              # 100M parameters (400 MB fp32)
    python -m bench.codec --json --numel 1000000

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from protocol.diloco.compression import compress, decompress
from protocol.wire.codec import encode
from protocol.wire.messages import Contribution
from protocol.wire.signing import ReplayWindow, Signer, open_sealed, seal
from protocol.wire.tensors import CODECS

CHUNK = 1 << 20
NOW = 1_700_000_000.0


@dataclass(frozen=True)
class Config:
    """What to measure (mirrored by the command line)."""

    numel: int = 100_000_000  # elements of the fp32 tensor
    block_size: int = 64  # int8/int4 absmax block
    repeats: int = 2  # best of this many timed runs per measurement
    threads: int = 2  # torch.set_num_threads
    json: bool = False  # print one JSON object as the last stdout line


def best_of(repeats: int, fn: Callable[[int], object]) -> tuple[float, int]:
    """The fastest of ``repeats`` timed calls of ``fn(run_index)``: (seconds, run index)."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    best = min(range(repeats), key=times.__getitem__)
    return times[best], best


class Stages:
    """Per-run stage timings: ``mark(name)`` closes the stage that started at the last mark."""

    def __init__(self) -> None:
        self.runs: list[dict[str, float]] = []
        self._last = 0.0

    def start(self) -> None:
        self.runs.append({})
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.runs[-1][name] = now - self._last
        self._last = now


def bench_codec(cfg: Config, codec: str, t: torch.Tensor, signer: Signer) -> dict[str, Any]:
    """Send and receive timings of one codec (see the module docstring)."""
    sink = bytearray(CHUNK)
    sink_view = memoryview(sink)
    wire_holder: list[bytearray] = []

    send_stages, recv_stages = Stages(), Stages()

    def send(run: int) -> None:
        send_stages.start()
        enc, _residual = compress(t, codec, block_size=cfg.block_size)
        send_stages.mark("compress")
        msg = Contribution(
            swarm="bench",
            fragment=0,
            base_version=0,
            base_digest=bytes(32),
            tokens=1,
            steps=1,
            step_time=0.1,
            sender_step=run,
            tensors=(enc,),
        )
        encoded = encode(msg)
        send_stages.mark("encode")
        sealed = seal(encoded, signer, now=NOW, nonce=run.to_bytes(16, "big"))
        send_stages.mark("seal")
        for chunk in sealed.iter_chunks(CHUNK):
            sink_view[: chunk.nbytes] = chunk
        send_stages.mark("chunks")
        if run == 0:
            wire_holder.append(bytearray(sealed.tobytes()))

    send_s, send_best = best_of(cfg.repeats, send)
    wire = wire_holder[0]
    out = torch.empty_like(t)

    def recv(run: int) -> None:
        recv_stages.start()
        replay = ReplayWindow()  # fresh each run: the same wire is opened again
        opened = open_sealed(wire, now=NOW, replay=replay, max_size=len(wire))
        recv_stages.mark("open")
        assert isinstance(opened.message, Contribution)
        decompress(opened.message.tensors[0], out=out)
        recv_stages.mark("decompress")

    recv_s, recv_best = best_of(cfg.repeats, recv)
    if codec == "none" and not torch.equal(out, t):
        raise AssertionError("codec 'none' did not round-trip exactly")
    gb = t.numel() * 4 / 1e9
    return {
        "send_s": send_s,
        "recv_s": recv_s,
        "send_gbps": gb / send_s,
        "recv_gbps": gb / recv_s,
        "wire_bytes": len(wire),
        "compression": t.numel() * 4 / len(wire),
        "stages_s": {
            **{f"send_{k}": v for k, v in send_stages.runs[send_best].items()},
            **{f"recv_{k}": v for k, v in recv_stages.runs[recv_best].items()},
        },
    }


def run(cfg: Config) -> dict[str, object]:
    """All measurements as one JSON-ready dict."""
    torch.set_num_threads(cfg.threads)
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(cfg.numel, generator=gen, dtype=torch.float32)
    dst = torch.empty_like(t)
    copy_s, _ = best_of(max(cfg.repeats, 3), lambda _: dst.copy_(t))
    gb = cfg.numel * 4 / 1e9
    copy_gbps = gb / copy_s
    print(f"copy      {copy_gbps:7.2f} GB/s  ({gb:.2f} GB fp32)", file=sys.stderr)
    signer = Signer.from_seed(bytes(32))
    codecs: dict[str, dict[str, Any]] = {}
    for codec in CODECS:
        r = bench_codec(cfg, codec, t, signer)
        r["send_vs_copy"] = r["send_gbps"] / copy_gbps
        r["recv_vs_copy"] = r["recv_gbps"] / copy_gbps
        codecs[codec] = r
        print(
            f"{codec:<5} send {r['send_gbps']:6.2f} GB/s ({r['send_vs_copy']:.2f}x copy)  "
            f"recv {r['recv_gbps']:6.2f} GB/s ({r['recv_vs_copy']:.2f}x copy)  "
            f"compression {r['compression']:.2f}x",
            file=sys.stderr,
        )
        stages = "  ".join(f"{k} {v:.3f}s" for k, v in r["stages_s"].items())
        print(f"      stages: {stages}", file=sys.stderr)
    return {
        "bench": "codec",
        "numel": cfg.numel,
        "fp32_bytes": cfg.numel * 4,
        "block_size": cfg.block_size,
        "repeats": cfg.repeats,
        "threads": cfg.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "copy_s": copy_s,
        "copy_gbps": copy_gbps,
        "codecs": codecs,
    }


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=d.numel, help="elements of the fp32 tensor")
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="int8/int4 block size; topk2: elements per value sent",
    )
    p.add_argument("--repeats", type=int, default=d.repeats, help="best of this many runs")
    p.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print one JSON object last on stdout")
    a = p.parse_args(argv)
    return Config(a.numel, a.block_size, max(1, a.repeats), a.threads, a.json)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    result = run(cfg)
    if cfg.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
