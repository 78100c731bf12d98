"""The sweep summary on fake multiruns; the lambda-sweep, Optuna and SLURM presets compose (and Optuna runs)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate

from gatedprune.reports.metrics import budget_objective
from gatedprune.cli import sweep_command as main
from gatedprune.reports.sweep import dense_baseline, seed_groups, summarise
from helpers import ROOT, compose_train, offline_env


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# pareto_params.png: the runs below have their exported parameter counts
OUTPUTS = {"summary.csv", "summary.md", "pareto.png", "pareto_params.png"}


def _metrics(lam, bleu, alive, dense_bleu=20.0, method=None) -> dict:
    metrics = {
        "bleu": bleu, "chrf": bleu + 30.0, "val_loss": 3.0, "heads_total": 24,
        "heads_alive": {"total": sum(alive), **dict(zip(("encoder", "decoder", "cross"), alive))},
        "expected_open": sum(alive) + 0.5, "l0_lambda": lam, "penalty_normalisation": "layer_mean",
        "params": 200_000, "export": {"params": 100_000 + 1_000 * sum(alive)}, "checkpoint": "x/last.ckpt",
        "dense": {"step": 10, "bleu": dense_bleu, "chrf": 50.0}, "steps": 30, "plan": {}, "seed": 1,
    }
    return metrics if method is None else {**metrics, "method": method}


def _run(root: Path, name: str, lam: float, metrics: dict | None = None, status: dict | None = None) -> None:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 1, "pruning": {"l0_lambda": lam}}))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"pruning.l0_lambda={lam}"]))
    if metrics is not None:
        (run / "metrics.json").write_text(json.dumps(metrics))
    if status is not None:
        (run / "status.json").write_text(json.dumps(status))


@pytest.fixture
def multirun(tmp_path) -> Path:
    """Nine runs, as a `-m` sweep writes them: done (one without status.json), random, failed, running, unknown."""
    root = tmp_path / "multirun" / "2024-01-01" / "12-00-00"
    done = {"status": "done"}
    _run(root, "0", 0.1, _metrics(0.1, 10.5, (2, 3, 1)), done)
    _run(root, "1", 0.01, _metrics(0.01, 18.25, (6, 7, 5), dense_bleu=22.0), done)
    _run(root, "2", 0.03, _metrics(0.03, 15.0, (4, 5, 3)))  # written before runs had status.json
    _run(root, "3", 0.003, status={"status": "failed", "error": "RuntimeError: out of memory | at step 7"})
    _run(root, "4", 0.3, status={"status": "running"})
    _run(root, "5", 1.0)  # only .hydra/: running, or killed before it wrote anything
    _run(root, "9", 0.01, _metrics(0.01, 9.0, (6, 7, 5), method="random"), done)
    _run(root, "10", 0.01, _metrics(0.01, 11.0, (8, 8, 8), method="michel"), done)
    (root / "random_sub").mkdir()  # runs further down are found too, where a sweep nests them
    _run(root / "random_sub", "0", 0.001, _metrics(0.001, 19.0, (8, 8, 0), method="random"), done)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def _csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_summary_csv_has_the_inputs_sorted_by_lambda_then_method(multirun):
    rows = summarise(multirun)
    assert OUTPUTS <= {p.name for p in multirun.iterdir()}
    table = _csv(multirun / "summary.csv")
    assert [(r["run"], r["method"], r["lambda"], r["status"]) for r in table] == [
        ("random_sub/0", "random", "0.001", "done"),
        ("3", "gated", "0.003", "failed"),
        ("1", "gated", "0.01", "done"),
        ("10", "michel", "0.01", "done"),
        ("9", "random", "0.01", "done"),
        ("2", "gated", "0.03", "done"),
        ("0", "gated", "0.1", "done"),
        ("4", "gated", "0.3", "running"),
        ("5", "gated", "1.0", "unknown"),
    ]
    assert [r["run"] for r in rows] == [r["run"] for r in table]
    one = next(r for r in table if r["run"] == "1")
    assert float(one["bleu"]) == 18.25 and float(one["chrf"]) == 48.25 and float(one["dense_bleu"]) == 22.0
    assert (one["heads_encoder"], one["heads_decoder"], one["heads_cross"]) == ("6", "7", "5")
    assert one["heads_alive"] == "18" and one["heads_total"] == "24" and one["params"] == "118000"
    failed = next(r for r in table if r["run"] == "3")
    assert failed["error"] == "RuntimeError: out of memory | at step 7" and failed["bleu"] == ""
    assert next(r for r in table if r["run"] == "5")["error"].startswith("no metrics.json or status.json")
    assert all(r["error"] == "" for r in table if r["status"] in ("done", "running"))


def test_a_dense_run_is_a_point_of_its_own_not_part_of_the_dense_line(tmp_path):
    # a run that ended before gating (pruning.start_step >= max_steps) says method "dense" and has no lambda;
    # the dense line is the mean dense phase of the pruning runs only
    done = {"status": "done"}
    _run(tmp_path, "0", 0.1, _metrics(0.1, 10.5, (2, 3, 1), dense_bleu=20.0), done)
    _run(tmp_path, "1", 0.01, _metrics(0.01, 18.0, (6, 7, 5), dense_bleu=22.0), done)
    dense = {**_metrics(None, 25.0, (8, 8, 8), dense_bleu=25.0), "method": "dense", "l0_lambda": None}
    del dense["export"]  # nothing to cut
    _run(tmp_path, "2", 0.1, dense, done)
    rows = summarise(tmp_path)
    assert [(r["run"], r["method"], r["lambda"]) for r in rows] == [("1", "gated", 0.01), ("0", "gated", 0.1), ("2", "dense", None)]
    assert dense_baseline(rows) == (21.0, 2)
    assert [r["params"] for r in rows] == [118_000, 106_000, 200_000]  # pruned as exported; the dense run's own
    _run(tmp_path, "3", 0.1, {k: v for k, v in _metrics(0.1, 1.0, (1, 1, 1)).items() if k != "export"}, done)
    assert next(r for r in summarise(tmp_path) if r["run"] == "3")["params"] is None  # not exported: not known
    assert (tmp_path / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)


def test_summary_md_lists_every_run_with_status_and_error(multirun):
    summarise(multirun)
    text = (multirun / "summary.md").read_text()
    assert "9 runs: 6 done, 1 failed, 1 running, 1 unknown" in text
    assert "Dense-phase BLEU (mean over 6 runs): 20.33" in text  # five runs at 20.0, one at 22.0
    runs_table = text.split("\n## ")[0]  # the methods at matched head counts follow
    rows = [line for line in runs_table.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    assert len(rows) == 9
    assert rows[2] == "| 1 | gated | 0.01 | 6 | 7 | 5 | 18 / 24 | 18.25 | 48.25 | 118,000 | done |  |"
    error = "RuntimeError: out of memory \\| at step 7"  # the pipe escaped, so the table keeps its columns
    assert rows[1] == f"| 3 | gated | 0.003 | - | - | - | - | - | - | - | failed | {error} |"
    assert rows[7].startswith("| 4 | gated | 0.3 |") and "| running |" in rows[7]


def test_pareto_is_a_png_and_writes_leave_no_temporary_files(multirun, tmp_path):
    out = tmp_path / "report"
    assert main([str(multirun), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == OUTPUTS  # nothing else: no .tmp left behind
    assert not OUTPUTS & {p.name for p in multirun.iterdir()}
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 10_000
    summarise(multirun, out)  # a second summary replaces the first
    assert {p.name for p in out.iterdir()} == OUTPUTS


@pytest.mark.parametrize("layout", ["empty", "no_runs", "missing"])
def test_no_runs_is_one_line_nonzero_exit_and_nothing_written(tmp_path, capsys, layout):
    target = tmp_path / "sweep"
    if layout != "missing":
        target.mkdir()
    if layout == "no_runs":
        (target / "notes").mkdir()
        (target / "multirun.yaml").write_text("hydra: {}\n")
    before = sorted(tmp_path.rglob("*"))
    assert main([str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(target) in err[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_wandb_logs_table_and_plot_offline(multirun, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "report"
    assert main([str(multirun), "--out", str(out), "--wandb"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    media = {p.suffix for p in (runs[0] / "files" / "media").rglob("*") if p.is_file()}
    assert {".png", ".json"} <= media  # the image and the table


def test_budget_objective_is_bleu_within_budget_and_negative_excess_over_it():
    metrics = _metrics(0.1, 17.5, (4, 4, 4))
    assert budget_objective(metrics, None) == 17.5
    assert budget_objective(metrics, 12) == 17.5
    assert budget_objective(metrics, 10) == -2.0
    assert budget_objective(_metrics(0.1, 0.0, (0, 0, 0)), 0) == 0.0


def _compose(tmp_path, overrides):
    return compose_train(tmp_path, *overrides, hydra_config=True)


def test_lambda_sweep_expands_to_five_gated_runs(tmp_path):
    cfg = _compose(tmp_path, ["experiment=lambda_sweep"])
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params), max_batch_size=None)[0]
    assert jobs == [[f"pruning.l0_lambda={lam}"] for lam in ("0.01", "0.03", "0.1", "0.3", "1.0")]


def test_optuna_preset_composes_with_the_smoke_experiment(tmp_path):
    cfg = _compose(tmp_path, ["hparams_search=optuna", "experiment=smoke", "hydra.sweeper.n_trials=2"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert sweeper.n_trials == 2 and sweeper.sampler.seed == cfg.seed
    assert sweeper.params["pruning.l0_lambda"] == "tag(log, interval(0.001, 1.0))"
    assert cfg.optimized_metric == "bleu_under_budget" and cfg.head_budget == 36
    assert cfg.model.from_scratch.d_model == 32  # the experiment still applies


def test_slurm_launcher_preset_composes_and_instantiates_without_submitting(tmp_path):
    cfg = _compose(tmp_path, ["hydra/launcher=slurm", "experiment=lambda_sweep", "hydra.launcher.partition=gpu"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 120)
    assert launcher.submitit_folder == f"{cfg.hydra.sweep.dir}/.submitit/%j"  # job logs beside the sweep
    assert type(instantiate(launcher)).__name__ == "SlurmLauncher"


def test_optuna_runs_two_smoke_trials_and_the_summary_reads_them(tmp_path):
    env = offline_env()
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hparams_search=optuna", "experiment=smoke",
         "hydra.sweeper.n_trials=2", "head_budget=12", f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert 0.001 <= best["best_params"]["pruning.l0_lambda"] <= 1.0
    values = []
    for job in ("0", "1"):
        metrics = json.loads((sweep_dir / job / "metrics.json").read_text())
        assert metrics["bleu_under_budget"] == budget_objective(metrics, 12)
        values.append(metrics["bleu_under_budget"])
    assert best["best_value"] == max(values)
    rows = summarise(sweep_dir)
    assert [r["status"] for r in rows] == ["done", "done"]
    assert (sweep_dir / "pareto.png").read_bytes()[:8] == PNG_SIGNATURE


def test_runs_that_differ_only_in_seed_are_grouped_with_mean_and_spread(tmp_path):
    from statistics import mean, stdev

    root = tmp_path / "seeds"
    done = {"status": "done"}
    for i, (seed, lam, bleu, alive, test) in enumerate([
        (1, 0.1, 10.0, (2, 3, 1), 9.0), (2, 0.1, 11.0, (3, 3, 1), 9.5), (3, 0.1, 12.5, (2, 4, 2), 10.5),
        (1, 1.0, 5.0, (0, 0, 2), 4.0),
    ]):
        metrics = {**_metrics(lam, bleu, alive), "seed": seed, "test": {"pruned": {"bleu": test}}}
        if seed == 3:  # a fine-tuned export: its test score before fine-tuning is kept beside the final one
            metrics["test"]["pruned_before_finetune"] = {"bleu": test - 2}
        _run(root, str(i), lam, metrics, done)
        config = {"seed": seed, "resume": f"dense_{seed}.ckpt", "pruning": {"l0_lambda": lam}}
        (root / str(i) / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    rows = summarise(root)
    groups = {g["lambda"]: g for g in seed_groups(rows)}
    three = groups[0.1]
    assert three["n"] == 3 and three["seeds"] == [1, 2, 3]
    assert three["bleu"] == pytest.approx(mean([10.0, 11.0, 12.5])) and three["bleu_sd"] == pytest.approx(stdev([10.0, 11.0, 12.5]))
    assert three["test_bleu"] == pytest.approx(mean([9.0, 9.5, 10.5]))
    assert three["heads_alive"] == pytest.approx(mean([6, 7, 8])) and three["heads_sd"] == pytest.approx(1.0)
    assert groups[1.0]["n"] == 1 and groups[1.0]["bleu_sd"] == 0.0
    text = (root / "summary.md").read_text()
    assert "## Seeds" in text and f"| 0, 1, 2 | gated | 0.1 | 3 | 7.0 ± 1.0 | {mean([10.0, 11.0, 12.5]):.2f} ± " in text
    assert [r["seed"] for r in _csv(root / "summary.csv")] == ["1", "2", "3", "1"]
    assert [r["test_bleu_before_finetune"] for r in _csv(root / "summary.csv")] == ["", "", "8.5", ""]
    assert (root / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)


def test_methods_at_matched_head_counts_pool_seeds_into_mean_and_sample_sd():
    from gatedprune.reports.sweep import KINDS, matched_counts, matched_counts_markdown

    def row(method, heads, test_bleu, seconds, status="done", group="g"):
        return {"run": f"{method}_{test_bleu}", "group": group, "method": method, "heads_alive": heads,
                "test_bleu": test_bleu, "test_chrf": 2 * test_bleu,
                "bleu": test_bleu - 1, "seconds": seconds, "status": status,
                **{f"heads_{kind}": heads // 3 for kind in KINDS}}

    rows = [row("random", 24, 2.0, 1), row("random", 24, 4.0, 3), row("random", 24, 9.0, 5),
            {**row("gated", 24, 10.0, 300), "test_bleu_before_finetune": 8.5}, row("gated", 48, 11.0, 290), row("random", 48, 50.0, 1, status="failed"),
            row("gated", 24, 7.0, 100, group="other settings")]  # another protocol: its own row, never pooled
    table = matched_counts(rows)
    assert [(e["heads"], e["method"], e["n"]) for e in table] == [
        (48, "gated", 1), (24, "gated", 1), (24, "gated", 1), (24, "random", 3)]
    random = table[3]
    assert random["test_bleu"] == pytest.approx(5.0) and random["test_bleu_sd"] == pytest.approx(((9 + 1 + 16) / 2) ** 0.5)
    assert random["test_chrf"] == pytest.approx(10.0) and random["seconds"] == pytest.approx(3.0)
    assert random["encoder"] == 8 and table[0]["test_bleu_sd"] == 0.0
    markdown = matched_counts_markdown(rows)
    assert "| 24 | random | random_2.0 (+2 seeds) | 3 | 5.00 ± 3.61 |" in markdown
    assert "| 48 | gated | gated_11.0 | 1 | 11.00 | - |" in markdown  # not fine-tuned
    assert "| 24 | gated | gated_10.0 | 1 | 10.00 | 8.50 |" in markdown
    assert matched_counts_markdown([r for r in rows if r["method"] == "gated"]) == ""  # one method: nothing to compare
