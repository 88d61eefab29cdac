"""Where an averaging round's CPU goes, from ``perf`` samples cut to the bench's timed rounds.

``bench.averaging_profile`` samples Python stacks by wall clock: a thread waiting for the GIL
counts as busy, and native work (BLAKE3, torch kernels, the kernel's copies, page faults) is
seen only at the Python frame that called it. This reads every sample of every peer process
instead, by the native function it was in, and keeps those inside the ``wall`` windows of one
system's timed rounds (the JSON ``bench.averaging`` prints last):

    perf record -k CLOCK_REALTIME -F 499 -g -o perf.data -- \\
        python -m bench.averaging --cases 4x124M --codecs none --systems atoll --no-kill --json > run.json
    python -m bench.averaging_perf perf.data run.json --system atoll --skip 1

``-k CLOCK_REALTIME`` makes the samples' times comparable with the windows (wall-clock seconds).
``--skip N`` leaves out each case's first N timed rounds: the first round after a fresh start
can still fault in the heap's pages (at 4 x 124M, 2026-12-07, nearly all of a run's
``clear_page_erms`` fell in round 1). Prints one line per category: seconds of CPU a round
(samples / frequency / rounds) and the share.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["categorize", "classify", "windows"]

# (category, substrings of the function's name) for the shared objects named below
_TORCH = ("add_kernel", "mul_kernel", "direct_copy", "inner_sum", "fill", "normal")


def classify(symbol: str, library: str) -> str:
    """The category of a sample in ``symbol`` of shared object ``library``."""
    if "blake3" in library:
        return "BLAKE3"
    if "openblas" in library:
        return "BLAS sdot (the agreement's Gram matrix)"
    if "_rust" in library:
        return "Ed25519 and other Rust"
    if "libtorch" in library:
        kernel = next((k for k in _TORCH if k in symbol), "other")
        return f"torch {kernel}"
    if "kallsyms" in library:
        if "copy_to_iter" in symbol or "copy_from_iter" in symbol:
            return "kernel copies (TCP send and receive)"
        if "clear_page" in symbol or "page_fault" in symbol:
            return "kernel page faults (fresh pages)"
        return "kernel other (TCP stack, scheduling)"
    if "libc" in library:
        if "memmove" in symbol or "memcpy" in symbol:
            return "libc memmove (copies in user space)"
        if "memset" in symbol:
            return "libc memset"
        return "libc other"
    if "python" in library:
        return "Python interpreter"
    return "other"


def windows(result: dict, system: str, skip: int = 0) -> list[tuple[float, float]]:
    """The ``wall`` windows of ``system``'s timed rounds in a ``bench.averaging`` result, each
    case's first ``skip`` left out."""
    out: list[tuple[float, float]] = []
    for case in result["cases"]:
        runs = case.get(f"{system}_runs") or []
        out += [(float(r["wall"][0]), float(r["wall"][1])) for r in runs[skip:]]
    return out


def categorize(
    script: Iterable[str], spans: Sequence[tuple[float, float]]
) -> tuple[Counter[str], int]:
    """Samples per category among those of ``perf script -F pid,time,ip,sym,dso`` output
    (``script``: its lines) that fall in one of ``spans``, and how many did."""
    counts: Counter[str] = Counter()
    total, inside, leaf = 0, False, False
    for line in script:
        if not line.strip():
            continue
        # a sample's head: "pid time:", the pid right-aligned (perf pads it with spaces); its
        # frames: a tab, then "ip symbol+off (library)"
        if not line.startswith("\t"):
            time = float(line.split()[1].rstrip(":"))
            inside, leaf = any(a <= time <= b for a, b in spans), True
            continue
        if inside and leaf:  # its innermost frame: "ip symbol+off (library)"
            leaf = False
            rest = line.strip().split(None, 1)[1] if " " in line.strip() else ""
            symbol, _, library = rest.rpartition(" (")
            counts[classify(symbol, library)] += 1
            total += 1
    return counts, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("perf_data", help="perf.data recorded with -k CLOCK_REALTIME")
    parser.add_argument("result", help="the JSON bench.averaging printed (its last line is read)")
    parser.add_argument("--system", default="atoll", help="atoll, hivemind or raw")
    parser.add_argument("--skip", type=int, default=0, help="timed rounds left out per case")
    parser.add_argument("--frequency", type=float, default=499.0, help="perf record's -F")
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    spans = windows(result, args.system, args.skip)
    if not spans:
        raise SystemExit(f"no timed {args.system} rounds in {args.result}")
    script = subprocess.run(
        ["perf", "script", "-i", args.perf_data, "-F", "pid,time,ip,sym,dso", "--ns"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    counts, total = categorize(script, spans)
    rounds = len(spans)
    print(f"{rounds} rounds, {total / rounds / args.frequency:.2f} s of CPU a round in samples")
    for name, n in counts.most_common():
        print(f"{n / rounds / args.frequency:6.2f} s  {100 * n / max(total, 1):5.1f} %  {name}")


if __name__ == "__main__":
    main()
