"""Finalise a gated model: gates -> plan -> verified, physically smaller model in a directory that describes itself.

    python -m gatedprune.export <run dir or Lightning checkpoint> <out dir> [--top-k N] [--overwrite]

The directory holds the pruned model in Hugging Face format (safetensors), its tokenizer, the plan in
``config.json`` (``gatedprune``), ``modeling_gatedprune.py`` for ``trust_remote_code`` loading, a model card
(README.md) and ``export_report.json``. It is written to a hidden sibling first and renamed into place at the end,
so an interrupted or failed export leaves no partial output directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from torch import nn

from gatedprune import remote_modeling
from gatedprune.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.gating import HeadGates, attach_gates
from gatedprune.remote_modeling import CONFIG_KEY, upgrade_record
from gatedprune.checkpoints import load_checkpoint_file, strip_prefix
from gatedprune.cli import RunFailed, run_reported, version
from gatedprune.surgery import (
    auto_class,
    count_parameters,
    family_class,
    fresh_model,
    load_pruned,
    masked_heads,
    plan_record,
    prune_heads,
    record_removed_parameters,
    removed_parameters,
)

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # largest |logit difference| (float32) allowed between the gated and the pruned model
MODELING_FILE = "modeling_gatedprune.py"
REPORT_FILE = "export_report.json"
KIND_TITLES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}

Pairs = Sequence[tuple[str, str]]


class ExportError(RunFailed):
    """The pruned model does not compute what the gated model computes; the message carries the numbers."""


# --- gates -> plan --------------------------------------------------------------------------------------------


def _rule_name(rule: str, top_k: int | None) -> str:
    return "binary" if rule == "binary" else f"top-k, k={top_k}"


# --- verification inputs and outputs -------------------------------------------------------------------------


def sample_batch(
    model: nn.Module,
    tokenizer=None,
    sample_inputs: Mapping[str, torch.Tensor] | Pairs | None = None,
    *,
    num_random: int = 4,
    max_length: int = 128,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The verification batch: given tensors, tokenized (source, target) pairs, or random ids when none are given."""
    if isinstance(sample_inputs, Mapping):
        return {name: torch.as_tensor(value) for name, value in sample_inputs.items()}
    if sample_inputs is not None:
        if tokenizer is None:
            raise ValueError("text pairs as sample inputs need a tokenizer")
        sources, targets = zip(*sample_inputs)
        batch = tokenizer(
            list(sources), text_target=list(targets), padding=True, truncation=True, max_length=max_length,
            return_tensors="pt",
        )
        return dict(batch)  # input_ids, attention_mask, labels (the model shifts labels into decoder inputs)
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(config.vocab_size, (num_random, 16), generator=generator)  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, input_ids.shape[1] // 2 :] = 0  # one padded row, so the masks are exercised too
    decoder_input_ids = torch.randint(config.vocab_size, (num_random, 12), generator=generator)  # (B, T)
    if config.decoder_start_token_id is not None:
        decoder_input_ids[:, 0] = config.decoder_start_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}


@torch.no_grad()
def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(**{name: value.to(device) for name, value in batch.items()}).logits.float()  # (B, T, V)


@torch.no_grad()
def _greedy(model: nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int) -> torch.Tensor:
    device = next(model.parameters()).device
    return model.generate(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
    ).cpu()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).abs().max())


@contextmanager
def _full_float32(device_type: str) -> Iterator[None]:
    """True float32 matmuls (no TF32) and no autocast, whatever the trainer set, for the 1e-4 comparison."""
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _float32_copy(model: transformers.PreTrainedModel, device: torch.device | str | None) -> nn.Module:
    """A float32 copy of ``model`` without its gate hooks (a fresh instance, so no hook comes along)."""
    clone = fresh_model(copy.deepcopy(model.config))
    clone.load_state_dict(model.state_dict())
    clone.generation_config = copy.deepcopy(model.generation_config)
    return clone.to(device=device or next(model.parameters()).device, dtype=torch.float32).eval()


# --- writing the directory -----------------------------------------------------------------------------------


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.parent.is_dir():
        _clean_stale(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it")


def check_out_dir(out_dir: Path, protected: Sequence[Path] = ()) -> None:
    """Refuse an output directory whose replacement would destroy a source: one of ``protected`` (a run directory or
    checkpoint) or a directory holding one, or a place inside a ``checkpoints/`` folder."""
    out = out_dir.resolve()
    for source in map(lambda p: Path(p).resolve(), protected):
        if out == source or out in source.parents:
            raise ValueError(f"output directory {out_dir} is or contains the source {source}; choose another one")
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
def _staged(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden sibling of ``out_dir`` to write into; renamed to ``out_dir`` on success, deleted on any failure.

    The hidden names carry this process's PID, so two exports never share one.
    """
    _check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage, old = (out_dir.parent / f".{out_dir.name}.{suffix}-{os.getpid()}" for suffix in ("partial", "old"))
    stage.mkdir()
    try:
        yield stage
        _check_target(out_dir, overwrite)
        if out_dir.exists():
            out_dir.rename(old)
            try:
                stage.rename(out_dir)
            except BaseException:
                old.rename(out_dir)
                raise
        else:
            stage.rename(out_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _weights_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _versions() -> dict[str, str]:
    return {"gatedprune": version(), "transformers": transformers.__version__, "torch": torch.__version__}


def _write_model(model: transformers.PreTrainedModel, directory: Path, tokenizer=None) -> None:
    """Weights, config (plan, source, versions, auto_map), tokenizer and the self-contained modeling file."""
    if plan_record(model) is None:
        raise ValueError("this model was never pruned (no plan on its config); call gatedprune.prune_heads first")
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    base = family_class(model.config).__name__
    class_name = f"GatedPruned{base}"
    (directory / MODELING_FILE).write_text(
        Path(remote_modeling.__file__).read_text() + f"{class_name} = pruned_model_class(transformers.{base})\n"
    )
    # written into the file, not onto the model: the caller's config stays as it was
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    # AutoModelForSeq2SeqLM as before; a speech model (Whisper) also under its own Auto class
    auto_map = {auto.__name__: f"{Path(MODELING_FILE).stem}.{class_name}" for auto in {
        transformers.AutoModelForSeq2SeqLM, auto_class(model.config)}}
    config["auto_map"] = dict(sorted(auto_map.items()))
    config[CONFIG_KEY]["source_model"] = _source_model(model)
    config[CONFIG_KEY]["versions"] = _versions()
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _source_model(model: nn.Module) -> str | None:
    return getattr(model.config, "_name_or_path", None) or None


def _describe(model: transformers.PreTrainedModel, directory: Path, file_size_before: int | None = None) -> dict:
    """Plan, head and parameter counts, file sizes of a pruned model saved in ``directory``."""
    record = plan_record(model)
    removed = record_removed_parameters(model)
    params_after = count_parameters(model)
    size_after = _weights_size(directory)
    if file_size_before is None:  # the weights of the removed heads, at the saved precision
        file_size_before = size_after + removed * next(model.parameters()).element_size()
        measured = False
    else:
        measured = True
    heads = {
        kind: [sum(len(kept) for kept in per_kind.values()), sum(record["num_heads"][p] for p in per_kind)]
        for kind, per_kind in record["kept_heads"].items()
    }
    grouped = _grouped(record)
    return {
        **grouped,
        "rule": record["rule"],
        "source_model": _source_model(model),
        "heads_kept": {"total": [sum(k for k, _ in heads.values()), sum(n for _, n in heads.values())], **heads},
        "params_before": params_after + removed,
        "params_after": params_after,
        "file_size_before": file_size_before,
        "file_size_before_measured": measured,
        "file_size_after": size_after,
        "plan": {kind: dict(per_kind) for kind, per_kind in record["kept_heads"].items()},
        "versions": _versions(),
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


def _plan_table(model: nn.Module, heads_kept: dict[str, list[int]]) -> str:
    record = plan_record(model)
    cells: dict[int, dict[str, str]] = {}
    for site in attention_sites(model):
        kept, total = record["kept_heads"][site.kind][site.path], record["num_heads"][site.path]
        listed = "all" if len(kept) == total else ("none" if not kept else ", ".join(map(str, kept)))
        cells.setdefault(site.layer, {})[site.kind] = f"{len(kept)}/{total} ({listed})"
    kinds = [k for k in ATTENTION_KINDS if k in record["kept_heads"]]
    lines = ["| layer | " + " | ".join(KIND_TITLES[k] for k in kinds) + " |", "|---:|" + "---|" * len(kinds)]
    for layer in sorted(cells):
        lines.append(f"| {layer} | " + " | ".join(cells[layer].get(k, "-") for k in kinds) + " |")
    lines.append("| all | " + " | ".join(f"{heads_kept[k][0]}/{heads_kept[k][1]}" for k in kinds) + " |")
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


def _mb(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def _model_card(model: nn.Module, report: dict) -> str:
    kept, total = report["heads_kept"]["total"]
    before, after = report["params_before"], report["params_after"]
    estimated = "" if report["file_size_before_measured"] else " (estimated: removed parameters x bytes each)"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [gatedprune, pruned, head-pruning]",
        "---",
        "",
        f"# {report['source_model'] or model.config.model_type}, attention heads pruned with gatedprune",
        "",
        f"{kept} of {total} attention heads kept (rule: {report['rule'] or 'hand-written plan'}). Heads are",
        "removed physically: q/k/v rows and output-projection columns are gone, head counts differ per layer.",
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
        "## Heads kept per layer (kept/total (indices))",
        "",
        _plan_table(model, report["heads_kept"]),
        "",
        "## Size",
        "",
        "| | before | after |",
        "|---|---:|---:|",
        f"| parameters | {before:,} | {after:,} ({after / before:.1%}) |",
        f"| weights file | {_mb(report['file_size_before'])}{estimated} | {_mb(report['file_size_after'])} |",
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
            f"- reloaded vs in-memory pruned, max |logit difference|: {_reload_diffs(check)}",
            f"- parameters after = before - removed heads' parameters: {check['params_match']}",
        ]
        if report.get("unconverged_gates"):
            lines.append(f"- gates not converged (deterministic gate strictly between 0 and 1): "
                         f"{report['unconverged_gates']}")
    versions = ", ".join(f"{name} {version}" for name, version in report["versions"].items())
    lines += ["", f"Exported with {versions}.", ""]
    return "\n".join(lines)


def _write_card(directory: Path, model: nn.Module, report: dict) -> None:
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
    with _staged(out_dir, overwrite) as stage:
        _write_model(model, stage, tokenizer)
        report = _describe(model, stage)
        _write_card(stage, model, report)
    return report


# --- the exporter --------------------------------------------------------------------------------------------


def export_gated(
    model: transformers.PreTrainedModel,
    gates: HeadGates,
    out_dir: str | Path,
    tokenizer=None,
    rule: str = "binary",
    top_k: int | None = None,
    sample_inputs: Mapping[str, torch.Tensor] | Pairs | None = None,
    overwrite: bool = False,
    *,
    max_new_tokens: int = 20,
    device: torch.device | str | None = "cpu",
) -> dict:
    """Prune a copy of the gated ``model`` by the gate rule, verify it, and write the export directory.

    The caller's model and gates are left as they are. Verification (float32, on ``sample_inputs``: a batch of
    tensors or (source, target) text pairs; random ids when None): the pruned model's logits within 1e-4 of the
    gated model with gates fixed to the plan, identical greedy generations, both reloading paths giving the
    in-memory pruned model's logits, and the parameter count down by exactly the removed heads' parameters.
    Raises ``ExportError`` with the numbers (and writes nothing) if any check fails; returns the report.
    ``device`` runs the verification (None: the model's device); the exported weights are the same either way.
    """
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)  # fail before the expensive part
    plan = gates.plan(rule, top_k)
    rule_name = _rule_name(rule, top_k)
    unconverged = gates.unconverged()
    if unconverged:
        log.warning(
            "gates have not converged: %d of %d deterministic gates lie strictly between 0 and 1",
            unconverged, gates.num_heads,
        )
    kept = sum(len(heads) for heads in plan.values())
    log.info("rule %s keeps %d of %d gated heads and removes %d", rule_name, kept, gates.num_heads,
             gates.num_heads - kept)
    binary = gates.plan()
    decided = sum(len(set(plan[path]) ^ set(binary[path])) for path in plan)  # heads where the rule overrode log_alpha > 0
    if rule != "binary":
        log.info("rule %s decided %d heads differently from the binary rule (log_alpha > 0)", rule_name, decided)

    save_dtype = next(model.parameters()).dtype
    work = _float32_copy(model, device)
    batch = sample_batch(work, tokenizer, sample_inputs)
    inputs = (
        f"{len(batch['input_ids'])} random input sequences" if sample_inputs is None
        else f"{len(batch['input_ids'])} validation samples"
    )
    on = next(work.parameters()).device
    with _full_float32(on.type), _staged(out_dir, overwrite) as stage:
        with masked_heads(work, plan):
            gated_logits, gated_tokens = _logits(work, batch), _greedy(work, batch, max_new_tokens)
        params_before = count_parameters(work)
        params_removed = removed_parameters(work, plan)
        work.save_pretrained(stage / "unpruned")
        size_before = _weights_size(stage / "unpruned")
        shutil.rmtree(stage / "unpruned")

        prune_heads(work, plan, rule=rule_name)
        pruned_logits, pruned_tokens = _logits(work, batch), _greedy(work, batch, max_new_tokens)
        _write_model(work.to(save_dtype), stage, tokenizer)
        reload_options = {"dtype": torch.float32, "attn_implementation": work.config._attn_implementation}
        reloaded = {
            "load_pruned": load_pruned(stage, **reload_options),
            "trust_remote_code": auto_class(work.config).from_pretrained(
                stage, trust_remote_code=True, **reload_options
            ),
        }
        reload_diffs = {way: _max_diff(_logits(m.to(on), batch), pruned_logits) for way, m in reloaded.items()}
        check = {
            "inputs": inputs,
            "max_abs_logit_diff": _max_diff(gated_logits, pruned_logits),
            "tolerance": TOLERANCE,
            "greedy_identical": bool(torch.equal(gated_tokens, pruned_tokens)),
            "greedy_sequences": len(gated_tokens),
            "max_new_tokens": max_new_tokens,
            "reload_max_abs_logit_diff": reload_diffs,
            "params_match": count_parameters(work) == params_before - params_removed,
        }
        check["passed"] = (
            check["max_abs_logit_diff"] < TOLERANCE
            and check["greedy_identical"]
            and all(diff < TOLERANCE for diff in reload_diffs.values())
            and check["params_match"]
        )
        report = {
            **_describe(work, stage, size_before), "unconverged_gates": unconverged, "decided_by_rule": decided,
            "verification": check,
        }
        log.info("%s", _verification_summary(report))
        if not check["passed"]:
            raise ExportError(
                f"verification failed, nothing written to {out_dir}:\n{_verification_summary(report)}\n"
                f"parameters: before {params_before}, removed heads' {params_removed}, "
                f"after {report['params_after']} (expected {params_before - params_removed})"
            )
        _write_card(stage, work, report)
    log.info("wrote %s", out_dir)
    return report


def _reload_diffs(check: dict) -> str:
    return ", ".join(f"{way} {diff:.3g}" for way, diff in check["reload_max_abs_logit_diff"].items())


def _verification_summary(report: dict) -> str:
    check = report["verification"]
    kept, total = report["heads_kept"]["total"]
    return "\n".join([
        f"heads kept {kept}/{total} ("
        + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in report["heads_kept"].items() if k != "total") + ")",
        f"parameters {report['params_before']:,} -> {report['params_after']:,}; weights file "
        f"{_mb(report['file_size_before'])} -> {_mb(report['file_size_after'])}",
        f"verification on {check['inputs']}: max |logit diff| gated vs pruned {check['max_abs_logit_diff']:.3g} "
        f"(tolerance {check['tolerance']:g}); greedy identical: {check['greedy_identical']}; "
        f"reloaded max |logit diff|: {_reload_diffs(check)}; parameter count exact: {check['params_match']}",
    ])


# --- from a training run -------------------------------------------------------------------------------------


def load_gated_checkpoint(path: str | Path) -> tuple[transformers.PreTrainedModel, HeadGates]:
    """Rebuild the gated model of a Lightning checkpoint written by the gated trainer."""
    checkpoint = load_checkpoint_file(path)
    config = transformers.AutoConfig.for_model(**checkpoint["hf_config"])
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.load_state_dict(strip_prefix(checkpoint["state_dict"], "model."))
    if "generation_config" in checkpoint:
        model.generation_config = transformers.GenerationConfig.from_dict(checkpoint["generation_config"])
    gates = attach_gates(model, checkpoint["gate_kinds"], **checkpoint["gate_options"])
    gates.load_state_dict(strip_prefix(checkpoint["state_dict"], "gates."))
    return model.eval(), gates


def _find_run_files(source: Path) -> tuple[Path, Path | None]:
    """(checkpoint, run dir) of a run directory or of a checkpoint path inside one."""
    if not source.is_dir():
        if not source.is_file():
            raise FileNotFoundError(f"no run directory or checkpoint at {source}")
        run_dir = next((d for d in source.parents if (d / "metrics.json").exists()), None)
        return source, run_dir
    metrics = source / "metrics.json"
    if not metrics.is_file():  # a run still going, or one that stopped: its last checkpoint
        if (source / "checkpoints" / "last.ckpt").is_file():
            return source / "checkpoints" / "last.ckpt", source
        raise FileNotFoundError(
            f"{source} holds neither metrics.json nor checkpoints/last.ckpt; give a run directory or a .ckpt file"
        )
    try:
        recorded = Path(json.loads(metrics.read_text())["checkpoint"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{metrics} is not a metrics.json written by train.py (no checkpoint named)") from None
    # as recorded (absolute, or relative to where training ran), relative to the run, or moved along with the run
    candidates = [recorded, source / recorded, source / "checkpoints" / recorded.name]
    checkpoint = next((c for c in candidates if c.is_file()), None)
    if checkpoint is None:
        raise FileNotFoundError(f"the checkpoint of {source} is not at any of {[str(c) for c in candidates]}")
    return checkpoint, source


def read_pairs(path: Path, limit: int) -> list[tuple[str, str]]:
    """The first ``limit`` (source, target) pairs of a JSON-lines file with "source" and "target" fields."""
    pairs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                    pairs.append((str(row["source"]), str(row["target"])))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with source and target") from None
            if len(pairs) == limit:
                break
    return pairs


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    *,
    rule: str = "binary",
    top_k: int | None = None,
    overwrite: bool = False,
    samples: int = 8,
    val_pairs: str | Path | None = None,
    max_new_tokens: int = 20,
    device: str | None = "cpu",
) -> dict:
    """``export_gated`` for a run directory or a Lightning checkpoint; tokenizer and val_pairs.jsonl from the run."""
    checkpoint, run_dir = _find_run_files(Path(source))
    check_out_dir(Path(out_dir), protected=[checkpoint, *([run_dir] if run_dir else [])])
    model, gates = load_gated_checkpoint(checkpoint)
    tokenizer = None
    if run_dir is not None and (run_dir / "tokenizer").is_dir():
        tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    else:
        log.warning("no tokenizer/ beside %s: the export will hold no tokenizer", checkpoint)
    if val_pairs is None and run_dir is not None and (run_dir / "val_pairs.jsonl").exists():
        val_pairs = run_dir / "val_pairs.jsonl"
    pairs = read_pairs(Path(val_pairs), samples) if val_pairs is not None and tokenizer is not None else None
    return export_gated(
        model, gates, out_dir, tokenizer, rule=rule, top_k=top_k, sample_inputs=pairs, overwrite=overwrite,
        max_new_tokens=max_new_tokens, device=device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gatedprune-export", description="Prune the heads a gated run closed and write a verified, smaller model."
    )
    parser.add_argument("source", help="run directory (with metrics.json) or Lightning checkpoint")
    parser.add_argument("out_dir", help="directory to write; must not exist or be empty unless --overwrite")
    parser.add_argument(
        "--top-k", type=int, default=None, help="keep exactly N heads (largest log_alpha) instead of log_alpha > 0"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    parser.add_argument("--samples", type=int, default=8, help="validation pairs to verify on (when the run has them)")
    parser.add_argument("--val-pairs", default=None, help="JSON-lines file of {source, target} pairs to verify on")
    parser.add_argument("--max-new-tokens", type=int, default=20, help="length of the greedy generations compared")
    parser.add_argument("--device", default="cpu", help="device for verification (default cpu)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_reported(lambda: export_checkpoint(
        args.source, args.out_dir, rule="binary" if args.top_k is None else "top-k", top_k=args.top_k,
        overwrite=args.overwrite, samples=args.samples, val_pairs=args.val_pairs,
        max_new_tokens=args.max_new_tokens, device=args.device,
    ))


if __name__ == "__main__":
    sys.exit(main())
