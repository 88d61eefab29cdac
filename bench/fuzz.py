"""Fuzz every decoder of peer bytes for a while: random inputs and mutations of valid encodings.

The targets (``bench.fuzz_targets.targets()``; mutators in ``bench.fuzz_mutators``) are the codec, envelopes and sealed messages
(whole and streamed), bodies sealed by an authenticated peer, tensor decompression and fragment
flattening, DHT records, member records, chunk manifests, the HTTP header parsers of state sync
and the bootstrap dial-back, and the swarm manifest (TOML), certificates and ``Atoll-Auth``
header of certified swarms. Each gets an equal share of ``--seconds``. An input is one of:
random bytes (10%), one to eight byte-level edits of a valid seed (flips, interesting bytes and
u32 lengths, cuts, inserts, deletes, splices; 60%), or, where a target has msgpack trees, a
valid tree with one node replaced by a random value of any type, deleted or given a sibling
(30%). A target fails on any exception other than a ``RemoteProtocolError``, or on a result
that breaks its invariant.

Run from the repository root::

    python -m bench.fuzz                      # 300 s over all targets
    python -m bench.fuzz --seconds 60 --seed 1

One progress line per target goes to stderr; the last line of stdout is one JSON object
``{"targets": {name: {"inputs", "failures", "first_failure", "slowest_ms"}}, "seconds", "seed"}``.
Exit status 1 if any target failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from bench.fuzz_mutators import count_nodes, mutate_bytes, mutate_tree, random_value
from bench.fuzz_targets import Target, attempt, targets

__all__ = ["fuzz_input", "fuzz_target", "main"]

_TREE_OPS = ("replace", "replace", "delete", "insert")


def fuzz_input(target: Target, rng: random.Random) -> bytes:
    """One hostile input for ``target``, drawn with ``rng``."""
    roll = rng.random()
    if roll < 0.1:
        return rng.randbytes(rng.choice((0, 1, 4, 9, 32, 300, 5000)))
    if roll < 0.7 or target.build is None:
        return mutate_bytes(rng.choice(target.seeds), rng, target.seeds)
    tree = rng.choice(target.trees)
    for _ in range(rng.choice((1, 1, 2, 4))):
        index = rng.randrange(count_nodes(tree))
        tree = mutate_tree(tree, index, rng.choice(_TREE_OPS), random_value(rng))
    return target.build(tree)


def fuzz_target(target: Target, seconds: float, rng: random.Random) -> dict[str, Any]:
    """Feed ``target`` hostile inputs for ``seconds``; count inputs and failures."""
    inputs = failures = 0
    first: str | None = None
    slowest = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        data = fuzz_input(target, rng)
        start = time.perf_counter()
        failure = attempt(target, data)
        end = time.perf_counter()
        slowest = max(slowest, end - start)
        inputs += 1
        if failure is not None:
            failures += 1
            first = first or failure
        if end >= deadline:
            break
    return {
        "inputs": inputs,
        "failures": failures,
        "first_failure": first,
        "slowest_ms": round(slowest * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    p.add_argument(
        "--seconds", type=float, default=300.0, help="total run time, split over targets"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    a = p.parse_args(argv)
    start = time.perf_counter()
    all_targets = targets()
    share = max(a.seconds - (time.perf_counter() - start), 0.0) / len(all_targets)
    results: dict[str, dict[str, Any]] = {}
    for i, target in enumerate(all_targets):
        r = fuzz_target(target, share, random.Random(f"{a.seed}/{target.name}"))
        results[target.name] = r
        verdict = "ok" if not r["failures"] else f"FAILED {r['failures']}x: {r['first_failure']}"
        print(
            f"[{i + 1}/{len(all_targets)}] {target.name}: {r['inputs']} inputs, "
            f"slowest {r['slowest_ms']} ms, {verdict}",
            file=sys.stderr,
            flush=True,
        )
    seconds = round(time.perf_counter() - start, 1)
    print(json.dumps({"targets": results, "seconds": seconds, "seed": a.seed}))
    return 1 if any(r["failures"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
