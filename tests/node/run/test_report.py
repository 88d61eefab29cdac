"""The swarm report's folds of the peers' results."""

from __future__ import annotations

import pytest

from node.run.report import bytes_by_route


def test_bytes_by_route_sums_the_peers_largest_first_per_trained_token() -> None:
    peers = [
        {"bytes_by_route": {"/v1/rpc:Contribution": 600, "/v1/dht:FindValue": 50}},
        {"bytes_by_route": {"/v1/rpc:Contribution": 400, "reply /v1/fragments/*/next": 2000}},
        {},
    ]  # a peer that sent nothing (or an older peer without the field)
    routes = bytes_by_route(peers, tokens=1000)
    assert list(routes) == [
        "reply /v1/fragments/*/next",
        "/v1/rpc:Contribution",
        "/v1/dht:FindValue",
    ]
    assert routes["/v1/rpc:Contribution"] == {"bytes": 1000, "per_token": 1.0}
    assert routes["/v1/dht:FindValue"]["per_token"] == 0.05
    assert bytes_by_route(peers, tokens=0)["/v1/dht:FindValue"]["per_token"] == 0.0
    # peers that count their messages add them; a route no peer counted has none
    peers[0]["messages_by_route"] = {"/v1/rpc:Contribution": 3}
    peers[1]["messages_by_route"] = {"/v1/rpc:Contribution": 2, "reply /v1/fragments/*/next": 4}
    routes = bytes_by_route(peers, tokens=1000)
    assert routes["/v1/rpc:Contribution"] == {"bytes": 1000, "per_token": 1.0, "messages": 5}
    assert routes["reply /v1/fragments/*/next"]["messages"] == 4
    assert "messages" not in routes["/v1/dht:FindValue"]


def test_memory_keeps_a_thinned_curve_that_tells_a_late_peak_from_a_climb() -> None:
    from node.run.report import CURVE_POINTS, memory_summary

    climb = [[t, 0, (400 + t / 10) * 1e6] for t in range(200)]  # +0.1 MB a sample, all run long
    spike = [
        [t, 0, (420 if t == 199 else 400) * 1e6] for t in range(200)
    ]  # flat, then one peak at the end
    out = memory_summary([{"index": 0, "rss_curve": climb}, {"index": 1, "rss_curve": spike}])
    c0, c1 = out["per_peer"]["0"]["curve_mb"], out["per_peer"]["1"]["curve_mb"]
    assert len(c0) == len(c1) == CURVE_POINTS and c0[-1] == 419.9 and c1[-1] == 420.0
    assert (
        min(out["per_peer"][i]["growth_after_warmup_mb"] for i in "01") > 10
    )  # both grew; the numbers alone do not say how
    assert all(b > a for a, b in zip(c0, c0[1:], strict=False))  # the climb shows in the curve
    assert c1[:-1] == [400.0] * (CURVE_POINTS - 1)  # the late peak does not
    assert memory_summary([{"index": 2, "rss_curve": climb[:6]}])["per_peer"]["2"]["curve_mb"] == [
        400.0,
        400.1,
        400.2,
        400.3,
        400.4,
        400.5,
    ]


def test_memory_tells_a_heap_that_keeps_freed_blocks_from_one_that_holds_more() -> None:
    from node.run.report import memory_summary

    # resident size climbs on both; only peer 1's tensors and buffers in use climb with it
    kept = [[t, 0, (400 + t / 10) * 1e6, 90e6, 500_000] for t in range(100)]
    leak = [
        [t, 0, (400 + t / 10) * 1e6, (90 + t / 10) * 1e6, 500_000 + 100 * t] for t in range(100)
    ]
    old = [[t, 0, 400e6] for t in range(100)]  # a peer without the heap samples (an older peer)
    out = memory_summary(
        [
            {"index": 0, "rss_curve": kept},
            {"index": 1, "rss_curve": leak},
            {"index": 2, "rss_curve": old},
        ]
    )
    p0, p1, p2 = (out["per_peer"][i] for i in "012")
    assert p0["growth_after_warmup_mb"] == p1["growth_after_warmup_mb"] == 7.5
    assert p0["heap_growth_after_warmup_mb"] == 0.0 and p0["py_blocks_growth_after_warmup"] == 0
    assert p1["heap_growth_after_warmup_mb"] == 7.5 and p1["py_blocks_growth_after_warmup"] == 7500
    assert p1["py_blocks_curve"][-1] == 500_000 + 9900 and p1["heap_curve_mb"][0] == 90.0
    assert "heap_growth_after_warmup_mb" not in p2 and out["max_heap_growth_mb"] == 7.5


def test_the_heap_in_use_counts_a_tensor_while_it_lives() -> None:
    import torch

    from node.diloco.allocator import heap_in_use

    before = heap_in_use()
    if before is None:
        pytest.skip("no glibc mallinfo2 here")
    x = torch.ones(4_000_000)  # 16 MB
    during = heap_in_use()
    del x
    after = heap_in_use()
    assert during is not None and after is not None
    assert during - before >= 15_000_000 and during - after >= 15_000_000


def test_the_report_shows_each_peers_lowest_standing_and_the_attackers_in_its_lines() -> None:
    from node.run.report import standing_of

    peers = [{"standing": {"aa": -2.5, "bb": 0.4}}, {"standing": {"aa": -1.0}}, {}]
    assert standing_of("aa", peers) == -2.5  # the lowest at any owner
    assert standing_of("bb", peers) == 0.4
    assert standing_of("cc", peers) == 0.0  # never judged: neutral
    assert standing_of("aa", [{}, {"penalties": {}}]) is None  # a run before standings


def test_memory_reads_against_the_models_fp32_bytes_the_budget_and_the_ceiling() -> None:
    from node.run.report import BUDGET_X_MODEL, TARGET_X_MODEL, memory_summary

    model = 500_000_000
    peers = [
        {"index": 0, "rss_curve": [[t, 0, x * model, -1, 0] for t, x in enumerate([2, 5, 6, 7])]},
        {"index": 1, "rss_curve": [[t, 0, x * model, -1, 0] for t, x in enumerate([2, 5, 9, 9])]},
    ]
    out = memory_summary(peers, model_bytes=model)
    assert [p["peak_x_model"] for p in out["per_peer"].values()] == [7.0, 9.0]
    assert (out["model_fp32_mb"], out["max_peak_x_model"]) == (500.0, 9.0)
    assert out["budget_x_model"] == BUDGET_X_MODEL and out["target_x_model"] == TARGET_X_MODEL
    assert out["within_budget"] is (BUDGET_X_MODEL >= 9.0)
    assert out["under_target"] is False  # peer 1 went over 8x
    assert out["max_rss_x_model"] is None  # no peer sent its high-water mark


def test_the_summary_compares_memory_with_the_budget_only_for_models_it_is_for() -> None:
    """The main job's 84k-parameter model is 0.34 MB of fp32: a peer's ~430 MB are the
    interpreter and torch, so the summary says that instead of "1272x the model (budget 8x)";
    at 500 MB it compares. Small byte counts keep their digits."""
    from node.run.report import _budget_note, _bytes, memory_summary

    curve = [[t, 0, 430_000_000, -1, 0] for t in range(4)]
    tiny = memory_summary([{"index": 0, "rss_curve": curve}], model_bytes=337_152)
    assert tiny["budget_applies"] is False and tiny["max_peak_x_model"] > 1000  # JSON compares
    note = _budget_note(tiny)
    assert "337 kB" in note and "budget is for models of 250 MB or more" in note
    assert "x the model" not in note
    big = memory_summary([{"index": 0, "rss_curve": curve}], model_bytes=500_000_000)
    assert big["budget_applies"] is True
    assert _budget_note(big) == "; at most 0.86x the model's fp32 500 MB (budget 8x, ceiling 8x)"
    assert [_bytes(n) for n in (0, 999, 1234, 4_900_000, 2.5e9)] == [
        "0 B",
        "999 B",
        "1.23 kB",
        "4.9 MB",
        "2.5 GB",
    ]


def test_memory_shows_the_kernels_high_water_mark_beside_the_samples() -> None:
    """A peak between the 5 s samples (or after the last, at the end of the run) is in
    ``max_rss_x_model``; the budget and the ceiling still read the samples."""
    from node.run.report import memory_summary

    model = 500_000_000
    curve = [[t, 0, x * model, -1, 0] for t, x in enumerate([2, 5, 6, 7])]
    peers = [
        {"index": 0, "rss_curve": curve, "max_rss_bytes": int(8.9 * model)},
        {"index": 1, "rss_curve": curve},
    ]
    out = memory_summary(peers, model_bytes=model)
    assert out["per_peer"]["0"]["max_rss_x_model"] == 8.9
    assert out["per_peer"]["0"]["max_rss_mb"] == 4450.0
    assert "max_rss_x_model" not in out["per_peer"]["1"]
    assert out["max_rss_x_model"] == 8.9 and out["max_peak_x_model"] == 7.0
    assert out["under_target"] is True


def test_owners_merge_time_per_version_and_standin_compute_are_folded() -> None:
    from node.run.report import compute_summary, merge_summary

    peers = [
        {"index": 0, "owner_merge": {"versions": 4, "seconds": 2.0}, "compute": {"kind": "real"}},
        {"index": 1, "owner_merge": {"versions": 0, "seconds": 0.0}},  # owned nothing
        {"index": 2, "owner_merge": {"versions": 5, "seconds": 5.0}},
    ]
    merges = merge_summary(peers)
    assert merges["per_owner"]["0"]["per_version_s"] == 0.5 and "1" not in merges["per_owner"]
    assert merges["max_per_version_s"] == 1.0
    assert compute_summary(peers) == {"kind": "real", "loss_measured": True}
    standin = {"kind": "standin", "step_s": 0.5, "step_rms": 1e-4, "update_cpu_s_median": 0.07}
    folded = compute_summary([{**p, "compute": standin} for p in peers])
    assert folded["loss_measured"] is False and "no loss was measured" in folded["note"]
    assert folded["update_cpu_s_median_max"] == 0.07
