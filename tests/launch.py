"""`python tests/launch.py -n N [-m] [--stdout FMT] [--stderr FMT] SCRIPT [ARGS...]`: one node's
`composer -n N`, for the tests whose subject is what the ranks do, not the launcher.

It starts each rank with the environment Composer 0.32.1's launcher gives it (composer/cli/launcher.py,
`_launch_processes`) and, like it, stops the others when one fails. It imports nothing but the
standard library: `composer` itself imports all of Composer first, 4.5 s of CPU per launch and about
50 s of a `make test` run, where the CPU is the limit. Composer's own launcher stays under test where a
user's command goes through it: the Slurm job (launch/) and the NaN guard's two ranks.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


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


def launch(args) -> tuple[list[subprocess.Popen], list[str]]:
    """The ranks, and the files ranks 1.. write their stderr to."""
    port, ranks, errors = free_port(), [], []
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
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
        ranks.append(subprocess.Popen(command, env=rank_env(rank, args.nproc, port), **streams))
    return ranks, errors


def wait(ranks: list[subprocess.Popen]) -> int:
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
