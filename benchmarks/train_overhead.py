"""What the head gates cost while training: one optimiser step with gates attached against the plain model.

A step is what GatedSeq2Seq.training_step does once gating has started: forward with gate noise drawn, label-smoothed
cross-entropy plus lambda times the L0 penalty, backward, AdamW (model weights, and the gates in their own group),
then the gates' clamp. The plain model does the same without gates and penalty. Both start from the same weights,
see the same batches and are timed alternately in one process; the table gives the median step time of each and
their ratio (the target is at most 1.05).

    .venv/bin/python benchmarks/train_overhead.py [--quick] [--threads 2] [--out docs/benchmarks/train_overhead.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, when run as a script or loaded by a test
from common import MODELS, ROOT, alternate, command_line, machine, versions  # noqa: E402

from gatedprune import attach_gates  # noqa: E402
from gatedprune.utils import atomic_write_text, format_table, markdown_table  # noqa: E402

# (model, sentences per batch, tokens per sentence, repeats, gated): batches of 2,048 tokens per side, as conf/data's
# max_tokens gives, and a small one where fixed per-step costs weigh more; a Transformer-base step takes about 15 s
# on one thread, hence fewer repeats. The row with gated False times the plain model against a copy of itself: the
# noise of the machine.
FULL = [("default", 64, 32, 15, True), ("default", 64, 32, 15, False), ("default", 8, 32, 15, True),
        ("transformer-base", 64, 32, 7, True)]
QUICK = [("default", 8, 16, 3, True)]


class Trainer:
    """One model, its optimiser and (if gated) its gates; ``step(batch)`` is one training step."""

    def __init__(self, model: torch.nn.Module, gated: bool, l0_lambda: float = 0.1):
        self.model = model.train()
        self.gates = attach_gates(model).set_mode("sample") if gated else None
        self.l0_lambda = l0_lambda
        groups = [{"params": list(model.parameters()), "lr": 1e-4}]
        if self.gates is not None:
            groups.append({"params": list(self.gates.parameters()), "lr": 0.1, "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.98))

    def step(self, batch: dict) -> None:
        logits = self.model(  # (B, T, V)
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
        ).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)
        if self.gates is not None:
            loss = loss + self.l0_lambda * self.gates.penalty()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.gates is not None:
            self.gates.clamp_()


def batches(vocab_size: int, sentences: int, length: int, count: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        src = torch.randint(3, vocab_size - 1, (sentences, length), generator=g)  # (B, T)
        tgt = torch.randint(3, vocab_size - 1, (sentences, length + 1), generator=g)
        out.append({"input_ids": src, "attention_mask": torch.ones_like(src), "decoder_input_ids": tgt[:, :-1],
                    "labels": tgt[:, 1:]})
    return out


def measure(name: str, sentences: int, length: int, repeats: int, gated: bool = True) -> tuple:
    """Median ms of a plain and a gated training step (``gated`` False: two plain copies), and their ratio."""
    torch.manual_seed(0)
    model = MODELS[name]()
    plain, other = Trainer(copy.deepcopy(model), gated=False), Trainer(model, gated=gated)
    data = batches(model.config.vocab_size, sentences, length)
    rounds = {plain: 0, other: 0}  # both trainers take batch i in round i

    def job(trainer: Trainer) -> None:
        trainer.step(data[rounds[trainer] % len(data)])
        rounds[trainer] += 1

    plain_t, other_t = alternate(job, [plain, other], repeats)
    params = sum(p.numel() for p in model.parameters())
    return (name, f"{params:,}", f"{sentences} x {length}", "gated" if gated else "plain (noise)", repeats,
            f"{1000 * plain_t.wall:.1f}", f"{1000 * other_t.wall:.1f}", f"{other_t.wall / plain_t.wall:.3f}",
            f"{1000 * plain_t.cpu:.1f}", f"{1000 * other_t.cpu:.1f}", f"{other_t.cpu / plain_t.cpu:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default model, small batches, 3 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see speed.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/train_overhead.md")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)

    header = ["model", "params", "batch (sentences x tokens)", "against plain", "repeats", "plain ms", "other ms",
              "other / plain", "plain CPU ms", "other CPU ms", "other / plain (CPU)"]
    rows = []
    for config in QUICK if args.quick else FULL:
        rows.append(measure(*config))
        print(format_table(header, rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(format_table(header, rows))
    text = "\n".join([
        "# Training overhead of the head gates", "",
        f"`{command_line('train_overhead.py', argv)}`", "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; {machine()}; {versions()}.", "",
        "Median wall time of one training step (forward, backward, AdamW) of the plain model and of the same model "
        "with gates attached (gate noise drawn, L0 penalty, gate clamp), same batches, timed alternately. The row "
        "\"plain (noise)\" times the plain model against a copy of itself. CPU ms is the CPU time the process used "
        "(one torch thread), which other processes on the machine move much less than the wall time.", "",
        markdown_table(header, rows),
    ])
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
