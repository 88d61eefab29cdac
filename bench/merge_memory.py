"""An owner's merge at 124M-parameter fragment sizes: the memory it takes beside what it holds,
with contributions decoded whole on arrival (as owners did) against kept compressed and decoded
a slice at a time inside the merge (``protocol.diloco.sliced``).

    python -m bench.merge_memory [--contributors 4 6 8] [--fragment embeddings] [--codec int4]

Per (contributors, way) a fresh subprocess builds the fragment's state (Θ, momentum) and n
compressed contributions (random valid codes and block scales: the bytes an owner receives),
resets its peak resident size (``/proc/self/clear_refs``), then takes the contributions in
(decoding each whole, or measuring its norm slice by slice) and runs the outer step and the
agreement's Gram matrix over them (``merge_update``, ``gram``/``GramSum``). Reported: the peak
resident bytes above the state held before the round (``extra_mb``, VmHWM - VmRSS), in
multiples of the fragment's fp32 bytes, and the seconds of intake and merge. Both ways' new
state and Gram matrix are hashed: ``identical`` says they match bit for bit. JSON last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

FRAGMENTS: dict[
    str, list[tuple[int, ...]]
] = {  # GPT-2 small's largest fragment (the embeddings) and a block fragment's size
    "embeddings": [(50257, 768), (1024, 768)],
    "block": [(28_350_000,)],
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _contributions(shapes: list[tuple[int, ...]], codec: str, n: int, block: int) -> list[list]:
    from protocol.wire.tensors import EncodedTensor

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        tensors = []
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            nbytes = {"int4": (numel + 1) // 2, "int8": numel, "none": 4 * numel}[codec]
            if codec == "none":
                data = (torch.randn(numel, generator=g) * 1e-4).numpy().tobytes()
                scales = b""
            else:
                codes = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
                if codec == "int8":
                    codes = codes.view(torch.int8).clamp_(-127, 127).view(torch.uint8)
                data = codes.numpy().tobytes()
                blocks = -(-numel // block)
                scales = (torch.rand(blocks, generator=g) * 1e-5 * (1 + i % 3)).numpy().tobytes()
            tensors.append(
                EncodedTensor(
                    codec=codec,
                    shape=shape,
                    dtype="float32",
                    block_size=0 if codec == "none" else block,
                    data=data,
                    scales=scales,
                )
            )
        out.append(tensors)
    return out


def run_one(way: str, n: int, fragment: str, codec: str, block: int) -> dict[str, object]:
    """One round in this process: ``way`` "whole" (decoded on arrival) or "sliced"."""
    from protocol.diloco.agreement import GramSum, gram
    from protocol.diloco.norms import norm64
    from protocol.diloco.outer import OuterConfig, merge_update
    from protocol.diloco.sliced import EncodedVector, norm_of
    from protocol.diloco.updates import decode_flat

    torch.manual_seed(0)
    shapes = FRAGMENTS[fragment]
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    theta = torch.randn(numel) * 0.02
    buffer = torch.randn(numel) * 1e-4
    received = _contributions(shapes, codec, n, block)
    weights = [1.0 + 0.25 * i for i in range(n)]
    clips = [0.7 if i == 1 else 1.0 for i in range(n)]
    cfg = OuterConfig(aggregate="rda")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    base_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if way == "whole":
        deltas: list = [decode_flat(t, shapes) for t in received]
        norms = [norm64(d) for d in deltas]
    else:
        deltas = [EncodedVector(t, shapes) for t in received]
        norms = [norm_of(d) for d in deltas]
    t1 = time.perf_counter()
    # the old way sums the Gram matrix in a second pass; the sliced one watches the merge's
    sums = GramSum([numel] * n, norms=norms) if way == "sliced" else None
    update = merge_update(
        theta,
        buffer,
        deltas,
        weights,
        clips,
        cfg,
        embedding=fragment == "embeddings",
        norms=norms,
        observe=sums.add if sums is not None else None,
    )
    products = sums.matrix() if sums is not None else gram(deltas, norms=norms)
    t2 = time.perf_counter()
    peak_kb = _status_kb("VmHWM")
    digest = hashlib.blake2b(update.theta.numpy().tobytes(), digest_size=16)
    assert update.buffer is not None
    digest.update(update.buffer.numpy().tobytes())
    digest.update(json.dumps(products).encode())
    fp32_mb = 4 * numel / 2**20
    extra_mb = (peak_kb - base_kb) / 1024
    return {
        "way": way,
        "contributors": n,
        "fragment_fp32_mb": round(fp32_mb, 1),
        "extra_mb": round(extra_mb, 1),
        "extra_x_fragment": round(extra_mb / fp32_mb, 2),
        "intake_s": round(t1 - t0, 2),
        "merge_s": round(t2 - t1, 2),
        "digest": digest.hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contributors", type=int, nargs="+", default=[4, 6, 8])
    parser.add_argument("--fragment", choices=sorted(FRAGMENTS), default="embeddings")
    parser.add_argument("--codec", choices=["int4", "int8", "none"], default="int4")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--one", nargs=2, metavar=("WAY", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        way, n = args.one
        print(json.dumps(run_one(way, int(n), args.fragment, args.codec, args.block)))
        return
    rows = []
    load = [os.getloadavg()[0]]
    for n in args.contributors:
        for way in ("whole", "sliced"):
            cmd = [sys.executable, "-m", "bench.merge_memory", "--one", way, str(n)]
            cmd += ["--fragment", args.fragment, "--codec", args.codec, "--block", str(args.block)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
            load.append(os.getloadavg()[0])
    summary = []
    for n in args.contributors:
        whole, sliced = (
            next(r for r in rows if r["contributors"] == n and r["way"] == w)
            for w in ("whole", "sliced")
        )
        summary.append(
            {
                "contributors": n,
                "extra_x_fragment_whole": whole["extra_x_fragment"],
                "extra_x_fragment_sliced": sliced["extra_x_fragment"],
                "extra_ratio_sliced_over_whole": round(
                    float(sliced["extra_mb"]) / max(float(whole["extra_mb"]), 1e-9), 3
                ),
                "time_ratio_sliced_over_whole": round(
                    (float(sliced["intake_s"]) + float(sliced["merge_s"]))
                    / (float(whole["intake_s"]) + float(whole["merge_s"])),
                    2,
                ),
                "identical": whole["digest"] == sliced["digest"],
            }
        )
    print(
        json.dumps(
            {
                "fragment": args.fragment,
                "codec": args.codec,
                "threads": torch.get_num_threads(),
                "load_average": [round(x, 1) for x in load],
                "rows": rows,
                "summary": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
