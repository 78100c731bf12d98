"""The fair reference of a pruned model: the model it started from, trained on for as many steps.

A pruned model trained N steps after the cut is compared with the dense model at the cut, but that model would also
have gained from N more steps (on a held-out corpus the default run shipped 27.28 test BLEU against 27.21 for the
dense model at its fork, and 31.30 for the dense model trained the same 200 steps longer). ``reference=<json>``
names a measurement of those steps, a json with ``test_bleu_at`` ({steps: test BLEU}; ``benchmarks/recovery.py``'s
reference cell writes one for the kept teacher), and the final table shows its test BLEU at the run's own steps (the
gated phase's and the fine-tune's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def load_reference(path: str | Path) -> dict:
    """The json at ``path``, checked at set-up: a ``test_bleu_at`` mapping of step counts to test BLEU."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except OSError:
        raise ValueError(f"reference={path}: no such file; allowed: null, or a json with test_bleu_at (steps: test "
                         "BLEU), e.g. a cell of benchmarks/recovery.py") from None
    except ValueError as err:
        raise ValueError(f"reference={path}: not json ({err}); allowed: a json with test_bleu_at") from None
    at = record.get("test_bleu_at") if isinstance(record, dict) else None
    if not isinstance(at, dict) or not at or not all(
            str(k).isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in at.items()):
        raise ValueError(f"reference={path}: no test_bleu_at of step counts to BLEU; allowed: a json with "
                         "test_bleu_at, e.g. {\"1100\": 23.9}")
    return {"path": str(path), "test_bleu_at": {int(k): float(v) for k, v in at.items()},
            "command": record.get("command")}


def reference_at(reference: dict, steps: int) -> dict:
    """``metrics.json``'s ``reference``: the reference's test BLEU at ``steps`` (None where it was not measured)."""
    return {"path": reference["path"], "steps": steps, "test_bleu": reference["test_bleu_at"].get(steps),
            "measured_at": sorted(reference["test_bleu_at"]), "command": reference["command"]}
