"""A warm start for the tests' ``train.py`` runs: this process imports the package once, then forks one child per
request, and each child runs ``train.py`` as ``python train.py ARGS`` would (``helpers.run_train``).

Importing torch, Lightning, transformers and the package takes 3-7 s on the CI machine, about as long as a smoke
run itself, and the suite starts some 150 such runs. A forked child starts from the imported modules with nothing
run yet, so what a run does is what a fresh process does: its own working directory, environment, stdout and
stderr (files, at the descriptor level, so nothing printed is lost), exit status (``SystemExit``'s code, or the
excepthook's report and 1, or SIGINT after an uncaught ``KeyboardInterrupt``), and exit handlers.

Protocol, one JSON object per line: a request ``{"id", "argv", "cwd", "env", "prefix", "stdout", "stderr",
"timeout"}`` on stdin, the answer ``{"id", "returncode"}`` (or ``{"id", "timeout": true}``, the child killed) on
stdout. The server ends at the end of its stdin. What the libraries read from the environment when imported is
fixed at the server's start, so a run whose environment differs from the server's in anything but the variables read
when used (``helpers.READ_WHEN_USED``) is started as a process of its own instead. What forking cannot give each
run: its own string hash seed (every run here shares the server's).
"""

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = list(sys.path)  # as the interpreter set it: [this folder, the standard library, site-packages, ...]
sys.path.insert(0, str(ROOT))
STARTED = dict(os.environ)

import gatedprune.cli  # noqa: E402,F401  (what train.py imports, loaded once)
import gatedprune.train  # noqa: E402,F401

# what the imports put in the environment, as they would in a fresh process on top of the run's own
IMPORTS_SET = {k: v for k, v in os.environ.items() if STARTED.get(k) != v}


def _child(request: dict) -> tuple[int, bool]:
    """Run the request in this (forked) process: (its exit status, whether it ends by SIGINT)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **IMPORTS_SET})
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)  # the requests stay the server's
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # sys.path as `python -c` (a prefix: the working directory first) or `python train.py` (its folder) sets it
    sys.path[:] = ["" if request["prefix"] else str(Path(request["argv"][0]).parent), *PATH[1:]]
    code, interrupted = 0, False
    try:
        script = "; ".join(request["prefix"]) or "pass"
        exec(compile(script, "<prefix>", "exec"), {"__name__": "__prefix__"})
        sys.argv = list(request["argv"])
        import runpy

        runpy.run_path(request["argv"][0], run_name="__main__")
    except SystemExit as stop:  # as the interpreter reads it
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code & 0xFF  # as the operating system keeps it: sys.exit(-1) is 255
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    try:  # the interpreter's own ending: wait for the threads left running, then the exit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code, interrupted


def _end(code: int, interrupted: bool) -> None:
    """Exit with ``code``, or by SIGINT, as the interpreter ends itself after an uncaught Ctrl-C."""
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.05)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            ending = (1, False)
            try:
                ending = _child(request)
            finally:
                _end(*ending)
        answer = {"id": request["id"], **_wait(pid, request["timeout"])}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
