"""The export directory: written through a hidden sibling, holding the model, its plan, a card and a report.

The directory holds the pruned model in Hugging Face format (safetensors), its tokenizer, the plan in
``config.json`` (``gatedprune``), ``modeling_gatedprune.py`` for ``trust_remote_code`` loading, a model card
(README.md) and ``export_report.json``. It is written to a hidden sibling (``.NAME.partial-PID``) first and renamed
into place at the end, so an interrupted or failed export leaves no partial output directory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import transformers
from torch import nn

from gatedprune.errors import RunFailed
from gatedprune.surgery import pruned_modeling
from gatedprune.structures.adapters import attention_sites
from gatedprune.structures.kinds import ATTENTION_KINDS, KINDS, STACKS, layer_kind
from gatedprune.versions import versions
from gatedprune.surgery.pruned_modeling import CONFIG_KEY, upgrade_record
from gatedprune.surgery.model_loading import auto_class, family_class
from gatedprune.surgery.cut import count_parameters, plan_record, record_removed_parameters
from gatedprune.surgery.record import current_record, model_ffn_sites

log = logging.getLogger("gatedprune.export")

MODELING_FILE = "modeling_gatedprune.py"
REPORT_FILE = "export_report.json"


def check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.parent.is_dir():
        _clean_stale(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it")


def check_out_dir(out_dir: Path, protected: Sequence[Path] = (), run_dir: Path | None = None) -> None:
    """Refuse an output directory whose replacement would destroy a source: one of ``protected`` (a run directory or
    checkpoint) or a directory holding one, or a place inside a ``checkpoints/`` folder. With ``run_dir`` (the run
    exported from), anything that exists inside it is refused too, ``--overwrite`` or not: its ``tokenizer/``,
    ``pruned/`` and the rest are what the run is; a new folder inside it is fine."""
    out = out_dir.resolve()
    for source in map(lambda p: Path(p).resolve(), protected):
        if out == source or out in source.parents:
            raise ValueError(f"output directory {out_dir} is or contains the source {source}; choose another one")
    if run_dir is not None and out_dir.exists() and Path(run_dir).resolve() in out.parents:
        raise ValueError(f"output directory {out_dir} is a part of the source run {run_dir} (it exists), which an "
                         "export never replaces, --overwrite or not; allowed: a new folder, in the run or elsewhere")
    for folder in (out, *out.parents):
        if folder.name == "checkpoints" and any(folder.glob("*.ckpt")):
            raise ValueError(f"output directory {out_dir} lies inside the run's checkpoints/ {folder}; choose another one")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clean_stale(out_dir: Path) -> None:
    """Remove the hidden folders that exports of ``out_dir`` killed mid-way left behind (their process is gone).

    ``.NAME.partial-PID`` is an unfinished export; ``.NAME.old-PID`` the previous export, moved aside for the
    rename: put back if the new one never arrived.
    """
    for leftover in sorted(out_dir.parent.glob(f".{out_dir.name}.*")):
        kind, _, pid = leftover.name[len(out_dir.name) + 2 :].partition("-")
        if kind not in ("partial", "old") or (pid.isdigit() and _alive(int(pid))):
            continue
        if kind == "old" and not out_dir.exists():
            leftover.rename(out_dir)
            log.warning("restored %s from %s, left by an export that was stopped", out_dir, leftover.name)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
            log.warning("removed %s, left by an export (process %s) that was stopped", leftover, pid or "unknown")


@contextmanager
def staged(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden sibling of ``out_dir`` to write into; renamed to ``out_dir`` on success, deleted on any failure.

    The hidden names carry this process's PID, so two exports never share one.
    """
    check_target(out_dir, overwrite)
    stage, old = (out_dir.parent / f".{out_dir.name}.{suffix}-{os.getpid()}" for suffix in ("partial", "old"))
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
        yield stage
        check_target(out_dir, overwrite)
        if out_dir.exists():
            out_dir.rename(old)
            try:
                stage.rename(out_dir)
            except BaseException:
                old.rename(out_dir)
                raise
        else:
            stage.rename(out_dir)
    except BaseException as err:
        shutil.rmtree(stage, ignore_errors=True)
        full = _no_space(err)
        if full is not None:  # the staged files are gone again: nothing of this export is left on the full disk
            written = Path(full.filename) if full.filename else None
            if written is not None and stage in written.parents:
                written = out_dir / written.relative_to(stage)
            raise RunFailed(f"no space left on device writing {written or out_dir}; nothing was written "
                            f"(free some space on it and export again)") from err
        raise
    shutil.rmtree(old, ignore_errors=True)


def _no_space(err: BaseException | None) -> OSError | None:
    """The "no space left on device" error behind ``err``, if that is what it is: an ``OSError`` (ENOSPC), raised
    directly or wrapped by the library that wrote (safetensors reports it as text in its own error type)."""
    for _ in range(8):  # __cause__ / __context__ chains are short; bounded all the same
        if err is None:
            return None
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return err
        if "No space left on device" in str(err):
            return OSError(errno.ENOSPC, str(err))
        err = err.__cause__ or err.__context__
    return None


def weights_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def write_model(model: transformers.PreTrainedModel, directory: Path, tokenizer=None) -> None:
    """Weights, config (plan, source, versions, auto_map), tokenizer and the self-contained modeling file."""
    if plan_record(model) is None:
        raise ValueError("this model was never pruned (no plan on its config); call gatedprune.prune_heads first")
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    base = family_class(model.config).__name__
    class_name = f"GatedPruned{base}"
    (directory / MODELING_FILE).write_text(
        Path(pruned_modeling.__file__).read_text() + f"{class_name} = pruned_model_class(transformers.{base})\n"
    )
    # written into the file, not onto the model: the caller's config stays as it was
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    # AutoModelForSeq2SeqLM as before; a speech model (Whisper) also under its own Auto class
    auto_map = {auto.__name__: f"{Path(MODELING_FILE).stem}.{class_name}" for auto in {
        transformers.AutoModelForSeq2SeqLM, auto_class(model.config)}}
    config["auto_map"] = dict(sorted(auto_map.items()))
    config[CONFIG_KEY]["source_model"] = _source_model(model)
    config[CONFIG_KEY]["versions"] = versions()
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _source_model(model: nn.Module) -> str | None:
    return getattr(model.config, "_name_or_path", None) or None


def describe(model: transformers.PreTrainedModel, directory: Path, file_size_before: int | None = None) -> dict:
    """Plan, kept structures and parameter counts, file sizes of a pruned model saved in ``directory``.

    ``heads_kept`` (and ``units_kept``, ``layers_kept`` where the model has them) are ``[kept, before]`` per kind:
    the heads and units of a dropped layer count as removed."""
    record = current_record(model)
    removed = record_removed_parameters(model)
    params_after = count_parameters(model)
    size_after = weights_size(directory)
    if file_size_before is None:  # the weights of the removed structures, at the saved precision
        file_size_before = size_after + removed * next(model.parameters()).element_size()
        measured = False
    else:
        measured = True
    dropped = [entry for entries in record["dropped"].values() for entry in entries]
    heads = {
        kind: [sum(len(kept) for kept in per_kind.values()),
               sum(record["num_heads"][p] for p in per_kind) + sum(e["heads"].get(kind, 0) for e in dropped)]
        for kind, per_kind in record["kept_heads"].items()
    }
    units = {
        kind: [sum(len(kept) for kept in per_kind.values()),
               sum(record["num_units"][p] for p in per_kind) + sum(e["units"].get(kind, 0) for e in dropped)]
        for kind, per_kind in record["kept_units"].items()
    }
    layers = {layer_kind(stack): [len(kept), record["num_layers"][stack]] for stack, kept in record["kept_layers"].items()}
    return {
        **_grouped(record),
        "rule": record["rule"],
        "source_model": _source_model(model),
        "heads_kept": {"total": [sum(k for k, _ in heads.values()), sum(n for _, n in heads.values())], **heads},
        "units_kept": units,
        "layers_kept": layers,
        "params_before": params_after + removed,
        "params_after": params_after,
        "file_size_before": file_size_before,
        "file_size_before_measured": measured,
        "file_size_after": size_after,
        "plan": {kind: dict(per_kind) for kind, per_kind in record["kept_heads"].items()},
        "plan_units": {kind: dict(per_kind) for kind, per_kind in record["kept_units"].items()},
        "plan_layers": dict(record["kept_layers"]),
        "versions": versions(),
    }


def _grouped(record: dict) -> dict:
    """Key/value heads kept and filler query heads of the grouped-query modules, if the model has any."""
    record = upgrade_record(record)
    paths = [p for p in record["num_heads"] if record["num_kv_heads"][p] < record["num_heads"][p]]
    if not paths:
        return {}
    kept = {p: h for per_kind in record["kept_heads"].values() for p, h in per_kind.items()}
    return {
        "kv_heads_kept": [sum(len(record["kv_heads"][p]) for p in paths), sum(record["num_kv_heads"][p] for p in paths)],
        "filler_heads": sum(len(record["slots"][p]) - len(kept[p]) for p in paths),
    }


def _listed(kept: list[int], total: int) -> str:
    return "all" if len(kept) == total else ("none" if not kept else ", ".join(map(str, kept)))


def _plan_table(model: nn.Module, report: dict) -> str:
    """Per stack and original layer: whether it is there, the heads of each attention kind, the FFN width."""
    record = current_record(model)
    lines = []
    for stack in STACKS:
        kinds = [k for k in ATTENTION_KINDS if KINDS[k].stack == stack and k in record["kept_heads"]]
        cells: dict[int, dict[str, str]] = {}
        for site in attention_sites(model):
            if site.kind in kinds:
                kept, total = record["kept_heads"][site.kind][site.path], record["num_heads"][site.path]
                cells.setdefault(site.layer, {})[site.kind] = f"{len(kept)}/{total} ({_listed(kept, total)})"
        widths = {site.layer: f"{site.width}/{record['num_units'].get(site.path, site.width)}"
                  for site in model_ffn_sites(model) if KINDS[site.kind].stack == stack}
        header = ["layer", "present", *(KINDS[k].title for k in kinds), "FFN width"]
        lines += [f"**{stack}**", "", "| " + " | ".join(header) + " |", "|---:|---|" + "---|" * (len(kinds) + 1)]
        present = record["kept_layers"].get(stack, [])
        gone = {e["layer"] for e in record["dropped"].get(stack, [])}
        for original in range(record["num_layers"].get(stack, len(present))):
            if original in gone or original not in present:
                lines.append(f"| {original} | removed | " + " | ".join("-" for _ in kinds) + " | - |")
                continue
            j = present.index(original)
            lines.append(f"| {original} | yes | " + " | ".join(cells.get(j, {}).get(k, "-") for k in kinds)
                         + f" | {widths.get(j, '-')} |")
        lines.append("")
    kept = report["heads_kept"]
    lines.append("Heads in all: " + ", ".join(f"{k} {kept[k][0]}/{kept[k][1]}" for k in ATTENTION_KINDS if k in kept)
                 + "".join(f"; {KINDS[k].title} {v[0]}/{v[1]}" for k, v in {**report.get("units_kept", {}),
                                                                            **report.get("layers_kept", {})}.items()))
    return "\n".join(lines)


def _grouped_lines(report: dict) -> list[str]:
    if "kv_heads_kept" not in report:
        return []
    kv, total = report["kv_heads_kept"]
    return [
        f"Grouped-query attention: {kv} of {total} key/value heads kept; a key/value head goes only when every query",
        f"head sharing it goes. {report['filler_heads']} pruned query heads stay as zero-output fillers, so that every",
        "key/value head of a module serves the same number of query heads (their parameters are counted as kept).",
        "",
    ]


def megabytes(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def _model_card(model: nn.Module, report: dict) -> str:
    kept, total = report["heads_kept"]["total"]
    before, after = report["params_before"], report["params_after"]
    estimated = "" if report["file_size_before_measured"] else " (estimated: removed parameters x bytes each)"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [gatedprune, pruned, structured-pruning]",
        "---",
        "",
        f"# {report['source_model'] or model.config.model_type}, pruned with gatedprune",
        "",
        f"{kept} of {total} attention heads kept (rule: {report['rule'] or 'hand-written plan'}). Structures are",
        "removed physically: a head's q/k/v rows and output-projection columns, a feed-forward unit's rows and",
        "column, a layer from its stack; head counts and FFN widths differ per layer.",
        "",
        *_grouped_lines(report),
        "## Load",
        "",
        "```python",
        "import gatedprune",
        "model = gatedprune.load_pruned(path)  # the family's own class",
        "# or, without gatedprune installed:",
        "from transformers import AutoModelForSeq2SeqLM",
        "model = AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)",
        "```",
        "",
        "## Kept per layer: heads kept/total (indices), FFN units kept/total",
        "",
        _plan_table(model, report),
        "",
        "## Size",
        "",
        "| | before | after |",
        "|---|---:|---:|",
        f"| parameters | {before:,} | {after:,} ({after / before:.1%}) |",
        f"| weights file | {megabytes(report['file_size_before'])}{estimated} | {megabytes(report['file_size_after'])} |",
        "",
        "## Verification",
        "",
    ]
    check = report.get("verification")
    if check is None:
        lines.append("Not verified: written by `save_pruned` without a gated model to compare with.")
    else:
        lines += [
            f"On {check['inputs']}, float32, gates fixed to the plan vs the pruned model:",
            "",
            f"- max |logit difference|: {check['max_abs_logit_diff']:.3g} (must be < {check['tolerance']:g})",
            f"- greedy generations ({check['max_new_tokens']} new tokens) identical: {check['greedy_identical']}",
            f"- reloaded vs in-memory pruned, max |logit difference|: {reload_diffs(check)}",
            f"- parameters after = before - removed structures' parameters: {check['params_match']}",
        ]
        if report.get("unconverged_gates"):
            lines.append(f"- gates not converged (deterministic gate strictly between 0 and 1): "
                         f"{report['unconverged_gates']}")
    versions = ", ".join(f"{name} {version}" for name, version in report["versions"].items())
    lines += ["", f"Exported with {versions}.", ""]
    return "\n".join(lines)


def write_card(directory: Path, model: nn.Module, report: dict) -> None:
    (directory / "README.md").write_text(_model_card(model, report))
    (directory / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def save_pruned(
    model: transformers.PreTrainedModel, out_dir: str | Path, tokenizer=None, *, overwrite: bool = False
) -> dict:
    """Write the export directory of a model pruned by ``prune_heads``; returns what the model card reports.

    Weights (safetensors), plan in config.json, tokenizer, model card, ``modeling_gatedprune.py``. Without the gated
    model there is nothing to verify against; ``export_gated`` verifies.
    """
    out_dir = Path(out_dir)
    with staged(out_dir, overwrite) as stage:
        write_model(model, stage, tokenizer)
        report = describe(model, stage)
        write_card(stage, model, report)
    return report


def reload_diffs(check: dict) -> str:
    return ", ".join(f"{way} {diff:.3g}" for way, diff in check["reload_max_abs_logit_diff"].items())
