"""Two CPU processes (DDP, gloo) on the smoke experiment: sharded data, one set of gates, one report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["experiment=smoke", "trainer.max_steps=30", "export.enabled=false"]


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *SMOKE, f"hydra.run.dir={run_dir}", *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_two_gloo_processes_keep_identical_gates_and_read_disjoint_data(tmp_path):
    run_dir, probe = tmp_path / "ddp", tmp_path / "probe"
    _train(
        run_dir, "trainer=ddp_cpu",
        "+callbacks.probe._target_=ddp_probe.SaveRankState", f"+callbacks.probe.out_dir={probe}",
    )
    ranks = [torch.load(probe / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    # the gates were trained (20 gated steps moved them) and are the same tensor on both processes
    init = torch.full_like(ranks[0]["log_alpha"], 3.0)
    assert not torch.allclose(ranks[0]["log_alpha"], init, atol=1e-3)
    assert torch.equal(ranks[0]["log_alpha"], ranks[1]["log_alpha"])

    # each process reads its own half of every epoch, and both take the same number of steps
    per_epoch = ranks[0]["batches_per_epoch"]
    assert per_epoch == ranks[1]["batches_per_epoch"] and len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 30
    first_epoch = [set(r["batches"][:per_epoch]) for r in ranks]
    assert len(first_epoch[0]) == per_epoch and not first_epoch[0] & first_epoch[1]

    # validation: the 40 pairs are split between the processes, and scored together
    assert [a + b for a, b in zip(ranks[0]["val_pairs"], ranks[1]["val_pairs"])] == [40] * len(ranks[0]["val_pairs"])
    assert min(ranks[0]["val_pairs"] + ranks[1]["val_pairs"]) > 0

    # rank 0 alone reports; its scores are those of one process validating the same checkpoint on all pairs
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads((run_dir / "status.json").read_text())["status"] == "done" and metrics["steps"] == 30
    single = tmp_path / "single"
    _train(single, f"resume={run_dir / 'checkpoints/last.ckpt'}")
    again = json.loads((single / "metrics.json").read_text())
    assert again["steps"] == 30 and again["plan"] == metrics["plan"]
    assert (again["bleu"], again["chrf"]) == (metrics["bleu"], metrics["chrf"])


def test_after_ddp_training_rank_0_exports_and_fine_tunes_on_one_device(tmp_path):
    # fine-tuning is on by default: it runs after the DDP fit, in rank 0 alone, with a trainer of its own
    run_dir = tmp_path / "ddp_finetune"
    _train(run_dir, "trainer=ddp_cpu", "trainer.max_steps=12", "export.enabled=true", "finetune.steps=3")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads((run_dir / "status.json").read_text())["status"] == "done" and metrics["steps"] == 12
    assert metrics["finetune"]["steps"] == 3 and metrics["model"].startswith("exported, fine-tuned 3 steps")
    assert (run_dir / "pruned_finetuned" / "config.json").is_file() and metrics["export"]["verification"]["passed"]
