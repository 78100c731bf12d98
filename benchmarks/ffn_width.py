"""Greedy decoding time of a model whose decoder FFN is narrowed a little, against the model itself (batch 1).

    .venv/bin/python benchmarks/ffn_width.py CHECKPOINT [WIDTH ...]

Each width keeps the first WIDTH units of every decoder feed-forward block (``prune_heads``); the models are timed
alternately in one process, one thread, 8 random sources x 32 greedy tokens, median of 7, twice. Prints CPU time
relative to an uncut copy (above 1: slower); the model as loaded is timed too.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate  # noqa: E402

from gatedprune.structures.adapters import probe  # noqa: E402
from gatedprune.structures.ffn import ffn_sites  # noqa: E402
from gatedprune.surgery.cut import prune_heads  # noqa: E402
from gatedprune.training.checkpoints import load_gated_checkpoint  # noqa: E402


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    dense, gates = load_gated_checkpoint(argv[0])
    gates.remove()
    sites = ffn_sites(dense, "decoder", probe(dense).layers["decoder"], "decoder_ffn")
    models = {f"loaded, FFN {sites[0].width}": dense}
    for width in map(int, argv[1:] or [str(sites[0].width), "1016", "1015", "960", "768"]):
        model = copy.deepcopy(dense)  # a copy even where nothing is cut: the copy, not the load, is the reference
        prune_heads(model, {site.path: list(range(width)) for site in sites})
        models[f"copy, FFN {width}"] = model.eval()
    ids = torch.randint(4, dense.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))

    def job(model):
        with torch.no_grad():
            for _ in range(8):
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                               min_new_tokens=32, do_sample=False, num_beams=1)

    for repeat in range(2):
        times = alternate(job, list(models.values()), 7)
        print(f"run {repeat}: CPU time / uncut copy: " + ", ".join(
            f"{name} {t.cpu / times[1].cpu:.3f}" for name, t in zip(models, times)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
