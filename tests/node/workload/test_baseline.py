"""The synchronous data-parallel baseline and the inner optimizer it shares with the islands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.config import RunConfig
from node.diloco.inner import lr_at, make_inner_optimizer
from node.workload.baseline import TrainConfig, main, train_config_for, train_data_parallel
from node.workload.corpus import split_corpus
from node.workload.model import GPT, GPTConfig

TEXT = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 60


def test_lr_schedule_warms_up_then_decays_or_holds() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1) == lr_at(500, cfg)
    flat = TrainConfig(lr=1.0, warmup_steps=0, steps=110, schedule="constant")
    assert lr_at(0, flat) == lr_at(109, flat) == 1.0


def test_inner_optimizer_decays_matrices_only() -> None:
    model = GPT(GPTConfig.preset("tiny"))
    opt = make_inner_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"])
    assert all(p.dim() < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_config_validates_and_maps_from_a_run_config() -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig(model="huge")
    run = RunConfig(model="tiny", steps=7, lr=1e-3, warmup_steps=2, batch_size=4, seed=3)
    cfg = train_config_for(run)
    got = (cfg.model, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.batch_size, cfg.seed)
    assert got == ("tiny", 7, 1e-3, 2, 4, 3)


def test_one_step_on_the_concatenated_batch_is_the_all_reduced_gradient() -> None:
    model = GPT(GPTConfig.preset("tiny"))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(3)]  # 3 learners
    ys = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(3)]
    grads = []
    for x, y in zip(xs, ys, strict=True):
        model.zero_grad()
        model(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    model(torch.cat(xs), torch.cat(ys))[1].backward()
    for i, p in enumerate(model.parameters()):
        mean = torch.stack([g[i] for g in grads]).mean(0)  # fp32 all-reduce (mean)
        torch.testing.assert_close(p.grad, mean, rtol=1e-4, atol=1e-6)


def test_baseline_on_the_tiny_preset_lowers_the_loss() -> None:
    train, heldout = split_corpus(TEXT, heldout_fraction=0.1)
    cfg = TrainConfig(
        model="tiny", batch_size=4, steps=30, warmup_steps=5, lr=1e-2, eval_every=10, eval_batches=2
    )
    out = train_data_parallel(cfg, 2, train, heldout, log=None)
    assert [c[0] for c in out["eval_curve"]] == [0, 10, 20, 30]
    assert out["eval_curve"][-1][1] == out["tokens_trained"] == 30 * 2 * 4 * 64
    assert out["eval_loss_end"] < out["eval_loss_start"] - 1.0
    json.dumps(out)


def test_cli_prints_json_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    args = "--model tiny --peers 2 --steps 3 --batch-size 2 --eval-every 3 --eval-batches 1 --json"
    main(["--corpus", str(corpus), *args.split()])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n_learners"] == 2 and out["tokens_trained"] == 3 * 2 * 2 * 64
