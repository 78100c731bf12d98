"""Inference speed of physically pruned models against the dense model they come from, and against the FLOPs.

Models (benchmarks/common.py, random weights): the default one (conf/model/scratch_mbart.yaml), a Transformer-base
Marian and a T5-base. Plans: a seeded fraction of all heads removed, spread over the three kinds (0% is an uncut copy,
which shows the noise); every encoder self-attention head removed; for the default model, the head counts the lambda
sweep ended with (docs/lambda_sweep.md); and the 50% plan only masked (gates at 0, nothing removed).

Each plan is timed against the dense model, alternately in one process, median of repeats, for a teacher-forced
forward pass and for generate() (greedy and beam 4, exactly --new-tokens tokens per sentence, KV cache on). Beside
each measured speed-up stands the one the FLOPs predict: the matrix-multiply and attention FLOPs of the same call,
counted by torch.utils.flop_counter. Then, per model: sizes, KV-cache bytes and peak memory of one generate call;
where the time of one pruned forward goes; and torch.compile and bf16 autocast on the 50% plan.

    .venv/bin/python benchmarks/speed.py [--quick] [--models default transformer-base t5-base] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, when run as a script or loaded by a test
from common import (  # noqa: E402
    MODELS, ROOT, alternate, command_line, even_plan, heads_kept, machine, random_plan, seconds, versions,
)

from gatedprune.surgery.cut import count_parameters, prune_heads  # noqa: E402

from gatedprune.structures.masking import masked_heads
from gatedprune.utils import atomic_write_text, format_table, markdown_table  # noqa: E402

# heads kept per kind (encoder, decoder, cross) of the default model's 24 each: the lambda sweep's results
SWEEP = [(2, 22, 24), (0, 14, 20), (0, 4, 12), (0, 0, 2)]
SHAPES = [(1, 32), (1, 128), (32, 32), (32, 128)]  # (sentences, source tokens)


@dataclass
class Grid:
    """What is run for one model: plans, (job, batch, length) cells, repeats, generated tokens."""

    fractions: tuple = (0.0, 0.25, 0.5, 0.75, 0.9)
    cells: list = field(default_factory=lambda: [(job, *s) for s in SHAPES for job in ("forward", "greedy", "beam4")])
    sweep_cells: list = field(default_factory=list)  # cells for the lambda-sweep plans (default model only)
    repeats: int = 3  # at batch 32
    repeats_batch1: int = 9  # batch-1 calls are short and swing more with the machine's load: more repeats, cheaply
    new_tokens: int = 32
    memory_cell: tuple = ("greedy", 32, 32)  # sizes, KV cache and peak memory are given for this call
    extras_cells: list = field(default_factory=lambda: [("forward", 32, 32), ("greedy", 1, 32)])  # compile, bf16
    vocab_size: int | None = None

    def repeats_for(self, batch: int) -> int:
        return self.repeats_batch1 if batch == 1 else self.repeats


# Budget on 2 shared cores (a full run is meant to stay near 25 minutes): the default model gets every cell but
# beam 4 at 32 x 128; the Transformer-base drops source length 128 at batch 32 and beam 4 at batch 32; T5-base
# (3.5x the Transformer-base's FLOPs) keeps three fractions, batch 1 and forward at 32 x 32, and no compile / bf16.
# Batch-1 calls take milliseconds, so they get more repeats at little cost.
FULL = {
    "default": Grid(
        cells=[cell for cell in Grid().cells if cell != ("beam4", 32, 128)],
        sweep_cells=[("forward", 32, 32), ("greedy", 32, 32)], memory_cell=("greedy", 32, 128),
    ),
    "transformer-base": Grid(
        cells=[("forward", 1, 32), ("forward", 1, 128), ("forward", 32, 32), ("greedy", 1, 32), ("greedy", 1, 128),
               ("greedy", 32, 32), ("beam4", 1, 32)],
        new_tokens=16,
    ),
    "t5-base": Grid(
        fractions=(0.0, 0.5, 0.9),
        cells=[("forward", 1, 32), ("forward", 1, 128), ("forward", 32, 32), ("greedy", 1, 32), ("greedy", 1, 128),
               ("beam4", 1, 32)],
        repeats_batch1=5, new_tokens=16, memory_cell=("greedy", 1, 128), extras_cells=[],
    ),
}
QUICK = {
    "default": Grid(
        fractions=(0.0, 0.5), cells=[("forward", 2, 8), ("greedy", 2, 8), ("beam4", 2, 8)],
        sweep_cells=[("forward", 2, 8)], repeats=1, repeats_batch1=1, new_tokens=4, memory_cell=("greedy", 2, 8),
        extras_cells=[("forward", 2, 8)], vocab_size=512,
    ),
}


# ---- the calls that are timed ------------------------------------------------------------------------------
def inputs(model, batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, model.config.vocab_size - 1, (batch, length), generator=g)  # (B, S)
    return {"input_ids": src, "attention_mask": torch.ones_like(src),
            "decoder_input_ids": torch.randint(3, model.config.vocab_size - 1, (batch, length), generator=g)}


def make_job(cell: tuple, model, new_tokens: int):
    """``job(model)`` for one cell: the call to time, returning its output (logits, or generate's output)."""
    kind, batch, length = cell
    x = inputs(model, batch, length)
    if kind == "forward":  # teacher-forced, target as long as the source
        return torch.no_grad()(lambda m: m(**x).logits)
    beams = {"greedy": 1, "beam4": 4}[kind]
    return torch.no_grad()(lambda m: m.generate(
        input_ids=x["input_ids"], attention_mask=x["attention_mask"], num_beams=beams, do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True,
    ))


def _sdpa_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


# torch's counter knows the GPU attention kernels; on CPU, sdpa runs this one (QK^T and AV, causal mask ignored)
FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop}


def count_flops(job, model) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with counter:
        job(model)
    return counter.get_total_flops()


def timed_pair(job, dense, other, repeats: int, flops: bool = True) -> dict:
    """Median seconds of dense and other, alternating, and the FLOPs of one call of each (the warm-up runs)."""
    counted = {}

    def warm_up(model):
        if flops:
            counted[id(model)] = count_flops(job, model)
        else:
            job(model)
            counted[id(model)] = None

    dense_t, other_t = alternate(job, [dense, other], repeats, warm_up=warm_up)
    return {"dense_s": dense_t.wall, "other_s": other_t.wall, "cpu_speed_up": dense_t.cpu / other_t.cpu,
            "dense_flops": counted[id(dense)], "other_flops": counted[id(other)]}


# ---- sizes and memory ---------------------------------------------------------------------------------------
def kv_cache_bytes(cache) -> tuple[int, int]:
    """Bytes of (decoder self-attention, cross-attention) keys and values in a generate() cache."""
    def total(part):
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in part.layers if layer.keys is not None)

    return total(cache.self_attention_cache), total(cache.cross_attention_cache)


def peak_bytes(job, model) -> int:
    """Peak of the bytes allocated during ``job(model)`` beyond what was allocated before (weights excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        job(model)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:  # nbytes > 0 allocates, < 0 frees
        now += event.nbytes()
        peak = max(peak, now)
    return peak


def file_bytes(model) -> int:
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return sum(p.stat().st_size for p in Path(d).glob("*.safetensors"))


# ---- where the time of one forward goes -----------------------------------------------------------------------
def module_groups(model) -> dict[str, list]:
    """Modules to time, by what they are: attention, feed-forward, output layer (the rest is embeddings, norms)."""
    from gatedprune.structures.adapters import attention_sites

    ffn = [m for name, m in model.named_modules() if name.endswith((".fc1", ".fc2", "DenseReluDense"))]
    return {"attention": [s.module for s in attention_sites(model)], "feed-forward": ffn,
            "output layer": [model.get_output_embeddings()]}


@torch.no_grad()
def time_split(job, models: list, repeats: int = 7) -> list[dict[str, float]]:
    """Milliseconds of one call of each model spent in each module group, by torch.profiler ranges.

    Median of ``repeats`` calls per model, the models profiled in turn (as ``alternate`` times them).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    handles, ranges = [], {}
    for model in models:
        for label, modules in module_groups(model).items():
            for module in modules:
                def enter(m, args, label=label):
                    ranges[id(m)] = record_function(label)
                    ranges[id(m)].__enter__()

                def leave(m, args, output):
                    ranges.pop(id(m)).__exit__(None, None, None)

                handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    splits = [[] for _ in models]
    try:
        for _ in range(repeats):
            for model, split in zip(models, splits):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    with record_function("total"):
                        job(model)
                totals = {e.key: e.cpu_time_total / 1000 for e in prof.key_averages() if e.key in PROFILE_GROUPS}
                totals["other"] = totals["total"] - sum(v for k, v in totals.items() if k != "total")
                split.append(totals)
    finally:
        for handle in handles:
            handle.remove()
    groups = (*PROFILE_GROUPS, "other")
    return [{k: statistics.median(s.get(k, 0.0) for s in split) for k in groups} for split in splits]


PROFILE_GROUPS = ("attention", "feed-forward", "output layer", "total")


# ---- the grid -----------------------------------------------------------------------------------------------
def plans(name: str, model, grid: Grid) -> list[tuple[str, dict, list]]:
    """(label, plan, cells) of every plan timed for this model; "masked" marks the plan applied with gates only."""
    out = [(f"{round(100 * f)}% removed", random_plan(model, f), grid.cells) for f in grid.fractions]
    out.append(("encoder self-attn removed", random_plan(model, 1.0, kinds=("encoder",)), grid.cells))
    if name == "default":
        for budget in SWEEP:
            kept = dict(zip(("encoder", "decoder", "cross"), budget))
            out.append((f"sweep {'/'.join(map(str, budget))}", even_plan(model, kept), grid.sweep_cells))
    out.append(("50% masked, not removed", random_plan(model, 0.5), grid.cells))
    return out


def rate(kind: str, batch: int, new_tokens: int, s: float) -> str:
    return "-" if kind == "forward" else f"{batch * new_tokens / s:.0f}"


def bench_model(name: str, grid: Grid, log) -> dict:
    torch.manual_seed(0)
    dense = MODELS[name](**({"vocab_size": grid.vocab_size} if grid.vocab_size else {}))
    dense_params, dense_file = count_parameters(dense), file_bytes(dense)
    memory_job = make_job(grid.memory_cell, dense, grid.new_tokens)
    dense_out = memory_job(dense)
    dense_kv, dense_peak = sum(kv_cache_bytes(dense_out.cache)), peak_bytes(memory_job, dense)

    speed_rows, size_rows, pruned50 = [], [], None
    size_rows.append(("dense", "/".join(map(str, list(heads_kept({}, dense).values())[:3])), f"{dense_params:,}",
                      f"{dense_file / 2**20:.1f}", f"{dense_kv / 2**20:.2f}", f"{dense_peak / 2**20:.1f}"))
    for label, plan, cells in plans(name, dense, grid):
        model = copy.deepcopy(dense)
        with contextlib.ExitStack() as stack:
            if label.endswith("masked, not removed"):  # gates closed on the removed heads, weights untouched
                stack.enter_context(masked_heads(model, plan))
            else:
                prune_heads(model, plan)
                kept = heads_kept(plan, dense)
                params, size = count_parameters(model), file_bytes(model)
                kv = sum(kv_cache_bytes(memory_job(model).cache))
                size_rows.append((label, f"{kept['encoder']}/{kept['decoder']}/{kept['cross']}", f"{params:,}",
                                  f"{size / 2**20:.1f}", f"{kv / 2**20:.2f}",
                                  f"{peak_bytes(memory_job, model) / 2**20:.1f}"))
                if label == "50% removed":
                    pruned50 = model
            for cell in cells:
                kind, batch, length = cell
                r = timed_pair(make_job(cell, dense, grid.new_tokens), dense, model, grid.repeats_for(batch))
                measured = r["dense_s"] / r["other_s"]
                predicted = r["dense_flops"] / r["other_flops"]
                speed_rows.append((
                    label, kind, batch, length, f"{1000 * r['dense_s']:.1f}", f"{1000 * r['other_s']:.1f}",
                    rate(kind, batch, grid.new_tokens, r["dense_s"]), rate(kind, batch, grid.new_tokens, r["other_s"]),
                    f"{measured:.2f}", f"{predicted:.2f}", f"{measured / predicted:.2f}", f"{r['cpu_speed_up']:.2f}",
                ))
                log(f"{name} {label} {kind} {batch}x{length}: speed-up {measured:.2f}, predicted {predicted:.2f}")
    result = {"speed": speed_rows, "sizes": size_rows, "grid": grid}
    if pruned50 is not None:
        result["profile"] = profile_worst(dense, pruned50, speed_rows, grid)
        log(f"{name}: profiled {result['profile'][0]}")
        if grid.extras_cells:
            result["extras"] = compile_and_bf16(dense, pruned50, grid, log)
    return result


def profile_worst(dense, pruned, speed_rows: list, grid: Grid) -> tuple:
    """Time split of the 50% plan's call (forward or generate) whose measured / predicted ratio is furthest from 1."""
    rows = [r for r in speed_rows if r[0] == "50% removed"]
    worst = max(rows, key=lambda r: abs(float(r[10]) - 1))
    job = make_job(tuple(worst[1:4]), dense, grid.new_tokens)
    split_dense, split_pruned = time_split(job, [dense, pruned])
    table = [(k, f"{split_dense[k]:.1f}", f"{split_pruned[k]:.1f}", f"{split_dense[k] - split_pruned[k]:.1f}")
             for k in ("attention", "feed-forward", "output layer", "other", "total")]
    return (f"{worst[1]} {worst[2]} x {worst[3]} (measured / predicted {worst[10]})", table)


def compile_and_bf16(dense, pruned, grid: Grid, log) -> list[tuple]:
    """torch.compile and bf16 autocast on the 50% plan: speed-up over the dense model treated alike, same output?"""
    rows = []
    compiled = {}
    for key, model in (("dense", dense), ("pruned", pruned)):
        compiled[key] = copy.deepcopy(model)
        # one graph for every step of generate(): the key/value length grows by one token per step
        compiled[key].forward = torch.compile(compiled[key].forward, dynamic=True)
    for cell in grid.extras_cells:
        kind, batch, length = cell
        job = make_job(cell, dense, grid.new_tokens)
        reference = job(pruned)
        # the first calls compile (batch 1 and the first decoding step get graphs of their own), outside the timing
        compile_s = sum(seconds(lambda: job(compiled[key])) for key in ("dense", "pruned") for _ in range(2))

        def bf16(model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return job(model)

        predicted = None
        for variant, variant_job, a, b in (("eager fp32", job, dense, pruned),
                                           ("torch.compile", job, compiled["dense"], compiled["pruned"]),
                                           ("bf16 autocast", bf16, dense, pruned)):
            # FLOPs are counted on the eager fp32 models: a dispatch mode around compiled code would recompile it
            r = timed_pair(variant_job, a, b, grid.repeats_for(batch), flops=predicted is None)
            predicted = predicted or r["dense_flops"] / r["other_flops"]
            out = variant_job(b)
            if kind == "forward":  # the greedy choice at every target position of the teacher-forced pass
                same = (out.argmax(-1) == reference.argmax(-1)).float().mean().item()
            else:
                same = (out.sequences == reference.sequences).float().mean().item()
            rows.append((variant, kind, batch, length, f"{1000 * r['dense_s']:.1f}", f"{1000 * r['other_s']:.1f}",
                         f"{r['dense_s'] / r['other_s']:.2f}", f"{predicted:.2f}", f"{100 * same:.1f}%"))
            log(f"{variant} {kind} {batch}x{length}: speed-up {r['dense_s'] / r['other_s']:.2f}, "
                f"same {100 * same:.1f}%")
        rows.append(("(compile time, s)", kind, batch, length, "", f"{compile_s:.0f}", "", "", ""))
    return rows


# ---- report -------------------------------------------------------------------------------------------------
SPEED_HEADER = ["plan", "call", "batch", "src len", "dense ms", "pruned ms", "dense tok/s", "pruned tok/s",
                "speed-up", "predicted (FLOPs)", "measured / predicted", "speed-up by CPU time"]
SIZE_HEADER = ["plan", "heads kept enc/dec/cross", "params", "file MiB", "KV cache MiB", "peak MiB"]
PROFILE_HEADER = ["module group", "dense ms", "pruned ms", "saved ms"]
EXTRAS_HEADER = ["variant", "call", "batch", "src len", "dense ms", "pruned ms", "speed-up", "predicted (FLOPs)",
                 "greedy choices equal to eager fp32 pruned"]


def report(results: dict, command: str, setup: str) -> str:
    lines = [
        "# Inference speed of pruned models", "",
        f"`{command}`", "",
        f"Run {setup}. No GPU numbers: this task had no GPU lent.", "",
    ]
    for name, r in results.items():
        grid = r["grid"]
        kind, batch, length = grid["memory_cell"]
        lines += [
            f"## {name}", "",
            f"Median of {grid['repeats']} alternating repeats (batch 1: "
            f"{grid.get('repeats_batch1', grid['repeats'])}) after a warm-up; the last column divides CPU times "
            "instead of wall times (see the notes in README.md); "
            "each pair of dense and pruned (or masked) is timed in its own loop; generate() makes exactly "
            f"{grid['new_tokens']} tokens per sentence; tok/s counts generated tokens (not beams).", "",
            markdown_table(SPEED_HEADER, r["speed"]),
            f"Sizes and memory; KV cache and peak memory of generate() {kind} at batch {batch}, {length} source "
            f"tokens, {grid['new_tokens']} new tokens (peak: bytes "
            "allocated during the call on top of the weights).", "",
            markdown_table(SIZE_HEADER, r["sizes"]),
        ]
        if "profile" in r:
            what, table = r["profile"]
            lines += [f"Where the time goes, 50% removed, {what}: torch.profiler, median of 7 calls of each model, "
                      "alternately; \"other\" is embeddings, layer norms, residual adds, and in generate() the "
                      "decoding loop around the model (cache updates, logits processing, beam bookkeeping).", "",
                      markdown_table(PROFILE_HEADER, table)]
        if "extras" in r:
            lines += ["torch.compile (dynamic shapes) and bf16 autocast, 50% removed: speed-up over the dense model "
                      "run the same way.", "", markdown_table(EXTRAS_HEADER, r["extras"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default model with a tiny vocabulary, tiny shapes")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="a subset of the models (full grid only)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads; 1 because on a shared 2-core machine two threads stall each other (several-fold swings)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/speed.md")
    parser.add_argument("--render", action="store_true", help="rewrite the page and plot from the run's .json")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)
    if args.render:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        write(args.out, saved["results"], saved["command"], saved["setup"])
        return 0
    grids = QUICK if args.quick else {k: v for k, v in FULL.items() if not args.models or k in args.models}
    setup = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; {machine()}; {versions()}"
    results = {}
    for name, grid in grids.items():
        results[name] = bench_model(name, grid, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        print(f"\n{name}\n{format_table(SPEED_HEADER, results[name]['speed'])}\n")
        print(format_table(SIZE_HEADER, results[name]["sizes"]))
        # rewritten after every model, so a run cut short still leaves what it measured
        write(args.out, results, command_line("speed.py", argv), setup)
    print(f"wrote {args.out}")
    return 0


def write(out: Path, results: dict, command: str, setup: str) -> None:
    """The page, its plot, and the numbers as JSON (so the page can be rendered again without a rerun)."""
    results = json.loads(json.dumps(results, default=asdict))  # tuples become lists, grids dicts: as when read back
    atomic_write_text(out.with_suffix(".json"), json.dumps(
        {"command": command, "setup": setup, "results": results}, indent=1))
    atomic_write_text(out, report(results, command, setup))
    plot(results, out.with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    """Speed-up against heads removed, measured by CPU time (solid) and predicted by FLOPs (dashed), per model.

    Source length 32 only, so that each panel holds at most six lines: the other cells are in the tables.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    order = {"forward": 0, "greedy": 1, "beam4": 2}
    series = sorted({(row[1], row[2]) for r in results.values() for row in r["speed"]},
                    key=lambda s: (order[s[0]], s[1]))
    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 4.0), squeeze=False, sharey=True)
    for ax, (name, r) in zip(axes[0], results.items()):
        shortest = min(row[3] for row in r["speed"])
        rows = [row for row in r["speed"] if row[0].endswith("% removed") and row[3] == shortest]
        for i, (kind, batch) in enumerate(series):
            # measured by CPU time: on a shared machine the wall-clock ratios carry the other processes' noise
            points = [(float(row[0].split("%")[0]), float(row[11]), float(row[9])) for row in rows
                      if (row[1], row[2]) == (kind, batch)]
            if points:
                x, measured, predicted = zip(*points)
                ax.plot(x, measured, "o-", color=f"C{i}")
                ax.plot(x, predicted, "--", color=f"C{i}", alpha=0.7)
        length = rows[0][3] if rows else "?"
        ax.set_title(f"{name} (source length {length})", fontsize=10)
        ax.set_xlabel("heads removed (%)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speed-up over the dense model")
    handles = [Line2D([], [], color=f"C{i}", marker="o", label=f"{kind}, batch {batch}")
               for i, (kind, batch) in enumerate(series)]
    handles += [Line2D([], [], color="grey", label="measured (CPU time)"),
                Line2D([], [], color="grey", ls="--", label="predicted (FLOPs)")]
    ncol = min(len(handles), 2 * len(results))
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * (-(-len(handles) // ncol)) + 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
