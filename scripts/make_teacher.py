"""Write the kept teacher (teacher/ in the repository) from a finished run of experiment=converge.

    OMP_NUM_THREADS=2 python train.py experiment=converge hydra.run.dir=<runs>/teacher    # hours on 2 CPU cores
    python scripts/make_teacher.py <runs>/teacher [--out teacher] [--overwrite]

It saves the run's checkpoints/dense.ckpt as a Hugging Face directory with the run's tokenizer, scores it
(validation and test BLEU, greedy; the first 100 test pairs again at one thread, which the test suite checks) and
writes teacher.json: the command, the steps, the scores, the weights' sha256. Replace the kept teacher at most
once per issue: every page measures against it.
"""

from __future__ import annotations

import argparse
import json
import sys

from gatedprune.errors import BAD_INPUT, fail
from gatedprune.teacher import TEACHER_DIR, make_teacher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a finished experiment=converge run directory")
    parser.add_argument("--out", default=str(TEACHER_DIR), help=f"where the teacher goes (default {TEACHER_DIR})")
    parser.add_argument("--overwrite", action="store_true", help="replace a teacher already there")
    parser.add_argument("--command", help="the training command to record (default: experiment=converge's)")
    parser.add_argument("overrides", nargs="*", help="data overrides the run was trained with, for scoring")
    args = parser.parse_intermixed_args(argv)
    try:
        made = make_teacher(args.run_dir, args.out, overrides=args.overrides, overwrite=args.overwrite,
                            command=args.command)
    except BAD_INPUT as err:
        return fail(str(err))
    print(json.dumps(made, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
