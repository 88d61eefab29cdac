"""What a peer holds beside the model (docs/scale.md's budget): copies that outlive their use."""

from __future__ import annotations

import torch

from node.diloco.received import ReceivedVersions


def test_version_0_is_released_once_a_later_version_is_held() -> None:
    initial = [torch.ones(1000), torch.ones(500)]
    known = ReceivedVersions(initial, wall_clock=lambda: 0.0)
    assert known.held(0)[0] == 0 and torch.equal(known.held(0)[1], initial[0])
    newer = torch.full((1000,), 2.0)
    known.remember(0, 1, newer)
    assert known.held(0) == (1, newer)  # the newest version, not version 0
    assert known.initial[0].numel() == 0  # its copy (a whole fragment's fp32 bytes) is gone
    assert torch.equal(known.held(1)[1], initial[1])  # fragment 1 still at version 0: kept
    assert known.digest(0, 0) is not None  # contributions on version 0 are still recognised
