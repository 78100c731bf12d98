"""Greedy decoding speed of every export of a sweep against the dense model it was pruned from.

    .venv/bin/python benchmarks/sweep_speed.py SWEEP_DIR --dense RUN/checkpoints/dense.ckpt [--out docs/...md]

For each member of ``SWEEP_DIR`` (a folder with ``metrics.json`` and an export), the export and the dense model are
timed alternately in one process, one thread: greedy generation of exactly ``--new-tokens`` tokens (so both decode
the same number of steps), at batch 1 (one validation source at a time) and at batch 32, median of ``--repeats``;
wall time beside CPU time (CPU time barely moves when other processes share the machine). The table gives what each
export keeps per kind, its validation BLEU (from metrics.json) and parameters, and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, command_line, machine, versions  # noqa: E402

from gatedprune import load_pruned  # noqa: E402
from gatedprune.training.checkpoints import load_gated_checkpoint  # noqa: E402
from gatedprune.utils import format_table  # noqa: E402


def members(sweep: Path) -> list[tuple[str, dict, Path]]:
    found = []
    for metrics_file in sorted(sweep.rglob("metrics.json")):  # members of one or several multirun folders
        metrics = json.loads(metrics_file.read_text())
        export = metrics.get("export", {}).get("dir")
        if export and Path(export).is_dir():
            found.append((metrics_file.parent.relative_to(sweep).as_posix(), metrics, Path(export)))
    return found


def batches(tokenizer, sources: list[str], size: int) -> list[dict]:
    return [dict(tokenizer(sources[i:i + size], padding=True, return_tensors="pt"))
            for i in range(0, len(sources), size)]


def decode_job(batch_list: list[dict], new_tokens: int):
    def job(model):
        with torch.no_grad():
            for batch in batch_list:
                model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               num_beams=1)
    return job


def kept(report: dict) -> dict[str, str]:
    units, layers = report.get("units_kept", {}), report.get("layers_kept", {})
    heads = report["heads_kept"]
    return {
        "heads enc/dec/cross": "/".join(str(heads[k][0]) for k in ("encoder", "decoder", "cross") if k in heads),
        "FFN units enc/dec": "/".join(str(units[k][0]) for k in ("encoder_ffn", "decoder_ffn") if k in units),
        "layers enc/dec": "/".join(str(layers[k][0]) for k in ("encoder_layer", "decoder_layer") if k in layers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--dense", type=Path, required=True, help="the dense checkpoint the members forked from")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=8, help="validation sources decoded one at a time (batch 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="a markdown file for the table (and a .json beside it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dense, gates = load_gated_checkpoint(args.dense)
    gates.remove()
    found = members(args.sweep)
    if not found:
        raise SystemExit(f"error: no member of {args.sweep} has metrics.json and an export")
    rows, results = [], []
    for name, metrics, export in found:
        pruned = load_pruned(export).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(export)
        pairs = [json.loads(line) for line in (export.parent / "val_pairs.jsonl").read_text().splitlines()]
        sources = [p["source"] for p in pairs]
        cells = {}
        for batch_size, chosen in ((1, sources[: args.sentences]), (32, sources[:32])):
            job = decode_job(batches(tokenizer, chosen, batch_size), args.new_tokens)
            t_dense, t_pruned = alternate(job, [dense, pruned], args.repeats)
            cells[batch_size] = {"wall": t_dense.wall / t_pruned.wall, "cpu": t_dense.cpu / t_pruned.cpu,
                                 "ms_dense": 1000 * t_dense.wall, "ms_pruned": 1000 * t_pruned.wall}
        report = json.loads((export / "export_report.json").read_text())
        entry = {"run": name, "lambda": metrics.get("l0_lambda"), **kept(report), "bleu": metrics["bleu"],
                 "params": report["params_after"], "params_before": report["params_before"], "speed": cells}
        results.append(entry)
        rows.append((name, entry["lambda"], entry["heads enc/dec/cross"], entry["FFN units enc/dec"],
                     entry["layers enc/dec"], f"{entry['bleu']:.2f}", f"{entry['params']:,}",
                     *(f"{cells[b][k]:.2f}" for b in (1, 32) for k in ("wall", "cpu"))))
        print(rows[-1], flush=True)
    header = ["run", "lambda", "heads enc/dec/cross", "FFN units enc/dec", "layers enc/dec", "BLEU", "params",
              "b1 wall", "b1 CPU", "b32 wall", "b32 CPU"]
    table = format_table(header, rows)
    print(table)
    if args.out:
        command = command_line("sweep_speed.py", [str(a) for a in (argv or sys.argv[1:])])
        md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        md += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        args.out.with_suffix(".json").write_text(json.dumps(
            {"command": command, "machine": machine(), "versions": versions(), "results": results}, indent=2) + "\n")
        args.out.write_text("\n".join([f"Measured with `{command}` ({machine()}; {versions()}).", "",
                                       "Speed-up = dense time / pruned time, greedy, "
                                       f"{args.new_tokens} new tokens.", "", *md, ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
