"""Batch arithmetic across world sizes, and the multi-node launch scripts that set the world size."""

import os
import subprocess

import pytest

from recipes.config import ConfigError
from recipes.scaling import BatchPlan, per_device_batch_size, plan_batches
from tests.conftest import REPO


def test_global_batch_splits_over_8_to_256_devices():
    # The published SD2 base global batch, 2048, with microbatches of 16.
    assert plan_batches(2048, 8, 16) == BatchPlan(per_device_batch=256, microbatch=16, grad_accum=16)
    assert plan_batches(2048, 128, 16) == BatchPlan(16, 16, 1)
    assert plan_batches(2048, 256, 8) == BatchPlan(8, 8, 1)
    assert per_device_batch_size(2048, 256) == 8


def test_auto_and_unset_microbatch():
    assert plan_batches(2048, 8, "auto") == BatchPlan(256, "auto", None)
    # Unset: Composer runs the whole per-device batch as one microbatch.
    assert plan_batches(2048, 8, None) == BatchPlan(256, 256, 1)


def test_world_size_that_does_not_divide_the_global_batch_names_the_numbers():
    # 3 nodes x 8 GPUs: 2048 // 24 would silently train 2040 images a step.
    message = "global_train_batch_size=2048 is not divisible by the world size 24"
    with pytest.raises(ConfigError, match=message):
        per_device_batch_size(2048, 24)
    with pytest.raises(ConfigError, match=message):
        plan_batches(2048, 24, 16)


def test_microbatch_is_a_cap_the_largest_divisor_not_above_it_is_used():
    # sd2-base's 32 on 8..256 GPUs: per-device 256..8; from 128 GPUs on the per-device batch is smaller.
    plans = [plan_batches(2048, n, 32) for n in (8, 16, 32, 64, 128, 256)]
    assert [(p.per_device_batch, p.microbatch, p.grad_accum) for p in plans] == [
        (256, 32, 8),
        (128, 32, 4),
        (64, 32, 2),
        (32, 32, 1),
        (16, 16, 1),
        (8, 8, 1),
    ]
    assert plan_batches(2048, 8, 48) == BatchPlan(256, 32, 8)  # not a divisor: the next one below
    assert plan_batches(96, 1, 64) == BatchPlan(96, 48, 2)
    assert plan_batches(14, 2, 4) == BatchPlan(7, 1, 7)  # a prime per-device batch: microbatches of 1


@pytest.mark.heavy
def test_the_trainer_gets_the_microbatch_used_and_the_log_says_so(shapes_mds, monkeypatch, caplog):
    """composer.Trainer receives the effective microbatch, not the YAML's cap (which Composer would
    run as given: one microbatch larger than the batch, or a smaller last one)."""
    import recipes.trainer
    from recipes import build_trainer, load_config

    given = {}

    class Stop(Exception):
        pass

    def fake_trainer(**kwargs):
        given.update(kwargs)
        raise Stop

    monkeypatch.setattr(recipes.trainer, "Trainer", fake_trainer)
    base = [f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", "model.pretrained=null"]
    base += ["global_train_batch_size=16", "callbacks.samples=null", "algorithms.ema=null"]
    for cap, used, accum in [(32, 16, 1), (6, 4, 4), (8, 8, 2)]:
        caplog.clear()
        overrides = [*base, f"trainer.device_train_microbatch_size={cap}"]
        with caplog.at_level("INFO", logger="recipes.trainer"), pytest.raises(Stop):
            build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
        assert given["device_train_microbatch_size"] == used
        capped = f", capped by trainer.device_train_microbatch_size={cap}" if cap != used else ""
        assert f"16 per device (microbatch {used}{capped}, gradient accumulation {accum})" in caplog.text


def test_a_global_batch_the_world_size_does_not_divide_stays_an_error():
    with pytest.raises(
        ConfigError, match="global_train_batch_size=2048 is not divisible by the world size 24"
    ):
        plan_batches(2048, 24, 32)


@pytest.mark.parametrize("microbatch", [0, -4, 1.5, True, "big"])
def test_microbatch_must_be_a_positive_int_or_auto(microbatch):
    with pytest.raises(ConfigError, match="must be a positive integer or 'auto'"):
        plan_batches(2048, 8, microbatch)


@pytest.mark.parametrize("global_batch, world", [(0, 8), (2048, 0), (2048, -8)])
def test_batch_and_world_size_must_be_positive(global_batch, world):
    with pytest.raises(ConfigError, match="must be a positive integer"):
        per_device_batch_size(global_batch, world)


# --- launch/: the scripts that turn nodes x GPUs into the composer launcher's world size ---


@pytest.mark.subprocess  # bash, with stand-ins for composer and Slurm
def test_multinode_script_starts_composer_with_the_world_it_computes(tmp_path):
    """launch/multinode.sh on node 2 of 4: one composer launcher for this node's 8 GPUs in a world
    of 32, started from the repo root, the recipe's arguments passed through word for word."""
    _stub(tmp_path, "composer", 'echo "cwd $PWD"; for arg in "$@"; do echo "arg $arg"; done\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "GPUS_"))}
    env |= {"COMPOSER": str(tmp_path / "composer"), "NNODES": "4", "NODE_RANK": "2", "MASTER_ADDR": "node0"}
    result = subprocess.run(
        ["bash", str(REPO / "launch/multinode.sh"), "yamls/tiny-cpu.yaml", "run_name=two words"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"cwd {REPO}"  # train.py and the yamls' relative paths resolve from there
    assert [line.removeprefix("arg ") for line in lines[1:]] == [
        *("--nproc", "8", "--world_size", "32", "--node_rank", "2"),
        *("--master_addr", "node0", "--master_port", "29500"),
        *("train.py", "yamls/tiny-cpu.yaml", "run_name=two words"),
    ]
    # Under Slurm (no NNODES / NODE_RANK / GPUS_PER_NODE) the same numbers come from SLURM_*.
    slurm = {k: v for k, v in env.items() if k not in ("NNODES", "NODE_RANK")}
    slurm |= {"SLURM_NNODES": "3", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "MASTER_PORT": "23456"}
    result = subprocess.run(
        ["bash", str(REPO / "launch/multinode.sh"), "yamls/tiny-cpu.yaml"],
        env=slurm,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    args = [line.removeprefix("arg ") for line in result.stdout.splitlines()[1:]]
    assert args[:10] == [
        *("--nproc", "4", "--world_size", "12", "--node_rank", "1"),
        *("--master_addr", "node0", "--master_port", "23456"),
    ]


def _stub(folder, name, body):
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.mark.subprocess  # bash, with stand-ins for composer and Slurm
def test_slurm_job_starts_one_composer_launcher_per_node_with_its_rank(tmp_path):
    # Stand-ins for Slurm and composer: srun runs its command once per node with SLURM_NODEID set,
    # as it does with --ntasks-per-node=1; composer prints the arguments it was given.
    _stub(
        tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "gpu-a17\\ngpu-a18\\ngpu-b01\\n"\n'
    )
    _stub(
        tmp_path,
        "srun",
        'while [[ $1 == -* ]]; do echo "srun $1"; shift; done\n'
        'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@"; done\n',
    )
    _stub(tmp_path, "composer", 'echo "composer $*"\n')
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "COMPOSER": "composer",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_NODELIST": "gpu-a[17-18],gpu-b01",
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "3",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_PER_TASK": "64",
    }
    result = subprocess.run(
        ["bash", str(REPO / "launch/slurm.sbatch"), "yamls/tiny-cpu.yaml", "trainer.max_duration=4ba"],
        cwd=tmp_path,  # the job must cd to SLURM_SUBMIT_DIR itself
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    launches = [line for line in result.stdout.splitlines() if line.startswith("composer")]
    port = 20000 + 123456 % 20000
    assert launches == [
        f"composer --nproc 8 --world_size 24 --node_rank {rank} --master_addr gpu-a17 --master_port {port} "
        "train.py yamls/tiny-cpu.yaml trainer.max_duration=4ba"
        for rank in range(3)
    ]
    assert "srun --cpus-per-task=64" in result.stdout


@pytest.mark.subprocess  # bash, with stand-ins for composer and Slurm
def test_multinode_script_needs_a_master_address(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    result = subprocess.run(
        ["bash", str(REPO / "launch/multinode.sh"), "yamls/tiny-cpu.yaml"],
        env={**env, "COMPOSER": "true"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "MASTER_ADDR" in result.stderr
