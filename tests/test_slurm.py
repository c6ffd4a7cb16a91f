"""launch/slurm.sbatch, run for real: a one-node Slurm cluster on 127.0.0.1 (Debian's slurm-wlm and
munge, started by the test with its own config, CPU only) runs the tiny recipe on 2 processes.

Needs root and `apt-get install slurm-wlm munge` (`.ci/run` installs them); skipped otherwise.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_TEST
from tests.resume_check import train_env

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(d) for d in DAEMONS),
    reason="needs root and Slurm: `apt-get install slurm-wlm munge` (as .ci/run does) to run it",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, munge_socket: Path) -> str:
    return f"""\
ClusterName=test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
PlugStackConfig=/dev/null
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):  # up to 5 s for a clean exit
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.fixture
def slurm(tmp_path):
    """A running one-node cluster: yields the environment that points Slurm's commands at it."""
    root = tmp_path / "slurm"
    for folder in ("state", "spool", "munge"):
        (root / folder).mkdir(parents=True)
    (root / "munge").chmod(0o700)
    key = root / "munge/munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = root / "munge/munge.sock"
    (root / "slurm.conf").write_text(_slurm_conf(root, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    pid_files = [root / "munge/munged.pid", root / "slurmctld.pid", root / "slurmd.pid"]
    try:
        munge = [f"--key-file={key}", f"--socket={munge_socket}", f"--pid-file={pid_files[0]}"]
        munge += [f"--log-file={root}/munge/munged.log", f"--seed-file={root}/munge/seed"]
        subprocess.run(["munged", "--force", *munge], check=True, env=env, timeout=30)
        subprocess.run(["slurmctld", "-c"], check=True, env=env, timeout=30)
        subprocess.run(["slurmd", "-N", "localhost"], check=True, env=env, timeout=30)
        for _ in range(100):  # up to 10 s for the node to register
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the node did not come up: {state.stdout} {state.stderr}")
        yield env
    finally:
        for pid_file in reversed(pid_files):
            _stop(pid_file)


def _job_state(job: str, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def test_slurm_sbatch_trains_on_two_processes_and_checkpoints(slurm, shapes_mds, tmp_path):
    log, save = tmp_path / "job.out", tmp_path / "ckpt"
    submit = [
        "sbatch",
        "--parsable",
        # The script asks for 2 nodes of 8 GPUs and 64 CPUs each; this node has 2 CPUs, no GPUs.
        "--nodes=1",
        "--gpus-per-node=0",
        f"--cpus-per-task={os.cpu_count()}",
        f"--output={log}",
        "launch/slurm.sbatch",
        "yamls/tiny-cpu.yaml",
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        *TINY_TEST,
        "trainer.max_duration=2ba",
        f"trainer.save_folder={save}",
        "trainer.progress_bar=false",
    ]
    env = train_env(**slurm, GPUS_PER_NODE="2")  # launch/multinode.sh starts this many processes
    job = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 300
    while (state := _job_state(job, env)).get("JobState") in (
        "PENDING",
        "RUNNING",
        "CONFIGURING",
        "COMPLETING",
    ):
        assert time.monotonic() < deadline, f"job {job} still {state.get('JobState')}"
        time.sleep(0.5)
    output = log.read_text() if log.exists() else "(no job log)"
    assert (state.get("JobState"), state.get("ExitCode")) == ("COMPLETED", "0:0"), output[-3000:]
    assert f"job {job}: 1 nodes x 2 GPUs" in output and "world size 2" in output, output[-3000:]
    assert (save / "ep0-ba2-rank0.pt").is_file(), sorted(p.name for p in save.iterdir())
