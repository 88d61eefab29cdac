"""One peer process of ``bench.averaging``: Atoll, hivemind and raw sides, driven over stdin.

``python -m bench.averaging_peer SPEC_JSON``; the launcher writes one JSON command per line on
stdin and reads one JSON reply per line from this process's original stdout (everything else,
including the children hivemind starts, writes to stderr). Commands: ``settle``, ``owners``,
``prepare``, ``go``, ``check``, ``quit`` (see ``Peer.handle``). Sides start in the order
hivemind, raw, Atoll: hivemind forks its processes before any other thread exists here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import torch

from bench.averaging_inputs import Layout, initial
from bench.averaging_profile import from_env
from bench.averaging_threads import ThreadTimes

__all__ = ["Peer", "main"]


class Peer:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.index, self.peers, self.seed = spec["index"], spec["peers"], spec["seed"]
        self.layout = Layout(spec["params"], spec["fragments"])
        self.sides: dict[str, Any] = {}
        self.addresses: dict[str, Any] = {}
        self.sampler = from_env()  # BENCH_PROFILE: where this peer's Atoll rounds go
        codec = spec["codec"]
        if "hivemind" in spec["systems"]:
            from bench.averaging_hivemind import HivemindSide

            hm = HivemindSide(
                index=self.index,
                peers=self.peers,
                seed=self.seed,
                layout=self.layout,
                codec=codec,
                initial_peers=spec.get("hivemind_peers") or [],
            )
            self.sides["hivemind"] = hm
            self.addresses["hivemind"] = hm.maddrs()
        if "atoll" in spec["systems"]:
            from bench.averaging_atoll import AtollSide

            tensors = [initial(self.seed, self.layout, t) for t in range(self.layout.tensors)]
            atoll = AtollSide(
                index=self.index,
                peers=self.peers,
                seed=self.seed,
                layout=self.layout,
                codec=codec,
                initial=tensors,
                initial_peers=spec.get("atoll_peers") or [],
                credentials=spec.get("atoll_credentials"),
                elastic=spec.get("elastic", False),
                owner_fanout=spec.get("owner_fanout", 1),
            )
            self.sides["atoll"] = atoll
        if "raw" in spec["systems"]:
            from bench.averaging_raw import RawSide

            source = (
                [p.data for p in self.sides["atoll"].model.w] if "atoll" in self.sides else None
            )
            raw = RawSide(
                index=self.index,
                peers=self.peers,
                fragment_values=self.layout.sizes(),
                bytes_per_value=2 if codec == "fp16" else 4,
                source=source,
            )
            self.sides["raw"] = raw
            self.addresses["raw"] = raw.start()
        if "atoll" in self.sides:
            self.addresses["atoll"] = self.sides["atoll"].start()

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind = cmd["cmd"]
        side: Any = self.sides.get(cmd.get("system", ""))
        if kind == "settle":  # every Atoll member visible; fragment -> owner URL
            owners = self.sides["atoll"].settle() if "atoll" in self.sides else []
            return {"owners": owners}
        if kind == "owners":  # the raw side follows Atoll's owners (or the launcher's choice)
            raw = self.sides["raw"]
            by_atoll = {u: r for u, r in zip(cmd["atoll_urls"], cmd["raw_urls"], strict=True)}
            raw.owners = [by_atoll[u] for u in cmd["owners"]]
            return {}
        if kind == "prepare":
            t0 = time.perf_counter()
            if cmd["system"] == "atoll":
                keep = self.index in cmd.get("keep_base_peers", ())
                side.prepare(cmd["round"], keep_base=keep)
            elif cmd["system"] == "hivemind":
                side.prepare(cmd["round"])
            return {"prepare_s": time.perf_counter() - t0}
        if kind == "go":
            t0, threads0 = time.perf_counter(), ThreadTimes.now()
            profiled = self.sampler is not None and cmd["system"] == "atoll"
            if profiled:
                self.sampler.active = True  # type: ignore[union-attr]
            try:
                if cmd["system"] == "raw":
                    out = side.cycle(cmd["round"], cmd["timeout_s"])
                else:
                    out = side.cycle(cmd["timeout_s"])
            finally:
                if profiled:
                    self.sampler.active = False  # type: ignore[union-attr]
            threads = ThreadTimes.now().since(threads0)
            return {**out, "cycle_s": time.perf_counter() - t0, "threads": threads}
        if kind == "check":
            sets = cmd["sets"]
            out = (
                side.check(sets, cmd.get("stride", 1))
                if cmd["system"] == "hivemind"
                else side.check(sets)
            )
            return {**out, "digests": side.digests()}
        if kind == "digests":
            return {"digests": side.digests()}
        if kind == "memory":
            return {
                "rss_mb": _status_mb("VmRSS"),
                "peak_rss_mb": _status_mb("VmHWM"),
                **({"held_mb": _held_mb()} if cmd.get("detail") else {}),
            }
        raise ValueError(f"unknown command {kind!r}")

    def close(self) -> None:
        if self.sampler is not None:
            path = os.path.join(os.environ["BENCH_PROFILE"], f"peer{self.index}.txt")
            with open(path, "w") as f:
                f.write(self.sampler.report())
        for side in self.sides.values():
            try:
                side.close()
            except Exception as exc:  # shutting down: report and go on
                print(f"closing {type(side).__name__}: {exc!r}", file=sys.stderr)


def _status_mb(field: str) -> int:
    """This process's ``field`` from /proc/self/status (VmRSS, VmHWM: peak RSS), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    return -1


def _held_mb() -> dict[str, int]:
    """MiB held by live tensors (distinct storages) and by bytes-like objects that live Python
    containers refer to, by type: where a peer's memory goes, roughly (a diagnostic)."""
    import gc

    storages: dict[int, int] = {}
    buffers: dict[int, tuple[str, int]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        for ref in gc.get_referents(obj):
            if isinstance(ref, (bytes, bytearray, memoryview)) and len(ref) > 1 << 16:
                size = ref.nbytes if isinstance(ref, memoryview) else len(ref)
                if (
                    not isinstance(ref, memoryview)
                    or ref.obj is None
                    or not isinstance(ref.obj, (bytes, bytearray))
                ):
                    buffers[id(ref)] = (type(ref).__name__, size)
    out = {"tensors": sum(storages.values()) >> 20}
    for name, size in buffers.values():
        out[name] = out.get(name, 0) + (size >> 20)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (ours, hivemind's children) go to stderr, not into the replies
    torch.set_num_threads(1)
    logging.basicConfig(
        level=os.environ.get("BENCH_LOG", "WARNING"),
        stream=sys.stderr,
        format=f"%(asctime)s peer{spec['index']} %(name)s %(levelname)s %(message)s",
    )
    try:
        peer = Peer(spec)
    except Exception as exc:
        replies.write(json.dumps({"event": "failed", "error": repr(exc)[:1000]}) + "\n")
        raise
    replies.write(json.dumps({"event": "ready", **peer.addresses}) + "\n")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            try:
                reply = peer.handle(cmd)
            except Exception as exc:
                reply = {"ok": False, "error": repr(exc)[:1000]}
                logging.getLogger("bench").exception("command %s failed", cmd["cmd"])
            replies.write(json.dumps({"event": cmd["cmd"], **reply}) + "\n")
    finally:
        peer.close()


if __name__ == "__main__":
    main()
