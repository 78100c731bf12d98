"""The entry point: config groups compose and instantiate, a smoke run reports, bad input is refused cleanly."""

import json

import pytest
import torch
import wandb
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy

from gatedprune.train import train
import gatedprune.costs.timers as timers
from helpers import ROOT, compose_train, fake_timer, run_train

CONF = ROOT / "conf"


def test_every_option_of_every_group_composes_and_its_cheap_parts_instantiate(tmp_path):
    for group in ("pruning", "optim", "generation"):
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            cfg = compose_train(tmp_path, f"{group}={option}")
            instantiate(cfg[group], _convert_="all")
    for option in sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")):
        compose_train(tmp_path, f"experiment={option}")
    cfg = compose_train(tmp_path, "logger=wandb", "trainer=gpu", "data=files", "model=pretrained")
    assert set(cfg.logger) == {"csv", "wandb"} and cfg.data._target_ == "gatedprune.data.FilesData"
    for option in sorted(p.stem for p in (CONF / "trainer").glob("*.yaml")):
        assert compose_train(tmp_path, f"trainer={option}").trainer.use_distributed_sampler is False  # data.py shards
    trainer = instantiate(compose_train(tmp_path, "trainer=ddp_cpu").trainer, logger=False, callbacks=[])
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy.process_group_backend == "gloo"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    metrics = train(compose_train(out, "experiment=smoke"))
    return out, metrics


def test_smoke_run_writes_metrics_checkpoint_tokenizer_and_heatmaps(smoke_run):
    out, metrics = smoke_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    for key in ("bleu", "chrf", "val_loss", "heads_total", "heads_alive", "expected_open", "l0_lambda",
                "penalty_normalisation", "params", "checkpoint"):
        assert key in on_disk, key
    assert on_disk["heads_total"] == 24  # 2 layers x 4 heads x 3 kinds
    alive = on_disk["heads_alive"]
    assert set(alive) == {"total", "encoder", "decoder", "cross"}
    assert alive["total"] == alive["encoder"] + alive["decoder"] + alive["cross"]
    assert alive["total"] == sum(len(kept) for kept in on_disk["plan"].values())
    assert on_disk["steps"] == 30 and on_disk["dense"]["step"] == 10
    assert on_disk["penalty_normalisation"] == "layer_mean" and on_disk["l0_lambda"] == 0.1
    assert on_disk["method"] == "gated" and (out / "checkpoints" / "dense.ckpt").is_file()
    assert (out / on_disk["checkpoint"]).is_file()  # recorded relative to the run directory
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (out / "gates").glob("*.png"))[-1] == "step_0000030.png"
    assert (out / "csv" / "metrics.csv").is_file()


def test_a_run_that_ends_before_gating_is_a_dense_baseline(tmp_path, monkeypatch):
    # the same number of steps as a gated run, without gates: what the sweep plot compares pruning against
    metrics = train(compose_train(tmp_path, "experiment=smoke", "trainer.max_steps=13", "pruning.start_step=13",
                                        "export.enabled=false"))
    assert metrics["method"] == "dense" and metrics["l0_lambda"] is None and metrics["steps"] == 13
    assert metrics["heads_alive"]["total"] == metrics["heads_total"] == 24
    assert metrics["dense"] == {"step": 13, "bleu": metrics["bleu"], "chrf": metrics["chrf"]}
    # the checkpoint metrics.json names is the last step, not the last multiple of every_n_train_steps (10)
    assert torch.load(tmp_path / metrics["checkpoint"], weights_only=True)["global_step"] == 13
    # the default method (a latency budget, pruning=speed) likewise: its dense phase alone, as docs/quality.md trains
    # each seed's dense checkpoint (python train.py trainer.max_steps=750 export.enabled=false). It measures and caches
    # the latency fit its forks use (here a fake clock's), and a target below the floor is no reason to refuse a run
    # that cuts nothing (on CI's loaded machine the smoke model's measured floor rose above the default 0.67)
    monkeypatch.setitem(timers.TIMERS, "torch", fake_timer)
    budget = train(compose_train(tmp_path / "budget", "experiment=smoke", "pruning=speed", "trainer.max_steps=10",
                                 "pruning.target_latency=0.01", "export.enabled=false"))
    assert budget["method"] == "dense" and budget["steps"] == 10 and budget["heads_alive"]["total"] == 24
    assert len(list((tmp_path / "budget" / "checkpoints").glob("latency-*.json"))) == 1


def test_checkpoint_describes_model_and_gates(smoke_run):
    out, metrics = smoke_run
    ckpt = torch.load(out / metrics["checkpoint"], map_location="cpu", weights_only=True)
    assert ckpt["hf_config"]["model_type"] == "mbart"
    assert ckpt["gate_kinds"] == ["encoder", "decoder", "cross"]
    assert ckpt["gate_options"]["temperature"] == 0.33
    state = ckpt["state_dict"]
    assert state["gates._extra_state"]["paths"][0] == "model.encoder.layers.0.self_attn"
    log_alpha = torch.cat([state[f"gates.gates.{i}.log_alpha"] for i in range(6)])
    kept = sum(len(k) for k in metrics["plan"].values())
    assert int((log_alpha > 0).sum()) == kept


def test_penalty_moves_gates_only_after_the_dense_phase(smoke_run):
    out, _ = smoke_run
    import csv

    rows = list(csv.DictReader(open(out / "csv" / "metrics.csv")))
    expected = [(int(r["step"]), float(r["train/expected_open"])) for r in rows if r.get("train/expected_open")]
    dense = [v for step, v in expected if step < 10]
    gated = [v for step, v in expected if step >= 15]
    assert dense and gated
    assert max(dense) == pytest.approx(min(dense))  # no gradient reaches log_alpha before start_step
    assert gated[-1] < dense[0] - 1  # the L0 penalty closes gates


def test_wandb_logger_works_offline_with_metrics_and_heatmaps(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_train(tmp_path, "experiment=smoke", "logger=wandb", "export.enabled=false", "trainer.max_steps=20")
    train(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    media = list(runs[0].rglob("gates/heatmap*.png"))
    assert media, sorted(str(p.relative_to(runs[0])) for p in runs[0].rglob("*"))[:20]
    assert (tmp_path / "csv" / "metrics.csv").is_file()  # CSV always
    # the W&B run ends with the run: the next run in this process (a -m sweep's next member) gets its own
    assert wandb.run is None
    second = ["experiment=smoke", "logger=wandb", "export.enabled=false", "trainer.max_steps=10"]
    train(compose_train(tmp_path / "second", *second))
    assert len(list((tmp_path / "second" / "wandb").glob("offline-run-*"))) == 1


def test_the_gated_phase_ends_once_the_plan_is_stable(tmp_path):
    # lambda 0: nothing pushes the gates shut, so the plan of the first gated validation stays
    metrics = train(compose_train(tmp_path, "experiment=smoke", "trainer.val_check_interval=2",
                                  "pruning.stop_when_stable=2", "pruning.l0_lambda=0", "export.enabled=false"))
    changes = metrics["convergence"]["plan_changes"]
    assert metrics["steps"] == 14 and [c["step"] for c in changes] == [12, 14]
    assert [c["changed"] for c in changes] == [0, 0] and metrics["convergence"]["stop_when_stable"] == 2
    assert torch.load(tmp_path / metrics["checkpoint"], weights_only=True)["global_step"] == 14
    # relaunched in the same directory (a requeued job), it does not train on: the plan was stable already
    again = train(compose_train(tmp_path, "experiment=smoke", "trainer.val_check_interval=2",
                                "pruning.stop_when_stable=2", "pruning.l0_lambda=0", "export.enabled=false"))
    assert again["steps"] == 14 and again["convergence"]["plan_changes"] == changes


def test_under_a_head_budget_the_stable_plan_is_the_top_k_set_once_the_target_has_ramped(tmp_path):
    # gate_lr 0: log_alpha never moves, so the top-k set never changes; it counts as stable only from the end of the
    # target ramp (gated step 6 = step 16): two stable validations there end the run at 18, not at 14
    metrics = train(compose_train(tmp_path, "experiment=smoke", "pruning=l0_budget", "pruning.target_heads=10",
                                  "pruning.target_warmup_steps=6", "pruning.gate_lr=0", "trainer.val_check_interval=2",
                                  "pruning.stop_when_stable=2", "export.enabled=false"))
    changes = metrics["convergence"]["plan_changes"]
    assert [c["step"] for c in changes] == [12, 14, 16, 18] and metrics["steps"] == 18
    # the first gated validation counts against the dense model (all 24 heads kept): the 14 the budget drops
    assert [c["changed"] for c in changes] == [14, 0, 0, 0]


def test_a_fork_into_another_rule_takes_its_first_validation_as_the_baseline(tmp_path):
    # an l0 run's plans are log_alpha > 0; a head-budget fork from its gated checkpoint keeps a top-k set: comparing
    # one with the other would count heads that changed rule, not side, so the fork's first validation records nothing
    common = ("experiment=smoke", "trainer.val_check_interval=2", "export.enabled=false")
    source = train(compose_train(tmp_path / "l0", *common, "trainer.max_steps=14"))
    assert [c["step"] for c in source["convergence"]["plan_changes"]] == [12, 14]
    fork = train(compose_train(tmp_path / "budget", *common, "trainer.max_steps=18", "pruning=l0_budget",
                               "pruning.target_heads=10", f"resume={tmp_path / 'l0' / 'checkpoints' / 'last.ckpt'}"))
    assert [c["step"] for c in fork["convergence"]["plan_changes"]] == [12, 14, 18]


def test_plan_changes_are_counted_per_validation(smoke_run):
    _, metrics = smoke_run  # lambda 0.5 closes gates: the first gated validation sees heads change side
    changes = metrics["convergence"]["plan_changes"]
    assert [c["step"] for c in changes] == [20, 30] and metrics["steps"] == 30
    closed = metrics["heads_total"] - metrics["gated"]["heads_alive"]["total"]
    assert changes[0]["changed"] + changes[1]["changed"] >= closed  # every closed head changed side at least once
    assert metrics["convergence"]["unconverged_gates"] >= 0


def test_gate_temperature_anneals_geometrically_over_the_gated_phase(tmp_path):
    import csv

    from gatedprune.methods.gated import L0

    method = L0(start_step=10, final_temperature=0.1)
    method.check_schedule(110)  # 100 gated steps
    start = method.gates.temperature
    assert method.temperature(0) == start and method.temperature(100) == pytest.approx(0.1)
    assert method.temperature(50) == pytest.approx((start * 0.1) ** 0.5)  # geometric: the mean of the logs
    assert method.temperature(500) == pytest.approx(0.1) and L0().temperature(50) == start  # held; off by default
    with pytest.raises(ValueError, match="pruning.final_temperature=0"):
        L0(final_temperature=0)
    # in a run the gates sample at the annealed temperature: the last gated step's is logged
    proc = run_train(tmp_path / "run", "pruning.final_temperature=0.05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    logged = [(int(r["step"]), float(r["train/gate_temperature"])) for r in rows if r.get("train/gate_temperature")]
    assert logged and logged[-1][1] < start and all(b <= a for (_, a), (_, b) in zip(logged, logged[1:]))


def test_converge_stops_dense_training_once_bleu_stops_improving_and_saves_dense_ckpt(tmp_path):
    """callbacks=converge (what experiment=converge uses), patience 1, a validation every 5 steps: the tiny model's
    BLEU does not rise past its first validation's, so the run stops at the second (step 10 of 400) and saves the
    checkpoint comparisons fork from there."""
    run = tmp_path / "run"
    proc = run_train(run, "callbacks=converge", "callbacks.converge.patience=1", "dense_steps=400",
                     "trainer.max_steps=400", "trainer.val_check_interval=5", "export.enabled=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((run / "metrics.json").read_text())
    converged = metrics["converged"]
    assert converged["converged"] and converged["step"] == metrics["steps"] == 10 and converged["best_step"] == 5
    assert metrics["method"] == "dense" and (run / "checkpoints" / "dense.ckpt").is_file()
    saved = torch.load(run / "checkpoints" / "dense.ckpt", weights_only=False, map_location="cpu")
    assert saved["global_step"] == 10
    assert "converged at step 10" in proc.stdout
