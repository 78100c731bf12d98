"""Every gatedprune command's entry point: its arguments, and its errors in one line (``gatedprune.errors``).

Only entry points import this module (``gatedprune/__main__.py``, the console scripts, ``if __name__ ==
"__main__"`` blocks): it imports every command, so a module it imports must never import it back.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gatedprune.errors import reported_errors, run_hydra_app, run_reported
from gatedprune.versions import version


def train_command() -> None:
    """``gatedprune-train``, ``python -m gatedprune.train`` and a clone's ``python train.py``: one Hydra app.

    Its configs are the package's own (``gatedprune/conf``); a user's configs extend them with Hydra's
    ``--config-dir DIR`` (searched first). Runs write under the working directory (``outputs/``, ``multirun/``).
    """
    import hydra
    from omegaconf import DictConfig

    from gatedprune.train import train

    if sys.argv[1:] == ["--version"]:
        print(f"gatedprune {version()}")
        return

    @hydra.main(version_base="1.3", config_path="conf", config_name="train")
    def main(cfg: DictConfig) -> float | None:
        metrics = None  # a failed member of a -m sweep: recorded, and the sweep goes on (reported_errors)
        with reported_errors():  # bad input: `error: ...`, exit 2; a run that diverged or did not verify: exit 1
            metrics = train(cfg)
        # Hydra sweepers optimise the returned value; DDP processes other than rank 0 report nothing
        return float(metrics[cfg.optimized_metric]) if metrics else None

    set_offline_defaults()
    run_hydra_app(main)


def quiet_loading() -> None:
    """transformers' loading and saving bars off: a command says what it does in its own lines, and a refusal found
    after a model loads is still the one line on stderr."""
    import transformers

    transformers.utils.logging.disable_progress_bar()


def set_offline_defaults() -> None:
    """Never reach a hub from a run unless the user says so; W&B logs offline unless WANDB_MODE is set."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# ---- the commands: gatedprune-export, -sweep, -evaluate, -analyze (and python -m gatedprune <command>)


def export_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-export SOURCE OUT_DIR [--format FMT]``: prune the structures a gated run closed and write a
    verified, smaller model; or convert it (or any Hugging Face model directory) to a runtime's format."""
    import argparse
    import logging

    from gatedprune.deploy.formats import ALL_FORMATS

    parser = argparse.ArgumentParser(
        prog="gatedprune-export",
        description="Prune the structures a gated run closed and write a verified, smaller model; with --format, "
                    "convert it (or a model directory) for CTranslate2, ONNX Runtime or the stock transformers class.",
    )
    parser.add_argument("source", help="run directory (with metrics.json), Lightning checkpoint, or (with a --format "
                                       "other than hf) a Hugging Face model directory: an export, pruned or dense")
    parser.add_argument("out_dir", help="directory to write; must not exist or be empty unless --overwrite")
    parser.add_argument("--format", default="hf", choices=ALL_FORMATS, dest="fmt",
                        help="hf: the verified PyTorch export (default); ct2: CTranslate2; onnx: ONNX Runtime; "
                             "hf-portable: the stock transformers class (no trust_remote_code)")
    parser.add_argument("--quantization", default=None,
                        help="ct2 only: weight type, e.g. int8, int8_float32, float16 (default float32)")
    parser.add_argument(
        "--top-k", type=int, default=None, help="keep exactly N heads (largest log_alpha) instead of log_alpha > 0"
    )
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty out_dir (never the source run, nor a folder inside it)")
    parser.add_argument("--samples", type=int, default=8,
                        help="validation pairs to verify on, >= 1 (when the run has them)")
    parser.add_argument("--val-pairs", default=None, help="JSON-lines file of {source, target} pairs to verify on")
    parser.add_argument("--max-new-tokens", type=int, default=20,
                        help="length of the greedy generations compared, >= 1")
    parser.add_argument("--device", default="cpu", help="device for verification: cpu (default), cuda, cuda:N, mps")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_loading()
    rule = "binary" if args.top_k is None else "top-k"
    return run_reported(lambda: _export(args, rule))


def _export(args, rule: str) -> None:
    from pathlib import Path

    from gatedprune.deploy.sources import convert_source, is_model_dir
    from gatedprune.shipping.export import export_checkpoint

    if args.quantization is not None and args.fmt != "ct2":
        raise ValueError(f"--quantization {args.quantization} with --format {args.fmt}; allowed: with --format ct2")
    if args.fmt == "hf":
        if is_model_dir(Path(args.source)):
            raise ValueError(f"{args.source} is already a Hugging Face model directory; --format hf exports a run; "
                             f"allowed for a model directory: --format ct2, onnx or hf-portable")
        export_checkpoint(args.source, args.out_dir, rule=rule, top_k=args.top_k, overwrite=args.overwrite,
                          samples=args.samples, val_pairs=args.val_pairs, max_new_tokens=args.max_new_tokens,
                          device=args.device)
        return
    options = {"quantization": args.quantization} if args.fmt == "ct2" else {}
    convert_source(args.source, args.out_dir, args.fmt, val_pairs=args.val_pairs, samples=args.samples,
                   overwrite=args.overwrite, max_new_tokens=args.max_new_tokens, rule=rule, top_k=args.top_k,
                   device=args.device, **options)


def sweep_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-sweep DIR``: summary.csv, summary.md and pareto.png of a multirun."""
    import argparse
    from pathlib import Path

    from gatedprune.reports.sweep import log_to_wandb, summarise, sweep_name

    parser = argparse.ArgumentParser(
        prog="gatedprune-sweep", description="Summarise the runs of a multirun: summary.csv, summary.md, pareto.png."
    )
    parser.add_argument("multirun_dir", help="e.g. multirun/<date>/<time>; searched recursively for run folders")
    parser.add_argument("--out", default=None, help="where to write (default: multirun_dir)")
    parser.add_argument("--wandb", action="store_true", help="also log the table and plot to W&B (offline by default)")
    args = parser.parse_args(argv)
    out = Path(args.out or args.multirun_dir)

    def run() -> None:
        rows = summarise(args.multirun_dir, out)
        if args.wandb:
            log_to_wandb(rows, out / "pareto.png", sweep_name(args.multirun_dir), out)
        print((out / "summary.md").read_text(), end="")
        written = [out / name for name in ("summary.csv", "summary.md", "pareto.png", "pareto_params.png")]
        print("wrote " + ", ".join(str(path) for path in written if path.exists()))

    return run_reported(run)


def evaluate_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-evaluate MODEL_DIR [data overrides]``: BLEU, chrF, loss and speed on a split; writes eval.json."""
    import argparse
    from pathlib import Path

    from gatedprune.reports.evaluate import evaluate_dir

    from gatedprune.reports.scoring import score_table
    from gatedprune.utils import write_json

    parser = argparse.ArgumentParser(
        prog="gatedprune-evaluate",
        description="BLEU, chrF, loss and speed of a seq2seq model directory on a split of the trainer's data.",
    )
    parser.add_argument("model_dir", help="a Hugging Face seq2seq directory (a gatedprune export or any other)")
    parser.add_argument("overrides", nargs="*", help="the trainer's data options, e.g. data=files data.files.test=t.tsv")
    parser.add_argument("--split", default="test", help="train, validation or test (default test)")
    parser.add_argument("--num-beams", type=int, default=None, help="beam size (default: test_generation's, 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="sentences per batch (default: the data's)")
    parser.add_argument("--out", default=None, help="where to write the scores (default MODEL_DIR/eval.json)")
    args = parser.parse_intermixed_args(argv)  # options and data overrides in any order
    set_offline_defaults()  # a hub id is read from the cache unless the user says otherwise
    quiet_loading()

    def run() -> None:
        local = Path(args.model_dir).is_dir()  # a hub id gets a file here, not a folder named like it
        out = Path(args.out) if args.out else (Path(args.model_dir) / "eval.json" if local else
                                               Path(f"eval-{args.model_dir.replace('/', '--')}.json"))
        check_out_file(out, "--out")  # before the evaluation, which may take a while, not after it
        result = evaluate_dir(args.model_dir, args.split, args.overrides, args.num_beams, args.batch_size)
        write_json(out, result)
        print(score_table({f"{args.split} ({result['sentences']} sentences)": result}))
        print(f"sacreBLEU: {result['sacrebleu_signature']['bleu']}\nwrote {out}")

    return run_reported(run)


def check_out_file(out, option: str) -> None:
    """Refuse a file to write that is a directory, or lies under a file (``ValueError``, one line)."""
    if out.is_dir():
        raise ValueError(f"{option} {out} is a directory; allowed: a file path (e.g. {out / 'eval.json'})")
    # the nearest folder above that exists must be one: a file there would fail the write with NotADirectoryError
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"{option} {out}: {above} is a file, not a directory; allowed: a path under directories")


def analyze_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-analyze DIR``: every attention head's gate, importance, ablation effect and attention pattern."""
    import argparse
    from pathlib import Path

    from gatedprune.reports.analysis import DEFAULT_MAX_PAIRS, analyze

    from gatedprune.reports.head_report import write_report

    parser = argparse.ArgumentParser(
        prog="gatedprune-analyze",
        description="A report of every attention head (heads.csv, heads.md, layer x head heatmaps): gate, Michel "
                    "importance, loss increase when removed alone, attention confidence, entropy, positional and "
                    "rare-token attention.",
    )
    parser.add_argument("source", help="a run directory (its last checkpoint, gates included) or a model directory "
                                       "(an export, or any Hugging Face seq2seq model)")
    parser.add_argument("overrides", nargs="*", help="the trainer's data options (a model outside a run needs them, "
                                                     "e.g. data=files data.files.validation=dev.tsv)")
    parser.add_argument("--split", default="validation", help="train, validation or test (default validation)")
    parser.add_argument("--max-pairs", type=int, default=DEFAULT_MAX_PAIRS,
                        help=f"analyse the first N pairs of the split (default {DEFAULT_MAX_PAIRS})")
    parser.add_argument("--out", default=None, help="where to write (default SOURCE/analysis)")
    args = parser.parse_intermixed_args(argv)
    set_offline_defaults()
    quiet_loading()

    def run() -> None:
        report = analyze(args.source, args.split, args.max_pairs, args.overrides)
        written = write_report(report, Path(args.out) if args.out else Path(args.source) / "analysis")
        print(f"{len(report.rows)} heads, {report.about['pairs']} {args.split} pairs: wrote "
              f"{', '.join(str(p) for p in written[:2])} and {len(written) - 2} heatmaps in {written[0].parent}")

    return run_reported(run)


def latency_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-latency MODEL_DIR OUT.json``: the latency fit of a model on this machine, for
    ``pruning.workload.table`` of a run elsewhere."""
    import argparse
    from pathlib import Path

    from gatedprune.costs.workload import Workload

    parser = argparse.ArgumentParser(
        prog="gatedprune-latency",
        description="Time a seq2seq model and cut copies of it here (the server it will run on) and write the latency "
                    "fit a training run elsewhere takes as pruning.workload.table=OUT.json.")
    parser.add_argument("model_dir", help="a Hugging Face seq2seq directory with the shapes the run prunes")
    parser.add_argument("out", help="the table to write (.json)")
    defaults = Workload()
    for name in ("source_tokens", "target_tokens", "batch", "num_beams", "threads", "repeats"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--runtime", default=defaults.runtime, help="torch (generate()) or ct2 (CTranslate2)")
    parser.add_argument("--device", default=defaults.device, help="cpu or cuda")
    parser.add_argument("--quantization", default=None, help="ct2 only: the compute type to time (int8, ...)")
    # a table prices every run given it: held to what a run keeps for later runs (keep_tolerance), refused beyond
    parser.add_argument("--fit-tolerance", type=float, default=defaults.keep_tolerance,
                        help="time the probes again while the fit misses one by more than this fraction; still off "
                             "after the last timing: refused")
    parser.add_argument("--fit-attempts", type=int, default=defaults.fit_attempts, help="timings of the probes at most")
    args = parser.parse_args(argv)
    set_offline_defaults()
    quiet_loading()

    def run() -> None:
        from gatedprune.costs import table
        from gatedprune.costs.latency import LatencyFitError, fit_error, fit_latency
        from gatedprune.costs.timers import TIMERS
        from gatedprune.surgery.model_loading import load_seq2seq

        out = Path(args.out)
        check_out_file(out, "OUT")
        import re

        try:
            workload = Workload(**{k: getattr(args, k) for k in ("source_tokens", "target_tokens", "batch", "num_beams",
                                                                 "threads", "repeats", "runtime", "device",
                                                                 "quantization", "fit_tolerance", "fit_attempts")},
                                keep_tolerance=args.fit_tolerance)
        except ValueError as err:  # named as this command takes it: --num-beams, not pruning.workload.num_beams
            raise ValueError(re.sub(r"pruning\.workload\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(err)))
        model = load_seq2seq(args.model_dir).float().eval()
        key = table.key(model, workload)
        try:
            cost, probes = fit_latency(model, workload, TIMERS[workload.runtime])
        except LatencyFitError as err:  # its settings are this command's flags
            raise err.for_command() from None
        table.save(out, key, cost, probes)
        print(f"wrote {out}: {1000 * cost.base:.2f} ms per call + per structure "
              + ", ".join(f"{k} {1000 * v:.4f} ms" for k, v in cost.coefficients.items()) + f" ({key['device']}; "
              f"largest error over its {len(probes)} probes {fit_error(probes):.1%})")

    return run_reported(run)


def finetune_command(argv: Sequence[str] | None = None) -> int:
    """``gatedprune-finetune PRUNED_DIR --teacher DIR [overrides]``: recover an existing export (``pruning=recover``)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="gatedprune-finetune",
        description="Fine-tune a pruned export on the trainer's data, with the teacher it was pruned from for "
                    "sequence-level targets and distillation; the gates are not run again. Writes RUN/metrics.json "
                    "and the fine-tuned model in RUN/pruned_finetuned (finetune.out_dir).",
    )
    parser.add_argument("pruned_dir", help="a directory written by gatedprune (a run's pruned/, gatedprune-export)")
    parser.add_argument("overrides", nargs="*", help="the trainer's options, e.g. finetune.steps=2000 "
                        "finetune.targets=dense_greedy data=files data.files.train=train.tsv")
    parser.add_argument("--teacher", required=True,
                        help="the dense model it was pruned from: a model directory, a hub id, a dense run of "
                             "train.py (or its .ckpt), or 'kept' (the repository's teacher/)")
    parser.add_argument("--out", default=None, help="the run directory (default outputs/<date>/<time>)")
    args = parser.parse_intermixed_args(argv)
    teacher = Path(args.teacher)
    if args.teacher == "kept":  # the repository's teacher/
        model = ["model=teacher"]
    elif teacher.suffix == ".ckpt" or (teacher / "checkpoints").is_dir():  # a dense run of train.py, or its checkpoint
        from gatedprune.training.rundir import recorded_command

        run = teacher.parents[1] if teacher.suffix == ".ckpt" else teacher
        # the model it trained (its group and model.* options, as recorded), not today's default model
        model = [*recorded_command(run, groups=("model",)), f"resume={args.teacher}"]
    else:
        model = ["model=pretrained", f"model.name_or_path={args.teacher}", "dense_steps=0"]
    hydra_args = ["pruning=recover", f"pruning.pruned={args.pruned_dir}", *model, *args.overrides]
    if args.out:
        hydra_args.append(f"hydra.run.dir={args.out}")
    sys.argv = ["gatedprune-finetune", *hydra_args]
    return train_command()


COMMANDS = {"train": train_command, "finetune": finetune_command, "export": export_command, "sweep": sweep_command, "evaluate": evaluate_command,
            "analyze": analyze_command, "latency": latency_command}


if __name__ == "__main__":  # this module holds the commands' entry points; it is no command itself
    print("error: python -m gatedprune.cli is not a command; run python -m gatedprune "
          f"{{{','.join(COMMANDS)}}} [arguments] (or gatedprune-<command>)", file=sys.stderr)
    sys.exit(2)

