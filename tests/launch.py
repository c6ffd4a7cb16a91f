"""`python tests/launch.py -n N [-m] [--stdout FMT] [--stderr FMT] SCRIPT [ARGS...]`: one node's
`composer -n N`, for the tests whose subject is what the ranks do, not the launcher.

It starts each rank with the environment Composer 0.32.1's launcher gives it (composer/cli/launcher.py,
`_launch_processes`) and, like it, stops the others when one fails. Without --preload it imports only the
standard library: `composer` itself imports all of Composer first, 4.5 s of CPU per launch and about
50 s of a `make test` run, where the CPU is the limit. Composer's own launcher stays under test where a
user's command goes through it: the Slurm job (launch/) and the NaN guard's two ranks.

`--preload MODULE[,MODULE]` (or `--preload stack`: STACK): import those modules once here, then fork
each rank from this process, which runs SCRIPT as `python SCRIPT` would (its environment, argv,
sys.path[0], unbuffered output, exit status, thread join and atexit handlers), without importing them
again: importing the whole stack is ~7 s of CPU per rank (2026-11-29), and `make test` launches ~35
times 2 or 4 ranks. Preload only modules whose import reads no rank variable (RANK, LOCAL_RANK...):
Composer's does (composer/utils/checkpoint.py names the sharded file `__{rank}_0.distcp` at import, and
rank 1 then looked for rank 0's file), and torchmetrics' (rank_zero_only.rank), so STACK stops below
them: torch, diffusers, transformers, peft, accelerate, ~4.7 s of the ~7. The launcher stays one
thread until it forks, and starts new interpreters instead where the preload initialised CUDA.
Forked ranks share the launcher's hash seed (PYTHONHASHSEED): the FSDP2 references the sharded tests
compare against run with exec'd ranks (tests/conftest.py), so that a rank-dependent set order shows.
"""

import argparse
import atexit
import builtins
import importlib
import importlib.machinery
import io
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

# The libraries under Composer (see above): compat.torchao first, as models/__init__.py imports it.
STACK = (
    "compat.torchao",
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torchvision",
    "transformers",
    "transformers.modeling_utils",
    "diffusers",
    "diffusers.models",
    "peft",
    "accelerate",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What Composer's launcher sets for local rank `rank` of a single-node run."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


class ForkedRank:
    """A rank forked from this process, with the part of subprocess.Popen's interface `wait` uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by a poll the SIGTERM handler interrupted
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _run_rank(args, env: dict[str, str], streams: dict) -> None:
    """In a forked child: SCRIPT (or -m MODULE) as `python` would run it in `env`; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        for fd, stream in ((1, streams.get("stdout")), (2, streams.get("stderr"))):
            if stream is not None:
                os.dup2(stream.fileno(), fd)
        # PYTHONUNBUFFERED=1, as the rank's environment asks of a new interpreter (`python -u`).
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            new = io.TextIOWrapper(
                open(fd, "wb", 0, closefd=False), encoding=old.encoding, errors=old.errors, write_through=True
            )
            setattr(sys, name, new)
            setattr(sys, f"__{name}__", new)
        if args.module:  # what `python -m` runs: the module as __main__, the working folder first on the path
            sys.argv = [args.script, *args.args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(args.script, alter_argv=True)
        else:  # what `python SCRIPT` runs: a __main__ module that stays for the atexit handlers
            path = os.path.abspath(args.script)
            sys.argv = [args.script, *args.args]
            sys.path[0] = os.path.dirname(path)
            main = types.ModuleType("__main__")
            main.__file__, main.__builtins__ = path, builtins
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            sys.modules["__main__"] = main
            with open(path, "rb") as source:
                exec(compile(source.read(), path, "exec"), main.__dict__)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it (Composer's loggers hook it)
    finally:
        try:  # what the interpreter does at exit: join the threads that are not daemons, then atexit
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def launch(args) -> tuple[list, list[str]]:
    """The ranks, and the files ranks 1.. write their stderr to."""
    port, ranks, errors = free_port(), [], []
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    preload = STACK if args.preload == "stack" else (args.preload or "").split(",")
    # torch.cuda.is_available() (torchao calls it at import) through NVML: it does not initialise CUDA,
    # which a forked child could not use.
    nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for module in filter(None, preload):
            importlib.import_module(module)
    finally:  # the ranks get the environment this launcher was given
        if nvml is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml
    torch = sys.modules.get("torch")
    fork = bool(args.preload) and not (torch is not None and torch.cuda.is_initialized())
    logs = None  # a folder for the output that --stdout/--stderr do not place, made if needed
    for rank in range(args.nproc):
        streams = {}
        if rank > 0:  # rank 0 writes to this process's streams and the others to files, as under Composer
            fields = {"rank": rank, "local_rank": rank, "world_size": args.nproc, "node_rank": 0}
            if not (args.stdout and args.stderr) and logs is None:
                logs = tempfile.mkdtemp(prefix="tests-launch-")
            out = (args.stdout or os.path.join(logs, "rank{rank}.stdout.txt")).format(**fields)
            err = (args.stderr or os.path.join(logs, "rank{rank}.stderr.txt")).format(**fields)
            streams = {"stdout": open(out, "a"), "stderr": open(err, "a")}  # noqa: SIM115 (the rank's)
            errors.append(err)
        env = rank_env(rank, args.nproc, port)
        if fork:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_rank(args, env, streams)
            ranks.append(ForkedRank(pid))
        else:
            ranks.append(subprocess.Popen(command, env=env, **streams))
        for stream in streams.values():
            stream.close()  # the rank holds its own
    return ranks, errors


def wait(ranks: list) -> int:
    """0 once every rank has ended with 0; else the first failure's code, the others stopped."""
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        time.sleep(0.1)
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    deadline = time.monotonic() + 30
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
    return abs(failed[0]) if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--nproc", type=int, required=True)
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("--stdout", help="ranks 1.. write their stdout here, a format with {rank}")
    parser.add_argument("--stderr", help="ranks 1.. write their stderr here, a format with {rank}")
    parser.add_argument("--preload", help="modules to import once and fork the ranks after (see above)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    ranks, errors = launch(args)
    # SIGTERM to the launcher (a timeout, a scheduler) ends the ranks too, as Composer's does.
    signal.signal(signal.SIGTERM, lambda signum, frame: [rank.terminate() for rank in ranks])
    code = wait(ranks)
    if code:  # the other ranks' errors, which would otherwise stay in their files
        for path in errors:
            with open(path) as err:
                sys.stderr.write(f"--- {path} (end)\n{err.read()[-3000:]}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
