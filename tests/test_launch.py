"""tests/launch.py, the tests' stand-in for `composer -n N`: each rank gets Composer's environment, and
one failing rank ends the launch with its code, the others stopped and its error shown; the same with
ranks started as new interpreters and forked after --preload."""

import json
import subprocess
import time

import pytest

from tests.resume_check import COMPOSER, LAUNCH_EXEC

pytestmark = pytest.mark.subprocess

PLAIN = LAUNCH_EXEC  # each rank a new interpreter
FORKED = [*PLAIN, "--preload", "json"]  # each rank forked from the launcher (LAUNCH's "stack": ~5 s)

RANK = """
import atexit, json, os, sys, threading, time
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(sys.argv[1], f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ[k] for k in keys}, f)
# At exit, after a thread that is not a daemon has ended: as a new interpreter ends
late = threading.Thread(target=time.sleep, args=(0.5,))
late.start()
mark = os.path.join(sys.argv[1], f"exit{os.environ['RANK']}")
atexit.register(lambda: late.is_alive() or open(mark, "w").close())
if sys.argv[2] == os.environ["RANK"]:
    sys.exit("rank " + os.environ["RANK"] + " failed")
if sys.argv[2] == "raise" + os.environ["RANK"]:
    raise RuntimeError("rank " + os.environ["RANK"] + " raised")
if sys.argv[2] != "none":
    time.sleep(120)  # stopped by the launcher
"""


def _launch(tmp_path, fail: str, launcher) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    start = time.monotonic()
    command = [*launcher, "-n", "2", str(script), str(tmp_path), fail]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - start


def _envs(folder) -> list[dict]:
    return [json.loads((folder / f"env{rank}.json").read_text()) for rank in (0, 1)]


def test_each_rank_gets_composers_environment(tmp_path):
    """The same as under Composer's own launcher (run here too, so that an upgrade that changes it
    shows), but for the port, a free one each time."""
    (ours := tmp_path / "ours").mkdir()
    (forked := tmp_path / "forked").mkdir()
    (composers := tmp_path / "composer").mkdir()
    for folder, launcher in ((ours, PLAIN), (forked, FORKED), (composers, [COMPOSER])):
        result, _ = _launch(folder, "none", launcher)
        assert result.returncode == 0, result.stderr
    envs = _envs(ours)
    assert all((folder / f"exit{rank}").is_file() for folder in (ours, forked) for rank in (0, 1))
    port = envs[0]["MASTER_PORT"]
    assert [{**env, "MASTER_PORT": port} for env in _envs(composers)] == envs
    assert [{**env, "MASTER_PORT": port} for env in _envs(forked)] == envs
    for rank, env in enumerate(envs):
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }


@pytest.mark.parametrize("launcher", [PLAIN, FORKED], ids=["plain", "forked"])
@pytest.mark.parametrize("fail", ["1", "raise1"])
def test_a_failing_rank_ends_the_launch_and_shows_its_error(tmp_path, launcher, fail):
    """sys.exit(message) or an uncaught exception in rank 1: exit status 1, its message or traceback."""
    result, seconds = _launch(tmp_path, fail, launcher)
    assert result.returncode == 1 and seconds < 30, (result.returncode, seconds)  # rank 0 slept 120 s
    said = "rank 1 failed" if fail == "1" else "Traceback (most recent call last):"
    assert said in result.stderr and ("RuntimeError: rank 1 raised" in result.stderr) == (fail != "1")


def test_a_config_error_under_composer_is_said_once_and_last_of_ours(tmp_path):
    """`composer -n 2 train.py` with a mistake (issue 47): one `config error:` line, from rank 0, and
    the launch's exit status 1; no rank's banner around a second copy of it."""
    from tests.conftest import REPO

    command = [
        COMPOSER,
        "-n",
        "2",
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-cpu.yaml"),
        "optimizer.lr=oops",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert output.count("config error: 'optimizer.lr' must be a number, got 'oops'") == 1, output[-3000:]
    assert "Begin global rank 1" not in output and "Rank 1 crashed" not in output, output[-3000:]
