"""``run_peer``'s typed result: the "done" event's fields keep their names and order."""

from __future__ import annotations

import dataclasses

from node.run.train import FollowerResult, NodeOutbox, PeerResult

# what atoll local's report reads from each peer's "done" event (node.run.report): stable names
RESULT_FIELDS = [
    "index",
    "peer_id",
    "steps",
    "n_params",
    "global_versions",
    "final_param_hash",
    "eval_loss_start",
    "eval_loss_end",
    "eval_curve_local",
    "eval_curve_global",
    "tokens_trained",
    "bytes_sent",
    "bytes_by_route",
    "stalled_steps",
    "median_step_s",
    "median_step_s_detached",
    "median_compute_s",
    "contributions_sent",
    "contributions_accepted",
    "contributions_refused",
    "remote_errors",
    "merges",
    "penalties",
    "standing",
    "rss_curve",
    "spread",
    "versions_in",
    "replica_bytes",
    "attack",
    "peer_attack",
    "handoff_refusals",
    "owner_fences",
    "validation",
    "compute",
    "owner_merge",
    "device_peak_mb",
    "max_rss_bytes",
    "ranks",
    "shard",
    "most_fragments_gathered",
    "messages_by_route",
]


def test_a_peer_result_says_the_fields_the_report_reads_in_order() -> None:
    values = {f.name: f"<{f.name}>" for f in dataclasses.fields(PeerResult)}
    result = PeerResult(**values)  # type: ignore[arg-type]
    assert list(result.as_dict()) == RESULT_FIELDS
    assert result.as_dict() == values
    assert [f.name for f in dataclasses.fields(FollowerResult)] == [
        "rank",
        "steps",
        "versions",
        "param_hash",
    ]


def test_the_outbox_hands_fragments_to_the_node_once_attached_and_serving() -> None:
    got: list[object] = []

    class Net:
        def submit(self, out: object) -> None:
            got.append(out)

    class Node:
        net: Net | None = None

    outbox, node = NodeOutbox(), Node()
    outbox("before the node")  # type: ignore[arg-type]
    outbox.attach(node)  # type: ignore[arg-type]
    outbox("before it serves")  # type: ignore[arg-type]
    node.net = Net()
    outbox("served")  # type: ignore[arg-type]
    assert got == ["served"]
