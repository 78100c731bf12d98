"""Build every class of transformers' encoder-decoder mappings tiny, run gatedprune's checks, write the table.

    python scripts/support_table.py [--readme README.md] [--json docs/support.json] [--only bart,whisper]

Each class of MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING and MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING is built from its default
config shrunk by ``gatedprune.reports.support.tiny_config`` and checked by ``gatedprune.reports.support.check_class``. The table
goes between the support-table markers of the README; the JSON lists the supported classes the test suite checks.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

from gatedprune.reports.support import NotSupported, all_classes, check_class

BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"


def run(only: set[str] | None = None) -> list[dict]:
    rows = []
    for model_type, cls in all_classes():
        if only and model_type not in only:
            continue
        start = time.perf_counter()
        row = {"model_type": model_type, "class": cls.__name__}
        with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                row.update(layout=check_class(cls, Path(directory)), supported=True, reason=None)
            except NotSupported as error:
                row.update(layout=None, supported=False, reason=str(error))
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{model_type:28} {cls.__name__:48} {row['layout'] or row['reason']} ({row['seconds']} s)", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    supported = sum(row["supported"] for row in rows)
    lines = [
        f"{supported} of {len(rows)} classes supported (transformers {transformers.__version__}; "
        "`python scripts/support_table.py` regenerates this table).",
        "",
        "| model_type | class | layout | status |",
        "|---|---|---|---|",
    ]
    for row in rows:
        status = "supported" if row["supported"] else row["reason"].replace("|", "\\|")
        lines.append(f"| {row['model_type']} | {row['class']} | {row['layout'] or '-'} | {status} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--json", default="docs/support.json")
    parser.add_argument("--only", default=None, help="comma-separated model_types (writes nothing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    only = set(args.only.split(",")) if args.only else None
    rows = run(only)
    if only:
        return 0
    readme = Path(args.readme)
    text = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        print(f"{readme} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    readme.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table(rows)}\n{END}", text))
    Path(args.json).write_text(json.dumps(
        {"transformers": transformers.__version__,
         "classes": [{k: v for k, v in row.items() if k != "seconds"} for row in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
