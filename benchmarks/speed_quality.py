"""Test BLEU against measured speed-up: the gates against what a user would pick instead (issue 25, part 5).

Every method starts from one dense checkpoint (``--source``: a run whose ``checkpoints/dense.ckpt`` is the converged
model, ``experiment=converge``) and gets the same training after it: the gates ``--gated-steps`` gated steps then
``--finetune-steps`` of fine-tuning their export; the methods that train nothing before their export fine-tune it
for both (``finetune.steps`` = gated + fine-tuning steps); the dense reference is the checkpoint given exactly that
training. The smaller dense models trained from scratch take the checkpoint's steps and those after it, in all.

    # train what is missing (one run after the other, one torch thread; a run already done is kept)
    .venv/bin/python benchmarks/speed_quality.py train --source RUNS/converged --runs RUNS/sq
    # time every shipped model against the dense one in one process, then write the page, its .json and plot
    .venv/bin/python benchmarks/speed_quality.py measure --source RUNS/converged --runs RUNS/sq --out docs/speed_quality
    .venv/bin/python benchmarks/speed_quality.py --quick --out DIR   # both, on the smoke model (the suite's check)
    # a grid whose runs were lost with a machine: time the runs trained since, keep the earlier measurement's rows
    # (the checkpoint lost too: they are timed against an untrained dense model of its shapes, stand_in_reference)
    .venv/bin/python benchmarks/speed_quality.py measure ... --keep docs/benchmarks/speed_quality.json --out docs/benchmarks

``GRID`` is the table of methods: a new one is a row. A latency target is the predicted latency kept
(``pruning.target_latency``, ``pruning=random``'s ``pruning.latency``); what each model ships at is then measured:
greedy, exactly ``--new-tokens`` tokens per sentence, ``generate()`` and CTranslate2 float32, batch 1 (each of
``--sentences`` sources alone) and batch 32, CPU time, one thread, every model timed in turn (median of repeats).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ONE_KIND_PROBES, ROOT, command_line, machine, versions, workload_overrides  # noqa: E402
from runtimes import Variant, timed  # noqa: E402

from gatedprune import load_pruned  # noqa: E402
from gatedprune.costs.build import latency_cost  # noqa: E402
from gatedprune.costs.workload import Workload  # noqa: E402
from gatedprune.reports.speed import random_sources  # noqa: E402
from gatedprune.structures.kinds import ALL_KINDS  # noqa: E402
from gatedprune.training.checkpoints import load_gated_checkpoint  # noqa: E402
from gatedprune.utils import atomic_write_text, markdown_table  # noqa: E402

HEADS = "[encoder,decoder,cross]"
HEADS_FFN = "[encoder,decoder,cross,encoder_ffn,decoder_ffn]"
EVERY = f"[{','.join(ALL_KINDS)}]"
# the gates on every kind with a short gated phase (its budget falls in 50 steps): the protocols that fine-tune longer
SHORT_GATES = ("pruning=l0_budget", f"pruning.kinds={EVERY}", "pruning.target_latency={t}",
               "pruning.target_warmup_steps=50")


@dataclasses.dataclass(frozen=True)
class Method:
    """One line of the plot: how its runs are launched. ``target``: one run per latency target (``{t}`` in the
    overrides); ``trains_first``: the gates' own training counts as gated steps, else the export is fine-tuned for
    gated + fine-tuning steps; ``scratch``: trained from scratch for the checkpoint's steps and those after it."""

    name: str
    label: str
    overrides: tuple[str, ...]
    target: bool = True
    trains_first: bool = False
    scratch: bool = False
    costed: bool = False  # budgets a predicted latency: takes the --workload settings (its fit cached once)
    gated_steps: int | None = None  # the gates' share of the training after the checkpoint, if not --gated-steps


GRID = (
    Method("gates_heads", "gates: heads", ("pruning=l0_budget", f"pruning.kinds={HEADS}", "pruning.target_latency={t}"),
           trains_first=True, costed=True),
    Method("gates_heads_ffn", "gates: heads + FFN",
           ("pruning=l0_budget", f"pruning.kinds={HEADS_FFN}", "pruning.target_latency={t}"), trains_first=True,
           costed=True),
    Method("gates_all", "gates: heads + FFN + layers",
           ("pruning=l0_budget", f"pruning.kinds={EVERY}", "pruning.target_latency={t}"), trains_first=True,
           costed=True),
    Method("gates_all_ft", "gates: every kind, 100 gated + 300 fine-tuning steps", SHORT_GATES,
           trains_first=True, costed=True, gated_steps=100),
    # the same split with CoFiPruning's distillation from the dense model in both phases (output KL at weight 0.5,
    # layer outputs through the learned map at 1.0: both terms near the cross-entropy's size at the start of the
    # fine-tuning of these exports), and with sequence-level distillation in the fine-tuning
    Method("gates_all_kd", "gates: every kind, 100 + 300, distilled (output + layers)",
           (*SHORT_GATES, "pruning.distill.alpha=0.5", "pruning.distill.hidden=1.0",
            "pruning.distill.layer_map=nearest", "finetune.distill=true"), trains_first=True, costed=True, gated_steps=100),
    Method("gates_all_seqkd", "gates: every kind, 100 + 300, seq-KD fine-tuning",
           (*SHORT_GATES, "finetune.targets=dense_greedy", "finetune.cache_dir={cache}"), trains_first=True, costed=True,
           gated_steps=100),
    Method("random", "random, same predicted latency", ("pruning=random", f"pruning.kinds={EVERY}",
                                                        "pruning.latency=[{t}]"), costed=True),
    Method("even_layers", "even decoder layers", ("pruning=even_layers", "pruning.decoder_layers={layers}"),
           target=False),
    Method("even_layers_seqkd", "even decoder layers + seq-KD",
           ("pruning=even_layers", "pruning.decoder_layers={layers}", "finetune.targets=dense_greedy",
            "finetune.cache_dir={cache}"), target=False),
    Method("scratch_decoder_1", "dense from scratch, 1 decoder layer", ("model.from_scratch.decoder_layers=1",),
           target=False, scratch=True),
    Method("scratch_narrow", "dense from scratch, FFN 512, 2 decoder layers",
           ("model.from_scratch.decoder_layers=2", "model.from_scratch.encoder_ffn_dim=512",
            "model.from_scratch.decoder_ffn_dim=512"), target=False, scratch=True),
    Method("dense", "dense, the same training", ("pruning=random", "pruning.heads={heads}"), target=False),
)
NOISE = "dense checkpoint, a second copy"  # timed beside the first: the clock's spread
TARGETS = (0.67, 0.5, 0.33)  # predicted latency kept: about 1.5x, 2x, 3x
SEEDS = (1234, 1, 2)  # every point at the first; the 2x point (0.5) at all three


@dataclasses.dataclass(frozen=True)
class Run:
    method: Method
    target: float | None
    seed: int

    @property
    def slug(self) -> str:
        return f"{self.method.name}{'' if self.target is None else f'-lat{self.target:g}'}-s{self.seed}"


def plan_runs(methods=GRID, targets=TARGETS, seeds=SEEDS, scratch: bool = True) -> list[Run]:
    """Every run of the grid, in the order they are trained: each point at the first seed, then the other seeds
    (every seed at the 0.5 target, and for the methods that take none), then the from-scratch models (once each:
    the longest)."""
    first, more, last = [], [], []
    for method in methods:
        if method.scratch:
            last += [Run(method, None, seeds[0])] if scratch else []
            continue
        for target in (targets if method.target else (None,)):
            first.append(Run(method, target, seeds[0]))
            if target in (0.5, None):
                more += [Run(method, target, seed) for seed in seeds[1:]]
    return first + more + last


# what this page's runs were made with before the default became the kept teacher and the recovery recipe: the
# model trained from scratch (the checkpoint forked) and the fine-tune of 100 steps at a constant 1e-4
MEASURED_WITH = ("model=scratch_mbart", "finetune=short")


def overrides(run: Run, source: Path, runs_dir: Path, steps: dict, settings: dict) -> list[str]:
    """train.py's command line for ``run``."""
    after = steps["gated"] + steps["finetune"]  # the training every method gets after the checkpoint
    gated = run.method.gated_steps if run.method.gated_steps is not None else steps["gated"]
    tuning, total = after - gated, steps["checkpoint"] + after
    # the dense model's translations for sequence-level distillation: made once, by the first run that needs them
    fill = {"t": run.target, "heads": settings["heads"], "layers": settings["layers"], "cache": runs_dir / "seqkd_cache"}
    args = [part.format(**fill) for part in run.method.overrides]
    args += [f"hydra.run.dir={runs_dir / run.slug}", f"seed={run.seed}", *MEASURED_WITH, *settings.get("extra", ())]
    if run.method.scratch:  # the same data and schedule, every step dense, then shipped as it is: a dense run of
        # the heads' L0 (the default's speed target would refuse a run with no gated step), no fine-tuning after it
        return [*args, "pruning=l0", "resume=auto", f"dense_steps={total}", f"trainer.max_steps={total}",
                "finetune.steps=0"]
    args += [f"resume={source / 'checkpoints' / 'dense.ckpt'}", f"gated_steps={gated}"]
    args += workload_overrides(settings["workload"]) if run.method.costed else []
    return [*args, f"finetune.steps={tuning if run.method.trains_first else after}"]


def fit_latency_once(source: Path, workload: dict) -> dict:
    """The latency fit every costed run of the grid uses, measured here before any of them starts (on a quiet
    machine) and cached beside the checkpoint, where the runs look it up (``gatedprune.costs.build``)."""
    model, _ = load_gated_checkpoint(source / "checkpoints" / "dense.ckpt")  # gated, as a run's model is
    _, info = latency_cost(model, Workload(**workload), [source / "checkpoints"])
    print(f"latency fit: {info['source']} ({info['path']})", flush=True)
    return info


def train_missing(runs: list[Run], source: Path, runs_dir: Path, steps: dict, settings: dict,
                  worker: tuple[int, int] = (0, 1)) -> dict:
    """Run train.py for each run without a metrics.json (worker i of n: every n-th run from the i-th, so that n
    processes share a grid); a target below a method's floor is noted, not a failure."""
    refused_path = runs_dir / "refused.json"
    refused = json.loads(refused_path.read_text()) if refused_path.is_file() else {}
    env = _env()
    mine = [run for i, run in enumerate(runs) if i % worker[1] == worker[0]]
    if any(run.method.costed for run in mine):
        fit_latency_once(source, settings["workload"])
    for i, run in enumerate(mine):
        if done(runs_dir / run.slug) or run.slug in refused:
            continue
        lock = runs_dir / f"{run.slug}.pid"
        if not claim(lock):
            print(f"[{i + 1}/{len(mine)}] {run.slug}: running in another process ({lock}), left to it", flush=True)
            continue
        if not run.method.scratch:  # a fork cut off before its end starts again; a from-scratch run goes on
            shutil.rmtree(runs_dir / run.slug, ignore_errors=True)
        args = overrides(run, source, runs_dir, steps, settings)
        print(f"[{i + 1}/{len(mine)}] {run.slug}: train.py {' '.join(args)}", flush=True)
        # its output to a file, not a pipe: a run outlives this script if the script is stopped
        log = runs_dir / f"{run.slug}.log"
        with open(log, "w") as out:
            child = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
            lock.write_text(f"{child.pid}\n")  # the run's own process: it may outlive this script
            child.wait()
        lock.unlink(missing_ok=True)
        output = log.read_text(errors="replace")
        error = next((line for line in output.splitlines() if line.startswith("error: ")), "")
        if child.returncode == 2 and "below what removing every gated structure reaches" in error:
            refused[run.slug] = error.removeprefix("error: ")
            if refused_path.is_file():  # another worker's refusals since this one read the file
                refused = {**json.loads(refused_path.read_text()), **refused}
            atomic_write_text(refused_path, json.dumps(refused, indent=2) + "\n")
            print(f"  refused: {refused[run.slug]}")
        elif child.returncode != 0:
            raise SystemExit(f"{run.slug} failed (exit {child.returncode}): {error or output[-2000:]} (all of it: {log})")
    return refused


def claim(lock: Path) -> bool:
    """Take ``lock`` (``<runs>/<slug>.pid``) for this process, unless the process it names is alive: a run of the
    grid is trained by one process at a time, however many scripts share the grid (``--only`` lists may overlap)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text())
                if pid > 0:
                    os.kill(pid, 0)  # signal 0: only asks whether it is alive
                    return False
            except (ValueError, ProcessLookupError, FileNotFoundError):  # stale: its process ended
                pass
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as out:
            out.write(f"{os.getpid()}\n")
        return True
    return False


def done(run_dir: Path) -> bool:
    """A run that finished (its metrics.json is written before its fine-tuning, its status at the very end)."""
    status = run_dir / "status.json"
    return status.is_file() and json.loads(status.read_text()).get("status") == "done"


def _env() -> dict:
    """One torch thread per run (two 2-thread processes on 2 cores slow each other several-fold), offline."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}


def shipped(run_dir: Path) -> list[tuple[str, Path, Path]]:
    """(point, model directory, its metrics.json) of what a run ships: its fine-tuned export, else its export."""
    level_dirs = sorted((run_dir / "levels").glob("*/metrics.json"))
    out = []
    for path in level_dirs or [run_dir / "metrics.json"]:
        model = path.parent / ("pruned_finetuned" if (path.parent / "pruned_finetuned").is_dir() else "pruned")
        out.append((path.parent.name if level_dirs else "", model, path))
    return out


def test_bleu(metrics: dict) -> float:
    test = metrics["test"]
    return (test.get("pruned") or test["dense"])["bleu"]


@dataclasses.dataclass
class Reference:
    """What every model is timed against: the dense checkpoint (``load`` gives a fresh copy of it each call, ungated),
    its tokenizer, and where it came from (``stand_in``: why it is not the checkpoint itself)."""

    load: Callable[[], transformers.PreTrainedModel]
    tokenizer: transformers.PreTrainedTokenizerBase
    source: Path
    stand_in: str | None = None


# what decides a dense model's time at a fixed number of tokens: recorded with every measurement, checked on a stand-in
SHAPE_FIELDS = ("model_type", "vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "activation_function",
                "tie_word_embeddings")


def shapes(model: transformers.PreTrainedModel) -> dict:
    return {field: getattr(model.config, field, None) for field in SHAPE_FIELDS}


def checkpoint_reference(source: Path) -> Reference:
    def load():
        model, gates = load_gated_checkpoint(source / "checkpoints" / "dense.ckpt")
        gates.remove()
        return model

    return Reference(load, transformers.AutoTokenizer.from_pretrained(source / "tokenizer"), source)


def stand_in_reference(source: Path, runs_dir: Path, earlier: dict) -> Reference:
    """The checkpoint lost with its machine: a dense model of its shapes, untrained, built from the model config of
    ``experiment=converge`` (the run that made it) and the tokenizer of a run of the grid (each trains the same one).
    The timings generate exactly ``--new-tokens`` tokens per sentence, so weights do not change them. Its parameter
    count must be the earlier measurement's checkpoint's, and its shapes too where that measurement recorded them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from gatedprune.surgery.model_loading import load_model

    tokenizers = sorted(runs_dir.glob("*/tokenizer/tokenizer.json"))
    if not tokenizers:
        raise SystemExit(f"error: {source / 'checkpoints' / 'dense.ckpt'} is missing and no run under {runs_dir} "
                         "has a tokenizer to build a stand-in of its shapes with; allowed: a --runs holding the runs "
                         "trained since the checkpoint was lost")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizers[0].parent)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model_cfg = compose("train", overrides=["experiment=converge", "paths.output_dir=."]).model

    def load():
        torch.manual_seed(0)  # both copies one model, as the checkpoint and its copy were
        return load_model(tokenizer, from_scratch=OmegaConf.to_container(model_cfg.from_scratch),
                          attn_implementation=model_cfg.attn_implementation).eval()  # built in training mode

    model = load()
    params, then = sum(p.numel() for p in model.parameters()), earlier["rows"][0]["params"]
    recorded = earlier.get("checkpoint_shapes")
    if params != then or (recorded is not None and recorded != shapes(model)):
        mine = f"{params:,} parameters" + (f" and shapes {shapes(model)}" if recorded is not None else "")
        theirs = f"{then:,}" + (f" and {recorded}" if recorded is not None else "")
        raise SystemExit(f"error: a stand-in for the lost checkpoint (experiment=converge's model config, the "
                         f"tokenizer of {tokenizers[0].parent}) has {mine}, the checkpoint of the --keep measurement "
                         f"{theirs}; allowed: a stand-in of the checkpoint's shapes")
    why = (f"the dense checkpoint was lost with its machine, so they were timed against an untrained dense model of "
           f"its shapes ({params:,} parameters: experiment=converge's model config, the tokenizer of "
           f"{tokenizers[0].parent}; a second copy of it is the noise floor)")
    return Reference(load, tokenizer, source, why)


def measure(runs: list[Run], reference: Reference, runs_dir: Path, timing: dict) -> dict:
    """Every shipped model and the dense checkpoint, converted to CTranslate2, timed in turn; one row each."""
    with tempfile.TemporaryDirectory(prefix="speed-quality-") as work:  # the CTranslate2 conversions
        return _measure(runs, reference, runs_dir, timing, Path(work))


def _measure(runs: list[Run], reference: Reference, runs_dir: Path, timing: dict, work: Path) -> dict:
    tokenizer, source = reference.tokenizer, reference.source
    dense = reference.load()
    copy = reference.load()  # the noise floor: what the clock says between two identical models
    variants = [Variant("dense checkpoint", dense, tokenizer, work, onnx=False),
                Variant("dense checkpoint copy", copy, tokenizer, work, onnx=False)]
    rows = [{"method": method, "run": str(source), "point": "", "seed": None, "target": None, "test_bleu": None,
             "params": variants[i].params, "predicted_speed_up": 1.0, "variant": i}
            for i, method in enumerate(("dense checkpoint", NOISE))]
    for run in runs:
        if not done(runs_dir / run.slug):
            continue
        for point, model_dir, metrics_path in shipped(runs_dir / run.slug):
            metrics = json.loads(metrics_path.read_text())
            name = f"{run.slug}/{point}" if point else run.slug
            variants.append(Variant(name.replace("/", "-"), load_pruned(model_dir), tokenizer, work, onnx=False))
            predicted = ((metrics.get("export") or {}).get("predicted") or {}).get("speed_up")
            rows.append({"method": run.method.label, "run": name, "metrics": str(metrics_path), "point": point,
                         "seed": run.seed,
                         "target": run.target, "test_bleu": test_bleu(metrics), "params": variants[-1].params,
                         "predicted_speed_up": predicted, "variant": len(variants) - 1})
    sources = random_sources(dense, 32, timing["source_tokens"]).tolist()
    times = {}
    for batch in (1, 32):
        batches = [[s] for s in sources[: timing["sentences"]]] if batch == 1 else [sources]
        times[batch] = timed(variants, ["transformers", "ct2 float32"], batches, 1, timing["new_tokens"],
                             timing["repeats"])
        print(f"batch {batch} timed", file=sys.stderr, flush=True)
    for row in rows:
        name = variants[row.pop("variant")].name
        for batch, cells in times.items():
            for runtime in ("transformers", "ct2 float32"):
                reference, mine = cells[(variants[0].name, runtime)], cells[(name, runtime)]
                row[f"{runtime} b{batch}"] = {"cpu_s": mine.cpu, "wall_s": mine.wall,
                                               "speed_up": reference.cpu / mine.cpu}
        # CTranslate2 against generate(): what the runtime alone adds
        generate, ct2 = times[1][(variants[0].name, "transformers")], times[1][(name, "ct2 float32")]
        row["ct2_over_generate_b1"] = generate.cpu / ct2.cpu
    return {"rows": rows, "checkpoint_shapes": shapes(dense)}


def noise_floor(results: dict) -> str:
    """What the second copy of the dense checkpoint reads against the first: the spread of identical models."""
    row = next((r for r in results["rows"] if r["method"] == NOISE), None)
    if row is None:  # measured before the copy was timed
        return ""
    cells = ", ".join(f"{row[key]['speed_up']:.2f}x" for key in ("transformers b1", "transformers b32",
                                                               "ct2 float32 b1", "ct2 float32 b32"))
    return (f"Noise floor: a second copy of the dense checkpoint, timed with the others, reads {cells} "
            "(generate() b1, b32; CTranslate2 b1, b32): gaps of that size between methods are the clock's.")


OVER_GENERATE = "ct2 float32 b1 over dense generate()"


def ct2_gains(results: dict) -> str:
    """The dense model's generate() time over its CTranslate2 time at batch 1, in each measurement rows come from."""
    gains = results.get("ct2_gains") or {results.get("date") or "this measurement": results["ct2_gain_b1"]}
    return "; ".join(f"{date}: " + ("not recorded" if gain is None else f"{gain:.2f}x") for date, gain in gains.items())


def summary(results: dict) -> dict:
    """The references and, per method and point, the mean and spread over seeds."""
    rows = [r for r in results["rows"] if r["seed"] is not None]
    dense = [r["test_bleu"] for r in rows if r["method"] == "dense, the same training"]
    points: dict = {}
    for row in rows:
        points.setdefault((row["method"], row["target"], row["point"]), []).append(row)
    means = []
    for (method, target, point), group in points.items():
        bleu = torch.tensor([r["test_bleu"] for r in group], dtype=torch.float64)
        speed = {key: sum(r[key]["speed_up"] for r in group) / len(group)
                 for key in ("transformers b1", "transformers b32", "ct2 float32 b1", "ct2 float32 b32")}
        # CTranslate2 against the dense model's generate() timed beside it: the dense model's own CTranslate2 gain
        # differed between the machines of two measurements (2.53x, 5.32x), so rows kept from one and timed in the
        # other share no CTranslate2 reference; generate()'s ratios of one shape agreed on both
        over_generate = sum(r["ct2_over_generate_b1"] for r in group) / len(group)
        means.append({"method": method, "target": target, "point": point, "seeds": len(group),
                      "test_bleu": bleu.mean().item(), "test_bleu_sd": bleu.std().item() if len(group) > 1 else None,
                      **speed, OVER_GENERATE: over_generate})
    reference = sum(dense) / len(dense) if dense else None
    checkpoint = results["checkpoint_test_bleu"]
    target_met = [m for m in means if checkpoint is not None and m["transformers b1"] >= 2
                  and m["test_bleu"] >= checkpoint - 0.5]
    return {"dense_same_training": reference, "points": means, "target_met": target_met}


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = summary(results)["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 6), sharey=True)
    for ax, key, title in ((axes[0], "transformers b1", "generate(), batch 1"),
                           (axes[1], OVER_GENERATE, "CTranslate2 float32, batch 1 (against dense generate())")):
        for method in dict.fromkeys(p["method"] for p in points):
            mine = sorted((p for p in points if p["method"] == method), key=lambda p: p[key])
            x = [p[key] for p in mine]
            ax.errorbar(x, [p["test_bleu"] for p in mine], yerr=[p["test_bleu_sd"] or 0 for p in mine], marker="o",
                        capsize=3, label=method)
        ax.axhline(results["checkpoint_test_bleu"], color="k", lw=0.8)
        ax.axhline(results["checkpoint_test_bleu"] - 0.5, color="k", lw=0.8, ls="--")
        if key == "transformers b1":  # the target's 2x is over the dense generate(), not over CTranslate2 alone
            ax.axvline(2, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("measured speed-up over the dense model's generate() (CPU time, one thread)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test BLEU (solid: the dense checkpoint; dashed: 0.5 below)")
    handles, labels = axes[1].get_legend_handles_labels()  # below both panels: inside, it hid points
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(results: dict) -> str:
    s = summary(results)
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"Measured with `{results['command']}` ({results['machine']}; {results['versions']}).", "",
             f"From `{results['source']}` (dense checkpoint at step {results['checkpoint_step']}, test BLEU "
             f"{results['checkpoint_test_bleu']:.2f}); after it every method trains {results['steps']['gated']} + "
             f"{results['steps']['finetune']} steps (gated + fine-tuning; the others fine-tune for both), the dense "
             f"model given the same: test BLEU {fmt(s['dense_same_training'])}. Speed-up: CPU time of the dense "
             f"checkpoint's `generate()` over this model's, greedy, {results['timing']['new_tokens']} tokens per "
             f"sentence, one thread, every model timed in turn (median of {results['timing']['repeats']}); "
             "CTranslate2 columns against the dense model in CTranslate2 of the same measurement (CTranslate2 alone "
             f"at batch 1, {ct2_gains(results)}), the last column against the dense model's `generate()`. Test split, "
             "greedy.",
             ""]
    header = ["method", "target", "point", "seeds", "test BLEU", "generate() b1", "b32", "ct2 b1", "ct2 b32",
              "ct2 b1 over dense generate()"]
    rows = [(p["method"], fmt(p["target"], "g"), p["point"] or "-", p["seeds"],
             fmt(p["test_bleu"]) + (f" ± {p['test_bleu_sd']:.2f}" if p["test_bleu_sd"] is not None else ""),
             *(f"{p[k]:.2f}x" for k in ("transformers b1", "transformers b32", "ct2 float32 b1", "ct2 float32 b32",
                                        OVER_GENERATE)))
            for p in s["points"]]
    lines += [markdown_table(header, rows), "![test BLEU against measured speed-up](speed_quality.png)", ""]
    noise = noise_floor(results)
    lines += [noise, ""] if noise else []
    met = s["target_met"]
    lines.append("**Target (at least 2x greedy batch 1, within 0.5 BLEU of the dense checkpoint): "
                 + ("met by " + ", ".join(f"{m['method']} ({m['transformers b1']:.2f}x, {m['test_bleu']:.2f})"
                                            for m in met) if met else "missed") + ".**")
    checkpoint = results["checkpoint_test_bleu"]
    fast = [p for p in s["points"] if p["transformers b1"] >= 2]
    close = [p for p in s["points"] if checkpoint is not None and p["test_bleu"] >= checkpoint - 0.5
             and p["method"] != "dense, the same training"]
    if not met and checkpoint is not None:
        best = max(fast, key=lambda p: p["test_bleu"], default=None)
        quickest = max(close, key=lambda p: p["transformers b1"], default=None)
        lines.append("")
        lines.append("- at 2x or more: " + (f"best {best['test_bleu']:.2f} ({best['method']}, "
                                           f"{best['transformers b1']:.2f}x), {best['test_bleu'] - checkpoint:+.2f} "
                                           "BLEU" if best else "no model"))
        lines.append("- within 0.5 BLEU: " + (f"fastest {quickest['transformers b1']:.2f}x ({quickest['method']})"
                                              if quickest else "no pruned model"))
    if results.get("refused"):
        lines += ["", "Targets a method cannot reach (refused at set-up, nothing trained):", ""]
        lines += [f"- {slug}: {why}" for slug, why in results["refused"].items()]
    if results.get("kept_from"):
        lines += ["", f"Rows timed in an earlier measurement are kept from {results['kept_from']} (column `timed`), "
                      "each with its speed-ups against the dense checkpoint timed beside it then"
                  + (f"; that checkpoint scored {results['kept_checkpoint_test_bleu']:.2f} test BLEU then."
                     if results.get("kept_checkpoint_test_bleu") is not None else ".")]
    for date, why in results.get("stand_ins", {}).items():
        lines += ["", f"The rows timed on {date}: {why}."]
    lines += ["", "Every model (seed by seed):", ""]
    lines.append(markdown_table(
        ["run", "test BLEU", "params", "predicted", "generate() b1", "b32", "ct2 b1", "ct2 b32", "timed"],
        [(r["run"], fmt(r["test_bleu"]), f"{r['params']:,}",
          fmt(r["predicted_speed_up"]) + ("x" if r["predicted_speed_up"] else ""),
          *(f"{r[k]['speed_up']:.2f}x" for k in ("transformers b1", "transformers b32", "ct2 float32 b1",
                                                  "ct2 float32 b32")), r.get("measured") or results.get("date") or "-")
         for r in results["rows"]]))
    return "\n".join(lines)


def keep_earlier(results: dict, earlier: dict, path: Path) -> dict:
    """``results`` with the rows of an ``earlier`` measurement (its json, ``path``) for the runs not timed now, so
    a grid whose runs were lost with a machine grows by the runs trained since. Each kept row keeps the speed-ups it
    was measured with, against the dense checkpoint timed beside it then, and says when (``measured``); the earlier
    measurement must be of a checkpoint at the same step and training, and its refused targets stay refused unless
    timed now."""
    check_same_training(earlier, results["checkpoint_step"], results["steps"], path)
    timed = {row["run"] for row in results["rows"] if row["seed"] is not None}
    when = earlier.get("date") or f"an earlier measurement ({path.name})"
    kept = [{**row, "measured": row.get("measured") or when} for row in earlier["rows"]
            if row["seed"] is not None and row["run"] not in timed]
    slugs = {run.split("/")[0] for run in timed}  # a level's row is "<run>/<point>"; refusals name the run
    refused = {slug: why for slug, why in earlier.get("refused", {}).items() if slug not in slugs}
    # an earlier stand-in's note stays with the rows it timed
    dates = {row["measured"] for row in kept}
    stand_ins = {date: why for date, why in earlier.get("stand_ins", {}).items() if date in dates}
    # and so does what CTranslate2 alone gave in the measurement each kept row comes from
    gains = {date: earlier.get("ct2_gains", {}).get(date) for date in sorted(dates)}  # None: a json of before
    gains.update({when: earlier["ct2_gain_b1"]} if when in dates else {})
    merged = {**results, "rows": results["rows"] + kept, "refused": {**refused, **results["refused"]},
              "kept_from": f"{path} ({earlier.get('machine', 'machine not recorded')})",
              "stand_ins": {**stand_ins, **results.get("stand_ins", {})},
              "ct2_gains": {**results.get("ct2_gains", {}), **gains}}
    then, now = earlier.get("checkpoint_test_bleu"), results["checkpoint_test_bleu"]
    if now is None:  # no fork timed now (the from-scratch models only): the earlier score
        merged["checkpoint_test_bleu"] = then
        for row in merged["rows"][:2]:
            row["test_bleu"] = then
    elif then is not None and abs(now - then) > 0.005:  # a checkpoint trained again need not be the same model
        print(f"warning: the checkpoint scores {now:.2f} test BLEU now and {then:.2f} in {path}: the kept rows "
              "were forked from another model of that step", file=sys.stderr)
        merged["kept_checkpoint_test_bleu"] = then
    return merged


def check_same_training(earlier: dict, step: int, steps: dict, path: Path) -> None:
    """An earlier measurement is kept only beside one of the same checkpoint step and training after it."""
    if earlier.get("checkpoint_step") != step or earlier.get("steps") != steps:
        raise SystemExit(f"error: --keep {path} was measured from a checkpoint at step {earlier.get('checkpoint_step')} "
                         f"with {earlier.get('steps')} training steps, this measurement from step {step} with "
                         f"{steps}; allowed: a measurement of the same checkpoint and training")


def checkpoint_facts(source: Path) -> dict:
    saved = torch.load(source / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)
    model, gates = load_gated_checkpoint(source / "checkpoints" / "dense.ckpt")
    layers = model.config.decoder_layers
    return {"step": int(saved["global_step"]), "heads": gates.num_heads,
            "layers": "[" + ",".join(map(str, range(layers - 1, 0, -1))) + "]"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", choices=("train", "measure"), help="omit with --quick (both)")
    parser.add_argument("--source", type=Path, help="the run whose checkpoints/dense.ckpt every method starts from")
    parser.add_argument("--runs", type=Path, help="where the grid's runs go (one directory each)")
    parser.add_argument("--only", nargs="+", default=None, help="methods of GRID to train (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help=f"the first for every point, all at the 0.5 point (default: {' '.join(map(str, SEEDS))})")
    parser.add_argument("--no-scratch", action="store_true", help="leave out the from-scratch dense models")
    parser.add_argument("--gated-steps", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per model (and in the latency fit)")
    parser.add_argument("--sentences", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--worker", default="0/1", help="i/n: train every n-th run from the i-th (n processes)")
    parser.add_argument("--quick", action="store_true", help="the smoke model, a few runs, both stages")
    parser.add_argument("--out", type=Path, default=None, help="DIR: writes DIR/speed_quality.{md,json,png}")
    parser.add_argument("--keep", type=Path, default=None,
                        help="measure: an earlier speed_quality.json of the same checkpoint whose rows for runs not "
                             "timed now are kept, each with the speed-ups it was measured with then")
    args = parser.parse_args(argv)
    if args.keep and args.stage != "measure":
        parser.error("--keep is for the measure stage: it keeps an earlier measurement's rows beside what is timed")
    # the script times every model itself, side by side: the runs skip their own speed report
    # the grid's fit was timed on the probes of one kind each, before the joint probes: a resumed grid keeps it
    extra, workload, methods, targets, seeds = (["report.speed=false"], {"repeats": args.repeats, **ONE_KIND_PROBES},
                                                GRID, TARGETS, SEEDS)
    if args.quick:
        # the runs beside the page (the suite's tmp_path), else in a temporary directory removed at the end
        work = args.out / "quick-runs" if args.out else Path(tempfile.mkdtemp(prefix="speed-quality-quick-"))
        args.source, args.runs = work / "dense", work / "runs"
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "experiment=smoke", "trainer.max_steps=10",
                               f"hydra.run.dir={args.source}"], capture_output=True, text=True, env=_env())
        if proc.returncode:
            raise SystemExit(f"the smoke dense run failed: {proc.stderr[-2000:]}")
        extra = ["experiment=smoke", "data.max_train_pairs=60", "report.speed=false"]
        workload = {"repeats": 1, "source_tokens": 6, "target_tokens": 4}
        args.gated_steps, args.finetune_steps, args.repeats, args.sentences, args.new_tokens = 10, 2, 1, 2, 8
        methods = [m for m in GRID if m.name in ("gates_all", "random", "even_layers_seqkd", "scratch_decoder_1",
                                                 "dense")]
        targets, seeds = (0.85,), (1234,)  # the smoke model's floor is high: per-call time dominates it
    elif args.stage is None or args.source is None or args.runs is None:
        parser.error("train or measure, with --source and --runs (or --quick)")
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in GRID})
        if unknown:
            parser.error(f"--only names {', '.join(unknown)}; allowed: {', '.join(m.name for m in GRID)}")
        methods = [m for m in methods if m.name in args.only]
    seeds = tuple(args.seeds) if args.seeds else seeds
    if args.keep is not None and not args.keep.is_file():
        parser.error(f"--keep {args.keep}: no such file; allowed: an earlier speed_quality.json")
    earlier = json.loads(args.keep.read_text()) if args.keep else None
    checkpoint = args.source / "checkpoints" / "dense.ckpt"
    lost = earlier is not None and not checkpoint.is_file()
    if not checkpoint.is_file() and not lost:
        raise SystemExit(f"error: {checkpoint} is missing; allowed: a --source run that saved it (experiment=converge), "
                         "or measure --keep <its earlier speed_quality.json> to time the runs trained since it was lost")
    if lost and not {"checkpoint_step", "steps", "rows"} <= set(earlier):
        raise SystemExit(f"error: --keep {args.keep} does not say the lost checkpoint's step, training and parameters; "
                         "allowed: a speed_quality.json this script wrote")
    # a lost checkpoint's step is the earlier measurement's; nothing is trained from it
    facts = {"step": earlier["checkpoint_step"], "heads": None, "layers": None} if lost else checkpoint_facts(args.source)
    steps = {"checkpoint": facts["step"], "gated": args.gated_steps, "finetune": args.finetune_steps}
    settings = {"heads": facts["heads"], "layers": facts["layers"], "extra": extra, "workload": workload}
    if earlier is not None:  # refused before minutes of timing, not after
        check_same_training(earlier, facts["step"], steps, args.keep)
    # what the measurement times against, settled before anything is written
    reference = None if args.stage == "train" else (
        stand_in_reference(args.source, args.runs, earlier) if lost else checkpoint_reference(args.source))
    runs = plan_runs(methods, targets, seeds, scratch=not args.no_scratch)
    args.runs.mkdir(parents=True, exist_ok=True)
    refused = {}
    if args.quick or args.stage == "train":
        index, count = (int(part) for part in args.worker.split("/"))
        refused = train_missing(runs, args.source, args.runs, steps, settings, (index, count))
        if not args.quick:
            return 0
    refused_path = args.runs / "refused.json"
    refused = json.loads(refused_path.read_text()) if refused_path.is_file() else refused
    timing = {"repeats": args.repeats, "sentences": args.sentences, "new_tokens": args.new_tokens, "source_tokens": 32}
    results = measure(runs, reference, args.runs, timing)
    # the checkpoint's own test BLEU, as the runs that prune it scored it (the model pruned from)
    scored = [json.loads((args.runs / run.slug / "metrics.json").read_text())["test"] for run in runs
              if not run.method.scratch and done(args.runs / run.slug)]
    checkpoint_bleu = next((test["dense"]["bleu"] for test in scored if "dense" in test), None)
    for row in results["rows"][:2]:  # the checkpoint and its copy: one model
        row["test_bleu"] = checkpoint_bleu
    results.update(command=command_line("speed_quality.py", sys.argv[1:] if argv is None else argv),
                   machine=machine(), versions=versions(), source=str(args.source), checkpoint_step=facts["step"],
                   checkpoint_test_bleu=checkpoint_bleu, steps=steps, timing=timing, refused=refused,
                   ct2_gain_b1=results["rows"][0]["ct2_over_generate_b1"],
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    results["stand_ins"] = {results["date"]: reference.stand_in} if reference.stand_in else {}
    results["ct2_gains"] = {results["date"]: results["ct2_gain_b1"]}
    if args.keep:
        results = keep_earlier(results, earlier, args.keep)
    page = "# Speed against quality (issue 25, part 5)\n\n" + render(results)
    print(page)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(results, args.out / "speed_quality.png")
        atomic_write_text(args.out / "speed_quality.json", json.dumps(results, indent=2) + "\n")
        atomic_write_text(args.out / "speed_quality.md", page + "\n")
    elif args.quick:
        shutil.rmtree(args.source.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
