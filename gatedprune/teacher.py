"""The kept teacher: the converged dense model of the embedded default, stored in the repository (``teacher/``).

Every comparison of a pruned model needs the dense model it was cut from, trained to convergence; that model took
hours to train on this project's CPU and was lost with a machine once. It is kept as a plain Hugging Face directory
(``model.safetensors``, ``config.json``, the tokenizer) with ``teacher.json``, which says how it was made and what
it scores. ``model=teacher`` starts any run from it (weights only, no dense phase); ``make_teacher`` writes it from
the run of ``experiment=converge`` (``scripts/make_teacher.py``).

Nothing a run makes is written here: latency fits and sequence-level targets are cached in the run's directory.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import OmegaConf

from gatedprune.utils import file_sha256 as sha256

TEACHER_DIR = Path(__file__).resolve().parents[1] / "teacher"  # the checkout's teacher/, beside the package
RECORD = "teacher.json"
WEIGHTS = "model.safetensors"
SCORED_PAIRS = 100  # the first test pairs, scored at one thread: what the test suite checks again
# the teacher trained on, nothing pruned, scored at each step count (benchmarks/recovery.py's reference cell): the
# fair reference of a run from it, which the final table sets beside the shipped model
REFERENCE = TEACHER_DIR.parent / "docs" / "benchmarks" / "recovery" / "reference_teacher_1.0_s1234_2000_lr0.00022.json"
# the teacher's latency fit kept in the repository (greedy batch 1, one thread; the machine it was measured on is in
# it): the price list of the recovery grid's cells and of the default run (pruning=first_layers)
LATENCY_TABLE = TEACHER_DIR.parent / "docs" / "benchmarks" / "recovery" / "teacher_latency.json"


def teacher_dir() -> str:
    """``${gp.teacher:}``: the kept teacher's directory; one line naming it and how to make it when it is absent."""
    if not (TEACHER_DIR / RECORD).is_file():
        raise ValueError(f"model=teacher: no kept teacher at {TEACHER_DIR} (a checkout of the repository has one; an "
                         "installed wheel does not); allowed: a checkout, or model=pretrained "
                         "model.name_or_path=<a model directory>; make one with scripts/make_teacher.py")
    return str(TEACHER_DIR)


def teacher_reference(target: str) -> str | None:
    """``${gp.teacher_reference:${pruning._target_}}`` (``model=teacher``'s ``reference``): ``REFERENCE`` for a
    method whose final table shows it (one shipped model: the gated methods); null for the others (several levels,
    or a recovery of an export), and before the reference cell has run."""
    from hydra.utils import get_class

    return str(REFERENCE) if REFERENCE.is_file() and getattr(get_class(target), "shows_reference", False) else None


def teacher_latency(name_or_path: str) -> str | None:
    """``${gp.teacher_latency:${model.name_or_path}}`` (``pruning=first_layers``'s ``workload.table``):
    ``LATENCY_TABLE`` when the model is the kept teacher, so its plan does not follow the machine's load; null (a fit
    measured at set-up) for any other model, whose structures the teacher's table does not price."""
    kept = LATENCY_TABLE.is_file() and Path(str(name_or_path)).resolve() == TEACHER_DIR.resolve()
    return str(LATENCY_TABLE) if kept else None


if not OmegaConf.has_resolver("gp.teacher"):
    OmegaConf.register_new_resolver("gp.teacher", teacher_dir)
    OmegaConf.register_new_resolver("gp.teacher_reference", teacher_reference)
    OmegaConf.register_new_resolver("gp.teacher_latency", teacher_latency)


def record(directory: str | Path = TEACHER_DIR) -> dict:
    """``teacher.json`` of a kept teacher: how it was made, its scores, its weights' sha256."""
    return json.loads((Path(directory) / RECORD).read_text())


def score_teacher(directory: str | Path, overrides: Sequence[str] = ()) -> dict:
    """BLEU of the model in ``directory``: the full validation and test splits (greedy, as ``gatedprune-evaluate``
    scores them), and the first ``SCORED_PAIRS`` test pairs at one torch thread (the suite's check)."""
    from gatedprune.reports.evaluate import evaluate_dir

    scores = {split: evaluate_dir(directory, split, overrides) for split in ("validation", "test")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = evaluate_dir(directory, "test", [*overrides, f"data.max_test_pairs={SCORED_PAIRS}"])
    finally:
        torch.set_num_threads(threads)
    return {"validation_bleu": scores["validation"]["bleu"], "test_bleu": scores["test"]["bleu"],
            "test_chrf": scores["test"]["chrf"], f"test_bleu_first_{SCORED_PAIRS}_one_thread": first["bleu"],
            "validation_pairs": scores["validation"]["sentences"], "test_pairs": scores["test"]["sentences"],
            "decoding": scores["test"]["decoding"]}


def make_teacher(run_dir: str | Path, out_dir: str | Path = TEACHER_DIR, *, overrides: Sequence[str] = (),
                 overwrite: bool = False, command: str | None = None) -> dict:
    """Write the dense model of ``run_dir`` (a finished ``experiment=converge`` run: its ``checkpoints/dense.ckpt``)
    to ``out_dir`` as a Hugging Face directory with its tokenizer and ``teacher.json``; returns the record.

    ``overrides``: the data settings the run was trained with, if not the embedded default's (scoring composes them
    as ``gatedprune-evaluate`` does). Written into a hidden sibling and renamed: nothing half-written is left.
    """
    from transformers import AutoTokenizer

    from gatedprune.shipping.export_dir import staged
    from gatedprune.training.checkpoints import checkpoint_model, load_checkpoint_file

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    checkpoint_path = run_dir / "checkpoints" / "dense.ckpt"
    if not checkpoint_path.is_file():
        raise ValueError(f"{checkpoint_path} does not exist; allowed: the directory of a finished "
                         "experiment=converge run (it saves checkpoints/dense.ckpt where it stops)")
    checkpoint = load_checkpoint_file(checkpoint_path)  # tensors and plain data only
    model = checkpoint_model(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").is_file() else {}
    metrics = json.loads((run_dir / "metrics.json").read_text()) if (run_dir / "metrics.json").is_file() else {}
    started = time.time()
    with staged(out_dir, overwrite) as stage:
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        scores = score_teacher(stage, overrides)
        made = {
            "what": "the converged dense model of the embedded default (gatedprune.teacher)",
            "command": command or f"python train.py experiment=converge hydra.run.dir={run_dir}",
            "steps": int(checkpoint["global_step"]),
            "converged": metrics.get("converged"),
            "run_status": status.get("status"),
            "scoring_overrides": list(overrides),
            **scores,
            "sha256": {WEIGHTS: sha256(stage / WEIGHTS)},
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "scored_in_s": round(time.time() - started, 1),
            "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        (stage / RECORD).write_text(json.dumps(made, indent=2) + "\n")
    return made
