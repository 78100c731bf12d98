"""What several test modules need: the offline environment and `train.py` run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def offline_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, unbuffered, without the debug switch that shows tracebacks."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **extra}
    for leaked in ("GATEDPRUNE_DEBUG", "WANDB_SERVICE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # set by earlier tests
        env.pop(leaked, None)
    return env


def run_train(run_dir: Path, *overrides: str, flags=(), cwd: Path | None = None, timeout: int = 300,
              prefix=(), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python train.py <flags> experiment=smoke hydra.run.dir=<run_dir> <overrides>`` to its end.

    ``prefix``: Python statements run before train.py (as ``python -c``), e.g. to break something on purpose.
    ``env``: variables set for it besides the offline ones.
    """
    args = [*flags, "experiment=smoke", f"hydra.run.dir={run_dir}", *overrides]
    env, cwd = offline_env(**(env or {})), cwd or run_dir.parent
    if _SERVER.takes(env):  # the same run, forked from a process that has imported the package already
        return _SERVER.run([str(ROOT / "train.py"), *args], cwd, env, prefix, timeout)
    if prefix:
        script = "; ".join([*prefix, "import runpy, sys", f"sys.argv = {[str(ROOT / 'train.py'), *args]!r}",
                            f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"])
        command = [sys.executable, "-c", script]
    else:
        command = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


# the environment variables that differ from test to test and that nothing reads when imported: a run whose environment
# differs from the train server's in any other (a hub or cache path, threads, a debug switch) starts a process of its
# own, since the server's imports have read theirs already
READ_WHEN_USED = ("GATEDPRUNE_CACHE", "PYTEST_CURRENT_TEST")


class _TrainServer:
    """This worker's ``tests/train_server.py``, started at its first run: ``train.py`` runs forked from a process that
    has imported the package once, instead of each importing it anew (seconds each; see that file)."""

    def __init__(self):
        self.process, self.env, self.log, self.requests = None, None, None, 0

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a run with this environment can be forked from the server (the one running, else the one ``run``
        would start)."""
        if os.environ.get("GATEDPRUNE_TEST_SERVER", "1") == "0":  # every run a process of its own
            return False
        served = self.env if self._alive() else offline_env()
        changed = {k for k in set(env) | set(served) if env.get(k) != served.get(k)}
        return changed <= set(READ_WHEN_USED)

    def _alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], prefix, timeout: int):
        if not self._alive():  # started at the first run it serves
            self.env = offline_env()
            self.log = tempfile.NamedTemporaryFile(prefix="train-server-", suffix=".log", delete=False)
            self.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "train_server.py")],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                            text=True, env=self.env, cwd=ROOT, start_new_session=True)
        self.requests += 1
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"id": self.requests, "argv": argv, "cwd": str(cwd), "env": env, "prefix": list(prefix),
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                answer = self.process.stdout.readline()  # the server kills a run at its timeout, then answers
                if not answer:
                    raise RuntimeError(f"the train server ended (exit {self.process.wait()}) during {argv}: "
                                       f"{Path(self.log.name).read_text()[-2000:]}")
                answer = json.loads(answer)
                if answer["id"] != request["id"]:
                    raise RuntimeError(f"the train server answered request {answer['id']}, not {request['id']}")
            except BaseException:  # interrupted or out of step: the server and its run go, the next run starts afresh
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                self.process = None
                raise
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, answer["returncode"], stdout, stderr)


_SERVER = _TrainServer()


# seconds per structure of each kind, and per generate() call, that the fake latency timer charges: a test never
# times for real (on a loaded machine the smoke model's measured floor rose above the default target)
FAKE_COSTS = {"encoder": 3e-4, "decoder": 5e-4, "cross": 4e-4, "encoder_ffn": 2e-5, "decoder_ffn": 3e-5,
              "encoder_layer": 1e-3, "decoder_layer": 2e-3}
FAKE_BASE = 0.01


def fake_timer(models, workload) -> list[float]:
    """The latency fit's timer, charging FAKE_BASE + sum_k FAKE_COSTS[k] n_k seconds (n_k: structures counted by name)."""
    return [FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in bart_structures(model).items()) for model in models]


# the same timer installed in a train.py subprocess (run_train's prefix) before it starts
FAKE_TIMER = ("import sys", f"sys.path.insert(0, {str(ROOT / 'tests')!r})", "import helpers",
              "import gatedprune.costs.timers as timers", "timers.TIMERS['torch'] = helpers.fake_timer")
# a latency budget on the smoke model, every kind gated, priced by FAKE_TIMER on a short workload (run_train's overrides)
SMOKE_LATENCY = ("pruning=l0_budget", "pruning.target_latency=0.6",
                 "pruning.kinds=[encoder,decoder,cross,encoder_ffn,decoder_ffn,encoder_layer,decoder_layer]",
                 "pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4", "pruning.workload.repeats=1")


def refused_at_setup(run_dir: Path, *overrides: str) -> str:
    """The one error line of a smoke run refused at set-up (exit 2), which left no run directory behind."""
    proc = run_train(run_dir, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not run_dir.exists()  # refused before anything was trained or written
    return error_line(proc)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused or failed command prints on stderr, ``error: ...``."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def compose_train(output_dir: Path | str, *overrides: str, hydra_config: bool = False):
    """The real conf/ composed as ``python train.py <overrides>`` would, writing into ``output_dir``."""
    from hydra import compose, initialize_config_dir

    import gatedprune.train  # noqa: F401  (as train.py does: the configs' resolvers, gp.sub, gp.teacher, ...)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={output_dir}", *overrides],
                       return_hydra_config=hydra_config)


def gated_module(tmp_path: Path, max_bad_steps: int = 3):
    """A ``GatedSeq2Seq`` of a tiny mBART under ``pruning=l0``, with a two-token tokenizer: for the training steps'
    own guards (non-finite losses and gradients), without a trainer's data."""
    import tokenizers
    import transformers

    from families import tiny_model
    from gatedprune.methods.gated import L0
    from gatedprune.reports.scoring import GenerationConfig
    from gatedprune.training.module import GatedSeq2Seq, OptimConfig

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 1, "<unk>": 0}, "<unk>")),
        pad_token="<pad>",
    )
    model = tiny_model("mbart", tmp_path)
    return GatedSeq2Seq(model, tokenizer, L0(), OptimConfig(max_bad_steps=max_bad_steps), GenerationConfig(), tmp_path)


def train_dense(run_dir: Path) -> Path:
    """``run_dir`` after a smoke run that stops at the end of its dense phase (10 steps): the trained model the
    baselines prune."""
    proc = run_train(run_dir, "trainer.max_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def bart_structures(model) -> dict:
    """Structures of a (possibly pruned) BART-like model per kind, read off its modules by name: a count independent
    of gatedprune's site finder (gatedprune.costs.counts)."""
    from gatedprune.structures.kinds import ALL_KINDS

    counts = dict.fromkeys(ALL_KINDS, 0)
    head_dim = model.config.d_model // model.config.encoder_attention_heads
    for stack in ("encoder", "decoder"):
        layers = getattr(model.model, stack).layers
        counts[f"{stack}_layer"] += len(layers)
        for layer in layers:
            counts[stack] += layer.self_attn.q_proj.out_features // head_dim
            counts[f"{stack}_ffn"] += layer.fc1.out_features
            if stack == "decoder":
                counts["cross"] += layer.encoder_attn.q_proj.out_features // head_dim
    return counts


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tiny_bart3():
    """A tiny BART with 3 + 3 layers, 4 heads, FFN width 12 (seeded): three layers a stack, so counts round."""
    import torch
    import transformers

    from families import FAMILY_CONFIGS

    config = FAMILY_CONFIGS["bart"]()
    config.encoder_layers = config.decoder_layers = 3
    config.encoder_ffn_dim = config.decoder_ffn_dim = 12
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
