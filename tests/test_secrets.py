"""Credentials never reach logs, what wandb stores for a run, or checkpoints.

The end-to-end test trains with fake tokens in the environment and real S3 credentials (for the
SeaweedFS test server) given as a command-line override to a logger that uploads the checkpoints,
with console logging of the config on and wandb offline; then it scans everything the run wrote.
"""

import logging
import os
import sys

import pytest
import torch

from common import secrets
from common.secrets import MASK, RedactingFilter, protect_config_secrets, redact
from tests.conftest import REPO, TINY_TEST
from tests.resume_check import run
from tests.s3_server import ACCESS_KEY, BUCKET, SECRET_KEY, s3_server  # noqa: F401  (fixture)

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEENVKEY0000001",
    "AWS_SECRET_ACCESS_KEY": "fakeEnvSecret/abcdefghijklmnopqrstuvwxyz0123",
    "WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789abcd",
    "HF_TOKEN": "hf_fakeHubToken0123456789abcdefghij",
    "DATABRICKS_TOKEN": "dapifakeDatabricksToken0123456789",
}


@pytest.fixture
def no_config_secrets(monkeypatch):
    monkeypatch.setattr(secrets, "_config_secrets", [])
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_redact_masks_secret_keys_env_values_and_url_passwords(monkeypatch, no_config_secrets):
    monkeypatch.setenv("HF_TOKEN", FAKE_ENV["HF_TOKEN"])
    config = {
        "loggers": {"remote": {"backend_kwargs": {"aws_secret_access_key": "s3cr3t-value", "region": "x"}}},
        "model": {"pretrained": f"https://user:pw123456@host/{FAKE_ENV['HF_TOKEN']}/sd2"},
        "api_key": None,  # nothing to hide
        "tokens": ["a", "b"],  # a secret-named key masks its whole value
    }
    out = redact(config)
    assert out["loggers"]["remote"]["backend_kwargs"] == {"aws_secret_access_key": MASK, "region": "x"}
    assert out["model"]["pretrained"] == f"https://{MASK}@host/{MASK}/sd2"
    assert (out["api_key"], out["tokens"]) == (None, MASK)
    assert config["loggers"]["remote"]["backend_kwargs"]["aws_secret_access_key"] == "s3cr3t-value"  # a copy


def test_log_records_and_command_line_lose_env_and_config_secrets(monkeypatch, no_config_secrets):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_ENV["WANDB_API_KEY"])
    config_secret = "configOnlySecret123"
    sys.argv[:] = [
        "train.py",
        "x.yaml",
        f"+loggers.r={{backend_kwargs: {{aws_secret_access_key: {config_secret}}}}}",
    ]
    protect_config_secrets({"loggers": {"r": {"backend_kwargs": {"aws_secret_access_key": config_secret}}}})
    assert config_secret not in " ".join(sys.argv) and MASK in sys.argv[2]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test_secrets")
    logger.addHandler(handler)
    try:
        logger.error("upload failed: key %s, token %s", config_secret, FAKE_ENV["WANDB_API_KEY"])
    finally:
        logger.removeHandler(handler)
    assert records[0].getMessage() == f"upload failed: key {MASK}, token {MASK}"


def _strings(obj, seen=None):
    """Every string in a loaded checkpoint (dict keys and values, sequences, objects' attributes)."""
    seen = set() if seen is None else seen
    if isinstance(obj, str):
        yield obj
        return
    if id(obj) in seen or isinstance(obj, torch.Tensor):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k, seen)
            yield from _strings(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _strings(v, seen)
    elif hasattr(obj, "__dict__"):
        yield from _strings(vars(obj), seen)


@pytest.mark.slow
def test_training_run_writes_no_secret_anywhere(s3_server, shapes_mds, tmp_path):  # noqa: F811
    wandb_dir, save = tmp_path / "wandb", tmp_path / "ckpt"
    wandb_dir.mkdir()
    env = {
        **os.environ,
        **FAKE_ENV,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wandb_dir),
    }
    env.pop("S3_ENDPOINT_URL", None)
    remote = (
        f"+loggers.remote={{_target_: composer.loggers.RemoteUploaderDownloader, bucket_uri: s3://{BUCKET}, "
        f"backend_kwargs: {{endpoint_url: '{s3_server.endpoint}', aws_access_key_id: {ACCESS_KEY}, "
        f"aws_secret_access_key: {SECRET_KEY}}}}}"
    )
    command = [
        sys.executable,
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-cpu.yaml"),
        *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "run_name=secrets-test",
        "trainer.max_duration=2ba",
        "trainer.save_interval=1ba",
        f"trainer.save_folder={save}",
        "trainer.progress_bar=false",
        "trainer.log_to_console=true",  # prints the logged config too
        "+loggers.wandb={_target_: composer.loggers.WandBLogger, project: secrets-test}",
        remote,
    ]
    done = run(command, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    uploaded = s3_server.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert any(obj["Key"].endswith("-rank0.pt") for obj in uploaded), (
        "no checkpoint uploaded with the config's keys"
    )
    assert list(wandb_dir.rglob("*.wandb")), "wandb wrote no offline run"
    assert MASK in done.stdout + done.stderr  # the console shows the config, masked

    wanted = [*FAKE_ENV.values(), SECRET_KEY]
    places = {"stdout": done.stdout.encode(), "stderr": done.stderr.encode()}
    for path in [*wandb_dir.rglob("*"), *save.rglob("*")]:
        if path.is_file():
            places[str(path)] = path.read_bytes()
    for obj in uploaded:
        places[f"s3://{BUCKET}/{obj['Key']}"] = (
            s3_server.client().get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
        )
    for checkpoint in save.glob("ep*.pt"):
        places[f"{checkpoint} (loaded)"] = "\n".join(
            _strings(torch.load(checkpoint, weights_only=False))
        ).encode()
    leaks = [
        (secret, where) for secret in wanted for where, data in places.items() if secret.encode() in data
    ]
    assert not leaks
