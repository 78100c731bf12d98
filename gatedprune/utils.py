"""Small helpers shared by the run, the exporter and the sweep summary."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from gatedprune.errors import NoSpaceLeft


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename, so readers never see half a file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    atomic_write_with(path, lambda f: f.write(data))


def atomic_write_with(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, flush it to the disk, then rename it over ``path``.

    Beside the target, so on its file system: the rename is atomic there, where a file staged in $TMPDIR would
    be copied across (half of it, on a full disk). Readers see the old file or the new one; a failed write leaves
    the old one as it was and nothing else. A full disk is ``NoSpaceLeft`` naming ``path``.
    """
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes the file private; a result file is as readable as any
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC and not isinstance(err, NoSpaceLeft):
            raise NoSpaceLeft(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def format_table(header: list[str], rows: list[tuple]) -> str:
    """A plain-text table with aligned columns."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[tuple]) -> str:
    """A Markdown table, one line per row."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def finite_or_none(value):
    """``value`` with every non-finite float (nan, inf) replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_json(path: str | Path, data) -> None:
    """Write ``data`` as strict JSON (a non-finite number becomes null: ``Infinity`` is not JSON), atomically."""
    atomic_write_text(path, json.dumps(finite_or_none(data), indent=2, allow_nan=False) + "\n")


def check_numbers(section: str, config, values: dict | None = None) -> None:
    """``ValueError`` naming the first field of dataclass ``config`` whose default is a number (or a tuple of numbers)
    and whose value is not one (or a list of them), or is nan or inf: no option means anything at infinity, nan passes every ``<``
    check silently, and a string would fail later with a TypeError that names no option.

    ``config`` may be a dataclass type with ``values`` the mapping it is about to be built from.
    """

    def is_number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for field in dataclasses.fields(config):
        default = field.default
        if default is dataclasses.MISSING:
            default = None if field.default_factory is dataclasses.MISSING else field.default_factory()
        if values is not None and field.name not in values:
            continue
        value = values[field.name] if values is not None else getattr(config, field.name)
        annotation = str(field.type)  # a string under ``from __future__ import annotations``
        numeric = is_number(default) or (isinstance(default, tuple) and default and all(map(is_number, default)))
        if default is None and ("float" in annotation or "int" in annotation) and not annotation.startswith("dict"):
            numeric = True  # an optional number: None is allowed, anything else must be a finite number
        if not numeric or (value is None and "None" in annotation):
            continue
        if isinstance(value, (tuple, list)) and not (isinstance(default, tuple) or "list" in annotation):
            raise ValueError(f"{section}.{field.name}={list(value)} is a list; allowed: one number")
        if isinstance(value, dict) and "dict" in annotation:  # per-kind numbers, e.g. a head budget per kind
            numbers = list(value.values())
        else:
            numbers = list(value) if isinstance(value, (tuple, list)) else [value]
        shown = list(value) if isinstance(value, (tuple, list)) else repr(value) if isinstance(value, str) else value
        if not all(map(is_number, numbers)):
            raise ValueError(f"{section}.{field.name}={shown} is not a number; allowed: numbers")
        if not all(math.isfinite(v) for v in numbers):
            raise ValueError(f"{section}.{field.name}={shown} is not a finite number; allowed: finite numbers")
