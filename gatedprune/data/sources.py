"""Sentence pairs from local files (.tsv, .jsonl, .parquet) and Hugging Face datasets, with their checks.

Columns are ``src_key`` and ``tgt_key`` (default: the language codes), or a nested ``translation`` column of
``{src_key: ..., tgt_key: ...}`` dicts as in WMT. Errors name the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq

Pair = tuple[str, str]
FILE_SUFFIXES = (".tsv", ".jsonl", ".parquet")

def pairs_from_columns(columns: dict[str, list], src_key: str, tgt_key: str, origin: str) -> list[Pair]:
    """Pairs from columns ``src_key`` and ``tgt_key``, or from a ``translation`` column of dicts holding both."""
    if src_key in columns and tgt_key in columns:
        return list(zip(columns[src_key], columns[tgt_key]))
    if "translation" in columns and len(columns["translation"]) > 0:
        first = columns["translation"][0]
        for key in (src_key, tgt_key):
            if key not in first:
                raise ValueError(f"{origin}: translation column has no key {key!r}; its keys are {sorted(first)}")
        return [(row[src_key], row[tgt_key]) for row in columns["translation"]]
    missing = next(key for key in (src_key, tgt_key) if key not in columns)
    raise ValueError(f"{origin}: no column {missing!r}; the columns are {sorted(columns)}")


HEADER_NAMES = {"source", "target", "src", "tgt"}  # with the language keys: what a TSV header line says


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; ``ValueError`` naming the file and line of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {data[err.start]:#04x}); allowed: UTF-8 text") from None


def _lines(path: Path) -> list[str]:
    """The file's lines, split on "\\n" only (str.splitlines also breaks on U+2028, U+0085 and form feed, which
    are text inside a field), a trailing "\\r" and a UTF-8 byte-order mark (which would hide a TSV header) removed."""
    text = _read_text(path).removeprefix("\ufeff")
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines and not lines[-1] else lines  # the last line's newline ends it, it starts no new one


def is_header(fields: list[str], src_key: str, tgt_key: str) -> bool:
    """True when a TSV's first line names its columns (``en<TAB>fr``, ``source<TAB>target``) rather than a pair."""
    names = {field.strip().lower() for field in fields}
    return names <= HEADER_NAMES | {src_key.lower(), tgt_key.lower()} and len(names) == 2


def read_pairs_file(path: str | Path, src_key: str, tgt_key: str, header: bool | None = None) -> list[Pair]:
    """Pairs from a .tsv (source<TAB>target), .jsonl or .parquet file.

    A TSV's first line is skipped when ``header`` is True, or when it is None and the line names the columns
    (``is_header``).
    """
    path = Path(path)
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"unknown file extension {path.suffix!r} of {str(path)!r}; allowed: {list(FILE_SUFFIXES)}")
    if not path.is_file():
        raise ValueError(f"data file not found: {str(path)!r}")
    if path.suffix == ".tsv":
        rows = []
        for number, line in enumerate(_lines(path), start=1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: expected 2 tab-separated fields, found {len(fields)}")
            rows.append((fields[0], fields[1]))
        if rows and (header or (header is None and is_header(list(rows[0]), src_key, tgt_key))):
            print(f"{path}: skipped the header line {rows[0]}")
            rows = rows[1:]
        return rows
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(_lines(path), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
            rows.append(row)
        columns = {key: [row.get(key) for row in rows] for key in (rows[0] if rows else {})}
    else:
        columns = pq.read_table(path).to_pydict()
    return pairs_from_columns(columns, src_key, tgt_key, origin=str(path))


def load_hf_pairs(
    name: str, config: str | None, splits: dict[str, str], src_key: str, tgt_key: str
) -> dict[str, list[Pair]]:
    """Pairs per split of a Hugging Face dataset (hub id, data-file directory, or a ``save_to_disk`` directory).

    ``splits`` maps our split names to the dataset's, e.g. {"train": "train", "validation": "dev"}.
    """
    saved_to_disk = (Path(name) / "dataset_dict.json").is_file()
    data = datasets.load_from_disk(name) if saved_to_disk else None
    pairs = {}
    for split, hf_split in splits.items():
        if saved_to_disk:
            if hf_split not in data:
                raise ValueError(f"dataset {name!r} has no split {hf_split!r}; its splits are {sorted(data)}")
            dataset = data[hf_split]
        else:  # load_dataset's own error for an unknown split names it and the splits that exist
            dataset = datasets.load_dataset(name, config, split=hf_split)
        columns = {column: dataset[column] for column in dataset.column_names}  # lazy columns: nothing is read yet
        pairs[split] = pairs_from_columns(columns, src_key, tgt_key, origin=f"dataset {name!r} split {hf_split!r}")
    return pairs


def drop_empty_pairs(pairs: list[Pair], origin: str) -> list[Pair]:
    """The pairs whose source and target both hold text; says how many were dropped (an empty side, or None)."""
    kept = [(s, t) for s, t in pairs if isinstance(s, str) and isinstance(t, str) and s.strip() and t.strip()]
    if len(kept) < len(pairs):
        print(f"{origin}: dropped {len(pairs) - len(kept)} of {len(pairs)} pairs with an empty source or target")
    return kept
