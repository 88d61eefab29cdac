"""The swarm report's folds of the peers' results."""

from __future__ import annotations

from node.run.report import bytes_by_route


def test_bytes_by_route_sums_the_peers_largest_first_per_trained_token() -> None:
    peers = [{"bytes_by_route": {"/v1/rpc:Contribution": 600, "/v1/dht:FindValue": 50}},
             {"bytes_by_route": {"/v1/rpc:Contribution": 400, "reply /v1/fragments/*/next": 2000}},
             {}]  # a peer that sent nothing (or an older peer without the field)
    routes = bytes_by_route(peers, tokens=1000)
    assert list(routes) == ["reply /v1/fragments/*/next", "/v1/rpc:Contribution", "/v1/dht:FindValue"]
    assert routes["/v1/rpc:Contribution"] == {"bytes": 1000, "per_token": 1.0}
    assert routes["/v1/dht:FindValue"]["per_token"] == 0.05
    assert bytes_by_route(peers, tokens=0)["/v1/dht:FindValue"]["per_token"] == 0.0
