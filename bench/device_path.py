"""Did the device path slow the CPU path? One fragment round on the CPU, new code over old.

A round of one fragment, as an island on the CPU runs it: the pseudo-gradient Δ = Θ − θ
(``Island._pseudo_gradient``), its int8 encoding with error feedback into a contribution
(``ContributionSender._encode``, which ``_compress`` calls on the CPU), and the rebase
adoption of a new version (``Island._adopt``'s ``DeviceLink.arrive`` and ``Adoption.rebase``).
The baseline is the same round written as the code was before the device path (Δ into a ``new_flat`` vector from ``.cpu()`` copies, ``compress`` tensor by tensor, a rebase
that checks each parameter's kept work as it goes), timed in the same process, interleaved with
the new code, on the same tensors. Timed as this thread's CPU time (one torch thread: all the
work is on it), so that other processes taking the cores do not count. Goal: ratio (new ÷ old)
<= 1.02, for the median over rounds of new ÷ old within a round (the two run back to back, in
alternating order).

    python -m bench.device_path [--model medium --fragments 4 --rounds 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from node.diloco.flat import new_flat
from node.diloco.island import Island, IslandConfig, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.workload.model import GPT, GPTConfig
from protocol.diloco.compression import compress
from protocol.diloco.fragments import plan_fragments
from protocol.diloco.norms import all_finite
from protocol.errors import LocalProtocolError
from protocol.wire.signing import Signer


def _old_pseudo_gradient(params: list[torch.nn.Parameter], base: torch.Tensor) -> torch.Tensor:
    out = new_flat(base.numel())
    offset = 0
    with torch.no_grad():
        for param in params:
            n = param.numel()
            torch.sub(
                base[offset : offset + n],
                param.detach().reshape(-1).float().cpu(),
                out=out[offset : offset + n],
            )
            offset += n
    return out


def _old_encode(
    fragment: int,
    delta: torch.Tensor,
    shapes: list[tuple[int, ...]],
    kept: dict[tuple[int, int], torch.Tensor],
) -> tuple[list[Any], dict[tuple[int, int], torch.Tensor]]:
    """The encoding loop of ``ContributionSender._compress`` as it was."""
    tensors, residuals, offset = [], {}, 0
    for i, shape in enumerate(shapes):
        n = int(torch.Size(shape).numel())
        part = delta[offset : offset + n].view(shape)
        try:
            enc, residual = compress(
                part, "int8", block_size=64, residual=kept.get((fragment, i)), copy=False
            )
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"fragment {fragment}: not finite ({exc})") from exc
        residuals[(fragment, i)] = residual
        tensors.append(enc)
        offset += n
    return tensors, residuals


def _old_rebase(
    params: list[torch.nn.Parameter], flat: torch.Tensor, reference: torch.Tensor
) -> bool:
    with torch.no_grad():
        kept, offset = [], 0
        for param in params:
            n = param.numel()
            work = param.detach().reshape(-1).float().cpu() - reference[offset : offset + n]
            if not all_finite(work):
                return False
            kept.append(work)
            offset += n
        offset = 0
        for param, work in zip(params, kept, strict=True):
            n = param.numel()
            param.copy_(work.add_(flat[offset : offset + n]).view_as(param))
            offset += n
    return True


def _new_round(island: Island, net: IslandNet, p: int, r: int, version: torch.Tensor) -> None:
    delta = island._pseudo_gradient(p)
    out = Outgoing(
        fragment=p, base_version=0, tokens=1, steps=1, step_time=0.0, sender_step=r, delta=delta
    )
    _tensors, residuals = net.sender._encode(out)
    net.sender.residuals.update(residuals)  # error feedback, as an accepted send
    # the adoption's tensor work (its scalar book-keeping in ``_adopt`` is unchanged)
    flat = island.device_link.arrive(island.device_link.to_device(version, ("in", p)))
    island._adoption.rebase(p, flat, island._base(p))


def _old_round(
    params: list[torch.nn.Parameter],
    base: torch.Tensor,
    shapes: list[tuple[int, ...]],
    p: int,
    kept: dict[tuple[int, int], torch.Tensor],
    version: torch.Tensor,
) -> None:
    delta = _old_pseudo_gradient(params, base)
    _tensors, residuals = _old_encode(p, delta, shapes, kept)
    kept.update(residuals)
    _old_rebase(params, version, base)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="medium")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = GPT(GPTConfig.preset(args.model), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_fragments(shapes, args.fragments)
    island = Island(model, opt, plan, lambda _o: None, IslandConfig(inner_steps=10**6))
    named = dict(model.named_parameters())
    frag_shapes = [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]
    net = IslandNet(
        island,
        LearnerNetConfig(swarm="bench", shapes=frag_shapes, codec="int8"),
        # nothing is sent: no transport
        OwnerLinks(Signer.from_seed(bytes(32)), Reach(None, owner_of=lambda _p: None)),  # type: ignore[arg-type]
    )
    p = max(range(len(plan.fragments)), key=lambda i: island.global_flat[i].numel())
    params, g = island.params[p], torch.Generator().manual_seed(0)
    old_residuals: dict[tuple[int, int], torch.Tensor] = {}
    times: dict[str, list[float]] = {"new": [], "old": []}
    for r in range(args.rounds):
        with torch.no_grad():  # a step's worth of change, then a version a little off the base
            for t in params:
                t.add_(torch.randn(t.shape, generator=g), alpha=1e-3)
        version = island.global_flat[p] + 1e-4 * torch.randn(
            island.global_flat[p].shape, generator=g
        )
        for which in ("new", "old") if r % 2 == 0 else ("old", "new"):
            snapshot = [t.detach().clone() for t in params]
            t0 = time.thread_time()
            # in a function each: what a round makes is freed when it returns, as in a run
            if which == "new":
                _new_round(island, net, p, r, version)
            else:
                _old_round(params, island.global_flat[p], frag_shapes[p], p, old_residuals, version)
            times[which].append(time.thread_time() - t0)
            with torch.no_grad():  # both start each round from the same parameters
                for t, s in zip(params, snapshot, strict=True):
                    t.copy_(s)
    new, old = statistics.median(times["new"]), statistics.median(times["old"])
    out_json: dict[str, Any] = {
        "benchmark": "device_path",
        "config": {
            "model": args.model,
            "fragment_numel": island.global_flat[p].numel(),
            "n_params": sum(t.numel() for t in model.parameters()),
            "rounds": args.rounds,
            "threads": args.threads,
            "codec": "int8",
        },
        "median_round_cpu_s_new": round(new, 5),
        "median_round_cpu_s_old": round(old, 5),
        "ratio_new_over_old": round(new / old, 4),
        "median_paired_ratio": round(
            statistics.median(a / b for a, b in zip(times["new"], times["old"], strict=True)), 4
        ),
        "min_round_cpu_s_new": round(min(times["new"]), 5),
        "min_round_cpu_s_old": round(min(times["old"]), 5),
        "ratio_of_minima": round(min(times["new"]) / min(times["old"]), 4),
        "goal": 1.02,
    }
    print(json.dumps(out_json, indent=2))
    return out_json


if __name__ == "__main__":
    main()
