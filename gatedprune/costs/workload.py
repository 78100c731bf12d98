"""What a cost is predicted for (``pruning.workload``): one generate() call, on a device, in a runtime."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gatedprune.utils import check_numbers

RUNTIMES = ("torch", "ct2")  # generate() in PyTorch, or CTranslate2's translate_batch (gatedprune[deploy])
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Workload:
    """Sentences of ``source_tokens`` tokens decoded to exactly ``target_tokens`` new tokens, ``batch`` at a time,
    greedy (``num_beams`` 1) or beam search, in ``runtime`` on ``device``. ``table``: a latency fit measured
    elsewhere (``gatedprune-latency`` on the user's server) used instead of timing here."""

    source_tokens: int = 32
    target_tokens: int = 32
    batch: int = 1
    num_beams: int = 1
    runtime: str = "torch"
    device: str = "cpu"
    # CPU threads while timing (torch.set_num_threads / ct2 intra_threads); None: as torch is set. One by default: CPU
    # time (what is timed on the CPU) is the sum over threads, and a shared machine's second core mostly waits
    threads: int | None = 1
    quantization: str | None = None  # ct2 only: the compute type timed (int8, ...); None: float32
    repeats: int = 3  # timings per probe model (median), alternating between them
    probe_fractions: tuple = (0.5, 0.0)  # each kind shrunk to these fractions of its structures, one copy each
    # and every kind shrunk at once to each fraction, one copy each: a plan cuts every kind. With them the fits the
    # 5% rule keeps price a plan more alike from timing to timing (docs/gates.md 0c: a plan's predicted speed-up moved
    # 2.8% and 4.7% across 20 orders of a quiet and a busy record's timings, 4.5% and 7.3% without them), though not
    # so alike that two runs each timing their own fit ship one plan (2,510 structures apart)
    joint_probes: bool = True
    # the probes are timed again while the fit misses one of them by more than keep_tolerance, up to fit_attempts
    # timings in all. A fit within keep_tolerance is kept in the machine's cache and prices every later run here: the
    # standard of a table (gatedprune-latency), as a fit of one timing at 20% can be a fit of its noise on a shared
    # machine (docs/gates.md 0c: the kinds' shares moved 0-49% between such fits; fits at 5.6% and 10% gave plans 4
    # and 2 BLEU below random structures). One that only meets fit_tolerance after the last timing prices this run
    # (and forks of its checkpoint) alone; beyond fit_tolerance it is refused: a burst of load gave 24-33% in default runs
    fit_tolerance: float = 0.2
    keep_tolerance: float = 0.05
    fit_attempts: int = 15
    table: str | None = None

    def __post_init__(self) -> None:
        check_numbers("pruning.workload", self)
        for name in ("source_tokens", "target_tokens", "batch", "num_beams", "repeats", "fit_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"pruning.workload.{name}={value!r}; allowed: an integer >= 1")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"pruning.workload.threads={self.threads!r}; allowed: null or an integer >= 1")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"pruning.workload.runtime={self.runtime!r}; allowed: {', '.join(RUNTIMES)}")
        if self.device not in DEVICES:
            raise ValueError(f"pruning.workload.device={self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.quantization is not None and self.runtime != "ct2":
            raise ValueError(f"pruning.workload.quantization={self.quantization!r} with runtime {self.runtime}; "
                             "allowed: null (a compute type is CTranslate2's: runtime ct2)")
        for name in ("fit_tolerance", "keep_tolerance"):
            if not getattr(self, name) > 0:  # a number (check_numbers)
                raise ValueError(f"pruning.workload.{name}={getattr(self, name)!r}; allowed: a fraction > 0")
        if not isinstance(self.joint_probes, bool):
            raise ValueError(f"pruning.workload.joint_probes={self.joint_probes!r}; allowed: true or false")
        fractions = tuple(self.probe_fractions)
        if not fractions or any(isinstance(f, bool) or not 0 <= f < 1 for f in fractions):
            raise ValueError(f"pruning.workload.probe_fractions={list(fractions)}; allowed: one or more fractions "
                             "in [0, 1)")
        object.__setattr__(self, "probe_fractions", fractions)

    @property
    def aim(self) -> float:
        """What the probes are timed again for: a fit within it is kept for later runs (and within fit_tolerance)."""
        return min(self.keep_tolerance, self.fit_tolerance)

    @property
    def aim_setting(self) -> str:
        """The option ``aim`` is, as a run sets it."""
        name = "keep_tolerance" if self.keep_tolerance < self.fit_tolerance else "fit_tolerance"
        return f"pruning.workload.{name}={self.aim:g}"

    def decoding(self) -> dict:
        """What the cost depends on besides the model and the machine (the cache key's workload part), and how it was
        measured."""
        keep = ("source_tokens", "target_tokens", "batch", "num_beams", "runtime", "device", "threads", "quantization",
                "repeats", "probe_fractions", "joint_probes")  # the last three: how it was measured, which a fit
        # depends on too; joint_probes only when on, so a fit on the probes of one kind each keeps the key it was
        # cached under before the joint probes
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if k in keep and (k != "joint_probes" or v)}  # as JSON has it

    @classmethod
    def of(cls, value) -> "Workload":
        """From a config mapping (unknown keys refused in one line), or a ``Workload``."""
        if isinstance(value, cls):
            return value
        value = dict(value or {})
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"pruning.workload has unknown key(s) {unknown}; allowed: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        if isinstance(value.get("probe_fractions"), (list, tuple)) or hasattr(value.get("probe_fractions"), "__len__"):
            value["probe_fractions"] = tuple(value["probe_fractions"])
        return cls(**value)
