"""The checkpoint of a gated run: what it holds beyond Lightning's own keys, and how it is read back.

A checkpoint is a pickle. It is only ever read with ``torch.load(weights_only=True)``, which unpickles tensors
and plain containers and refuses anything else, so a file handed to us by someone else cannot run code. That is
why everything written here is plain data: the model config as a dict, the gate options as a dict.
"""

from __future__ import annotations

import contextlib
import pickletools
import re
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
import transformers

from gatedprune.structures.head_gates import HeadGates, attach_gates

GATED_CHECKPOINT_KEYS = ("state_dict", "hf_config", "gate_kinds", "gate_options")
# config fields that say nothing about the weights: they may differ between a checkpoint and the run resuming it
_IGNORED_CONFIG_FIELDS = {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "output_attentions"}


def describe(module) -> dict:
    """What ``GatedSeq2Seq.on_save_checkpoint`` adds, so the exporter needs nothing but the file."""
    return {
        "hf_config": module.model.config.to_dict(),
        "generation_config": module.model.generation_config.to_dict(),
        "gate_options": asdict(module.pruning.gates),
        "gate_kinds": list(module.pruning.kinds),
        "gate_ffn_group": module.pruning.ffn_group,
    }


def _saved_sites(checkpoint: dict) -> list[tuple[str, str]] | None:
    """(module path, kind) of each gate a checkpoint holds, in its order; None for a checkpoint without gates."""
    extra = checkpoint["state_dict"].get("gates._extra_state")
    return list(zip(extra["paths"], extra["kinds"])) if extra else None


def untrained_beyond(checkpoint: dict, kinds) -> bool:
    """Whether every gate of the checkpoint outside ``kinds`` still holds its initial ``log_alpha``: true of a
    ``dense.ckpt`` (the dense phase holds the gates open and never moves them), so dropping those gates changes
    nothing the model computes."""
    sites = _saved_sites(checkpoint)
    init = checkpoint["gate_options"]["init_log_alpha"]
    return sites is not None and all(bool((checkpoint["state_dict"][f"gates.gates.{i}.log_alpha"] == init).all())
                                     for i, (_, kind) in enumerate(sites) if kind not in kinds)


def drop_unused_gates(checkpoint: dict, gates: HeadGates) -> None:
    """Fit a checkpoint gated on more kinds than ``gates`` (the every-kind default's ``dense.ckpt`` forked by a
    heads-only method) to them: the other gates, untrained (``untrained_beyond``), go with their optimiser state,
    and the optimiser's parameter indices close up over them."""
    state, saved = checkpoint["state_dict"], _saved_sites(checkpoint)
    ours = list(zip(gates.paths, gates.kinds))
    if saved is None or saved == ours or not set(ours) < set(saved):
        return
    keep = [saved.index(site) for site in ours]
    dropped = [i for i in range(len(saved)) if i not in keep]
    values = [state.pop(f"gates.gates.{i}.log_alpha") for i in range(len(saved))]
    state.update({f"gates.gates.{j}.log_alpha": values[i] for j, i in enumerate(keep)})
    state["gates._extra_state"] = gates.get_extra_state()
    checkpoint["gate_kinds"] = list(dict.fromkeys(gates.kinds))
    for optimizer in checkpoint.get("optimizer_states", []):
        groups = optimizer["param_groups"]  # the gates' group is the second, its parameters in gate order
        gone = {groups[1]["params"][i] for i in dropped}
        groups[1]["params"] = [groups[1]["params"][i] for i in keep]
        order = [index for group in groups for index in group["params"]]
        renumber = {old: new for new, old in enumerate(order)}
        optimizer["state"] = {renumber[i]: v for i, v in optimizer["state"].items() if i not in gone}
        for group in groups:
            group["params"] = [renumber[i] for i in group["params"]]


def add_new_gates(checkpoint: dict, gates: HeadGates) -> None:
    """Fit a checkpoint whose gates are the first of ``gates`` (a heads-only ``dense.ckpt`` forked with feed-forward
    or layer kinds added) to them: the new gates at their initial ``log_alpha``, their optimiser state fresh (the
    gates' optimiser group, the second, grows; the groups after it move along)."""
    state = checkpoint["state_dict"]
    saved = state.get("gates._extra_state", {}).get("paths")
    if saved is None or saved == gates.paths or gates.paths[: len(saved)] != saved:
        return
    new = [f"gates.gates.{i}.log_alpha" for i in range(len(saved), len(gates.paths))]
    state.update({key: gates.gates[i].log_alpha.detach().clone()
                  for key, i in zip(new, range(len(saved), len(gates.paths)))})
    state["gates._extra_state"] = gates.get_extra_state()
    checkpoint["gate_kinds"] = list(dict.fromkeys(gates.kinds))
    for optimizer in checkpoint.get("optimizer_states", []):
        groups = optimizer["param_groups"]
        end = groups[1]["params"][-1] + 1
        shift = len(new)
        optimizer["state"] = {(i + shift if i >= end else i): v for i, v in optimizer["state"].items()}
        for group in groups[2:]:
            group["params"] = [i + shift for i in group["params"]]
        groups[1]["params"] = groups[1]["params"] + list(range(end, end + shift))


def load_checkpoint_file(path: str | Path) -> dict:
    """A Lightning checkpoint of a gated run, loaded on CPU without running any code from it.

    ``ValueError`` naming the file if it is unreadable, holds objects other than tensors and plain data (a
    pickle that would run code), or is not a gated run's checkpoint.
    """
    try:
        with warnings.catch_warnings():  # a plain pickle's protocol warning: the refusal below says it in its line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt or unsafe: torch raises several types depending on where it breaks
        unsafe = re.search(r"GLOBAL (\S+)", str(err))  # what the file asked to import and call
        refused = None if unsafe else _refused_pickle(path, str(err))
        if unsafe or (refused and refused[0] == "import"):
            raise ValueError(
                f"{path} asks to load {unsafe.group(1) if unsafe else refused[1]}, not only tensors and plain data: "
                "loading it could run code, so it is refused (give a checkpoint written by gatedprune's train.py)"
            ) from None
        if refused:
            raise ValueError(f"{path} holds pickle opcode {refused[1]}, which weights_only loading refuses; give a "
                             "checkpoint written by gatedprune's train.py") from None
        raise ValueError(f"{path} is not a readable checkpoint ({type(err).__name__}); it may be truncated") from None
    missing = [key for key in GATED_CHECKPOINT_KEYS if key not in checkpoint]
    if missing or not any(key.startswith("gates.") for key in checkpoint["state_dict"]):
        raise ValueError(
            f"{path} is not a checkpoint of a gated run (missing {missing or ['gates.*']}); "
            "give a checkpoint written by gatedprune's train.py"
        )
    return checkpoint


def peek_checkpoint(path: str | Path) -> dict:
    """``{"global_step", "hyper_parameters"}`` of a checkpoint, its tensors left on disk (``mmap``): what a fork's
    schedule needs, read before the run is composed. A file that does not load that way is loaded whole by
    ``load_checkpoint_file``, which refuses it in one line if it is truncated or unsafe."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip archive (an old or hand-made file), or broken: the full loader says which
        saved = load_checkpoint_file(path)
    return {"global_step": saved.get("global_step"), "hyper_parameters": saved.get("hyper_parameters") or {}}


def _refused_pickle(path: str | Path, error: str) -> tuple[str, str] | None:
    """What the weights-only loader refused without naming it, having stopped at an opcode it lacks before any
    class (``pickle.dump``'s protocols, ``torch.save(pickle_protocol=4)``): ("import", the first class or function
    the pickle names that it would refuse) or ("opcode", that opcode); None for anything else, such as a truncated
    or corrupt file. The pickle is only read (``pickletools``), never run."""
    unsupported = re.search(r"Unsupported operand (\d+)", error)
    if unsupported is None:
        return None
    try:
        with contextlib.ExitStack() as stack:
            if zipfile.is_zipfile(path):  # torch.save's archive: the object's pickle is its data.pkl
                archive = stack.enter_context(zipfile.ZipFile(path))
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                stream = stack.enter_context(archive.open(name))
            else:
                stream = stack.enter_context(open(path, "rb"))
            name = _first_unsafe_global(stream)
    except Exception:  # not a whole pickle after all
        return None
    if name is not None:
        return "import", name
    op = pickletools.code2op.get(chr(int(unsupported.group(1))))
    return ("opcode", op.name) if op is not None else None


def _first_unsafe_global(stream) -> str | None:
    """The first class or function a pickle names that weights-only loading does not allow (its tensors' own
    rebuild functions are allowed), read from the opcodes alone."""
    from torch import _weights_only_unpickler

    allowed = set(getattr(_weights_only_unpickler, "_get_allowed_globals", dict)())
    pushed: list[str | None] = []  # what each opcode put on the stack, where it is a string
    memo: dict[int, str | None] = {}
    for opcode, arg, _ in pickletools.genops(stream):
        name = None
        if opcode.name in ("GLOBAL", "INST"):
            name = arg.replace(" ", ".")
        elif opcode.name == "STACK_GLOBAL" and len(pushed) >= 2 and None not in pushed[-2:]:
            name = ".".join(pushed[-2:])  # the module and the name pushed just before it
        if name is not None and name not in allowed:
            return name
        if opcode.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif opcode.name.endswith("PUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif opcode.name.endswith("GET"):
            pushed.append(memo.get(arg))
        else:
            pushed.append(arg if isinstance(arg, str) and ("UNICODE" in opcode.name or "STRING" in opcode.name)
                          else None)
    return None


def strip_prefix(state: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """The entries of a Lightning ``state_dict`` under ``prefix`` ("model." or "gates."), with the prefix removed."""
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def config_differences(checkpoint: dict, config: dict) -> list[str]:
    """``field (checkpoint X, config Y)`` for every model config field that differs, metadata left out."""
    saved = checkpoint["hf_config"]
    fields = sorted((saved.keys() | config.keys()) - _IGNORED_CONFIG_FIELDS)
    return [
        f"{field} (checkpoint {saved.get(field)!r}, config {config.get(field)!r})"
        for field in fields
        if saved.get(field) != config.get(field)
    ]


def check_resumable(path: Path, checkpoint: dict, model: torch.nn.Module, kinds: tuple[str, ...]) -> list[str]:
    """Refuse (``ValueError``) a checkpoint whose weights or gates do not fit ``model`` gated on ``kinds``.

    Returns the config fields that differ without changing any shape (dropout, say): the run may go on with them.
    """
    if list(checkpoint["gate_kinds"]) != list(kinds):
        raise ValueError(
            f"resume: {path} gates {list(checkpoint['gate_kinds'])} but pruning.kinds is {list(kinds)}; "
            "resume with the settings that wrote it"
        )
    differences = config_differences(checkpoint, model.config.to_dict())
    saved = strip_prefix(checkpoint["state_dict"], "model.")
    ours = model.state_dict()
    mismatched = sorted(
        name for name in saved.keys() | ours.keys()
        if name not in saved or name not in ours or saved[name].shape != ours[name].shape
    )
    if mismatched:
        what = "; ".join(differences) if differences else f"weights {mismatched[:3]}"
        raise ValueError(
            f"resume: {path} holds a different model than the one configured: {what}; "
            "resume with the model and data settings that wrote it"
        )
    return differences


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``resume`` is "auto" (this run dir's last checkpoint, if there is one),
    None/false (start afresh), a run directory or a checkpoint file inside one (``<run>/checkpoints/*.ckpt``).

    A run that already has a last checkpoint of its own continues from it whatever ``resume`` names: a requeued
    or relaunched member of a sweep forked from ``dense.ckpt`` goes on where it stopped.
    """
    if resume in (None, False, "none", "false"):
        return None
    own = run_dir / "checkpoints" / "last.ckpt"
    _forget_past_a_broken_dense(run_dir / "checkpoints")
    if resume == "auto":
        return own if own.is_file() else None
    checkpoint = named_checkpoint(resume)
    if own.is_file() and own.resolve() != checkpoint.resolve():
        print(f"this run directory has its own {own}: continuing from it rather than from {checkpoint}")
        return own
    return checkpoint


def named_checkpoint(resume: str | None) -> Path | None:
    """The checkpoint file ``resume`` names (a run directory: its ``checkpoints/last.ckpt``), whether or not the run
    goes on from its own last checkpoint instead; None for "auto" and for starting afresh. ``ValueError`` if there
    is none, or it lies outside a run directory (no ``tokenizer/`` beside it)."""
    if resume in (None, False, "none", "false", "auto"):
        return None
    path = Path(resume)
    checkpoint = path / "checkpoints" / "last.ckpt" if path.is_dir() else path
    if not checkpoint.is_file():
        raise ValueError(f"resume={resume!r}: no checkpoint at {checkpoint}; give a run directory or a .ckpt file")
    if not (checkpoint.parents[1] / "tokenizer").is_dir():
        raise ValueError(f"resume={resume!r}: {checkpoint} is not inside a run directory (no tokenizer/ beside it)")
    return checkpoint


def _forget_past_a_broken_dense(checkpoints: Path) -> None:
    """Set this run's ``dense.ckpt`` aside if it is cut short (a full disk before saves were atomic, a copy), with
    its ``last.ckpt``, so the run trains again from its start and writes it again.

    dense.ckpt is saved after the last validation of the dense phase, and last.ckpt just before it, so a run
    continued from last.ckpt never validates that step again and would end "done" with the file still broken
    (and forks from it refused). Training is deterministic on CPU, so the run writes the same dense.ckpt and ends
    where it ended before. Nothing is deleted: both files are renamed ``*.broken``. Only a file that is there but
    does not parse counts (an error reading it, a permission or I/O error, is raised as it is), only rank 0 acts,
    and a dense.ckpt broken again after such a retrain is refused rather than retrained forever.
    """
    dense = checkpoints / "dense.ckpt"
    if rank_zero_only.rank > 0 or not dense.is_file():
        return
    try:  # mmap: the whole file is not read, but a truncated one has lost its index at the end
        torch.load(dense, map_location="cpu", weights_only=True, mmap=True)
        return
    except OSError:  # the file could not be read (permissions, I/O): not evidence that it is broken
        raise
    except Exception as err:  # cut short or corrupt: torch raises several types depending on where it breaks
        why = type(err).__name__
    aside = [checkpoints / f"{name}.broken" for name in ("dense.ckpt", "last.ckpt")]
    if aside[0].exists():
        raise ValueError(f"{dense} does not load ({why}), and neither did the one set aside as {aside[0]} before this "
                         "run trained again: something other than a cut-short file is wrong; allowed: a run directory "
                         "whose checkpoints load (or resume=false to start afresh)")
    print(f"{dense} does not load ({why}): training this run again from its start to write it again (it and "
          f"last.ckpt are kept as {aside[0].name} and {aside[1].name})")
    last = checkpoints / "last.ckpt"
    if last.is_file():  # first: until dense.ckpt goes, a relaunch comes here again
        last.replace(aside[1])
    dense.replace(aside[0])


def checkpoint_model(checkpoint: dict) -> transformers.PreTrainedModel:
    """The model of a loaded checkpoint of the gated trainer (``load_checkpoint_file``), without its gates: its
    config, weights and generation settings."""
    config = transformers.AutoConfig.for_model(**checkpoint["hf_config"])
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.load_state_dict(strip_prefix(checkpoint["state_dict"], "model."))
    if "generation_config" in checkpoint:
        model.generation_config = transformers.GenerationConfig.from_dict(checkpoint["generation_config"])
    return model


def load_gated_checkpoint(path: str | Path) -> tuple[transformers.PreTrainedModel, HeadGates]:
    """Rebuild the gated model of a Lightning checkpoint written by the gated trainer."""
    checkpoint = load_checkpoint_file(path)
    model = checkpoint_model(checkpoint)
    gates = attach_gates(model, checkpoint["gate_kinds"], ffn_group=checkpoint.get("gate_ffn_group", 1),
                         **checkpoint["gate_options"])
    gates.load_state_dict(strip_prefix(checkpoint["state_dict"], "gates."))
    pruning = (checkpoint.get("hyper_parameters") or {}).get("pruning") or {}  # the plan's shape, as the run had it
    gates.set_uniform(pruning.get("uniform_heads", False), pruning.get("uniform_ffn", False))
    return model.eval(), gates
