"""The MLflow switch: a run YAML that lists `_loggers: mlflow` in its defaults trains the tiny recipe
into a real local MLflow store (file://, started by the test), read back with MLflow's own client as
soon as `recipes.train()` returns: params (masked), metrics, MFU and an image."""

import io
import re
import sys

import numpy as np
import pytest
from composer.core import Callback
from PIL import Image

from common import secrets as secrets_module
from common.secrets import MASK
from extensions.callbacks import read_loss_log
from recipes import load_config, train
from tests.conftest import REPO, tiny_run

BATCHES = 4
ENV_SECRET = "hf_fakeHubToken0123456789abcdefghij"
CONFIG_SECRET = "fakeProbeApiKey0123456789"
URL_PASSWORD = "urlPassword12345"


class ImageProbe(Callback):
    """Holds credentials in its config (like an alerting webhook would) and logs an image at the end,
    as a sample-grid callback does."""

    image = np.linspace(0.0, 1.0, 3 * 6 * 8).reshape(3, 6, 8)  # channels first, values in [0, 1]

    def __init__(self, api_key: str, webhook: str):
        self.api_key, self.webhook = api_key, webhook

    def fit_end(self, state, logger):
        logger.log_images(self.image, name="probe", step=int(state.timestamp.batch))


@pytest.fixture
def no_config_secrets(monkeypatch):
    monkeypatch.setattr(secrets_module, "_config_secrets", [])
    monkeypatch.setattr(sys, "argv", list(sys.argv))


@pytest.mark.fit
def test_mlflow_store_holds_masked_params_metrics_mfu_and_an_image(
    shapes_mds, tmp_path, monkeypatch, no_config_secrets
):
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # the recipe must allow the file store itself
    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    yamls = tmp_path / "yamls"  # a derived recipe next to the shipped ones, as a user would write it
    yamls.mkdir()
    for name in ("_base.yaml", "tiny-cpu.yaml", "_loggers"):
        (yamls / name).symlink_to(REPO / "yamls" / name)
    (yamls / "mine.yaml").write_text(
        "defaults:\n  - tiny-cpu\n  - _loggers: mlflow\n  - _self_\nrun_name: mine\n"
    )
    webhook = f"https://bot:{URL_PASSWORD}@hooks.example/notify?token={ENV_SECRET}"
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "callbacks.speed_monitor.window_size=1",
        "callbacks.speed_monitor.gpu_flops_available=1.0e12",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {tmp_path / 'loss.jsonl'}}}",
        "+callbacks.probe._target_=tests.test_mlflow.ImageProbe",
        f"+callbacks.probe.api_key={CONFIG_SECRET}",
        f"+callbacks.probe.webhook='{webhook}'",
    ]
    train(load_config(yamls / "mine.yaml", overrides))
    # Read right after train() returns: everything must already be there.
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("sd-recipes")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "mine"

    params = run.data.params
    assert params["optimizer.lr"] == "0.003" and params["run_name"] == "mine"
    assert params["loggers.mlflow._target_"] == "composer.loggers.MLFlowLogger"
    assert params["callbacks.probe.api_key"] == MASK
    assert params["callbacks.probe.webhook"] == f"https://{MASK}@hooks.example/notify?token={MASK}"

    losses = read_loss_log(tmp_path / "loss.jsonl")
    history = client.get_metric_history(run.info.run_id, "loss/train/total")
    assert [m.step for m in history] == list(range(BATCHES))  # Composer steps from 0
    assert [m.value for m in history] == pytest.approx(list(losses.values()), rel=1e-7)
    mfu = client.get_metric_history(run.info.run_id, "throughput/device/mfu")
    assert len(mfu) == BATCHES - 1 and all(0 < m.value < 1 for m in mfu)

    images = [
        f.path
        for f in client.list_artifacts(run.info.run_id, "images")
        # images/probe_0+step+4+timestamp+...+uuid.png (and a "compressed" thumbnail)
        if re.match(r"images/probe_0\Wstep\W4\W.*\.png$", f.path) and "compressed" not in f.path
    ]
    assert images, client.list_artifacts(run.info.run_id, "images")
    png = tmp_path / "mlruns" / experiment.experiment_id / run.info.run_id / "artifacts" / images[0]
    logged = np.asarray(Image.open(io.BytesIO(png.read_bytes())).convert("RGB")).astype(int)
    assert np.abs(logged - ImageProbe.image.transpose(1, 2, 0) * 255).max() <= 1

    leaks = [
        (secret, path)
        for path in (tmp_path / "mlruns").rglob("*")
        if path.is_file()
        for secret in (ENV_SECRET, CONFIG_SECRET, URL_PASSWORD)
        if secret.encode() in path.read_bytes()
    ]
    assert not leaks


@pytest.mark.fit
def test_a_run_that_fails_is_flushed_and_marked_failed(shapes_mds, tmp_path, monkeypatch, no_config_secrets):
    from mlflow.tracking import MlflowClient

    from extensions.callbacks import NonFiniteLossError

    store = f"file://{tmp_path / 'mlruns'}"
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "+_loggers=mlflow",  # the command-line form of the switch
        f"loggers.mlflow.tracking_uri={store}",
        "+callbacks.poison={_target_: tests.probes.PoisonBatch, batch: 3}",
    ]
    with pytest.raises(NonFiniteLossError, match="batch 3"):
        train(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("sd-recipes").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss/train/total")] == [0, 1]
