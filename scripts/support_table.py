"""Build every class of transformers' encoder-decoder mappings tiny, run gatedprune's checks, write the table.

    python scripts/support_table.py [--page docs/guide/models.md] [--json docs/support.json] [--only bart,whisper]

Each class of MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING and MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING is built from its default
config shrunk by ``gatedprune.reports.support.tiny_config`` and checked by ``gatedprune.reports.support.check_kinds``
for each group of kinds (attention heads, FFN units, layers). The table, a column per group, goes between the
support-table markers of the page (the site's Supported models); the JSON lists the classes and their results, which the test suite checks.
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

from gatedprune.reports.support import GROUPS, all_classes, check_kinds

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
            layout, reasons = check_kinds(cls, Path(directory))
        # "supported" and "reason" stay the attention heads' (what they meant before the other kinds existed)
        row.update(layout=layout, supported=reasons["heads"] is None, reason=reasons["heads"],
                   kinds={group: {"supported": reason is None, "reason": reason} for group, reason in reasons.items()})
        row["seconds"] = round(time.perf_counter() - start, 1)
        said = "; ".join(f"{group}: {reason or 'supported'}" for group, reason in reasons.items())
        print(f"{model_type:28} {cls.__name__:48} {layout or '-'}: {said} ({row['seconds']} s)", flush=True)
        rows.append(row)
    return rows


def _cell(row: dict, group: str) -> str:
    """``supported``, the reason, or ``as heads`` where the class failed before any kind was checked."""
    result = row["kinds"][group]
    if result["supported"]:
        return "supported"
    if group != "heads" and result["reason"] == row["kinds"]["heads"]["reason"]:
        return "as heads"
    return result["reason"].replace("|", "\\|")


def table(rows: list[dict]) -> str:
    counts = ", ".join(f"{sum(row['kinds'][group]['supported'] for row in rows)} for {title}"
                       for group, title in GROUPS.items())
    lines = [
        f"Of {len(rows)} classes, supported: {counts} (transformers {transformers.__version__}; "
        "`python scripts/support_table.py` regenerates this table).",
        "",
        "| model_type | class | layout | heads | FFN units | layers |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = " | ".join(_cell(row, group) for group in GROUPS)
        lines.append(f"| {row['model_type']} | {row['class']} | {row['layout'] or '-'} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", "--readme", dest="page", default="docs/guide/models.md",
                        help="the page whose support-table markers the table goes between")
    parser.add_argument("--json", default="docs/support.json")
    parser.add_argument("--only", default=None, help="comma-separated model_types (writes nothing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # a bar per save and load would bury the table
    only = set(args.only.split(",")) if args.only else None
    start = time.perf_counter()
    rows = run(only)
    print(f"{len(rows)} classes checked in {time.perf_counter() - start:.0f} s", flush=True)
    if only:
        return 0
    readme = Path(args.page)
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
