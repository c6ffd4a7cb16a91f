"""Sample grids while training (extensions/sample_grids.py): at the right batches, from the EMA weights,
with a JSON that says what they show, logged to every logger, and without changing training."""

import json

import pytest
import torch
from composer.core import Callback
from composer.loggers import LoggerDestination
from PIL import Image

from extensions.callbacks import read_loss_log
from extensions.ema import find_ema
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

BATCHES = 5
PROMPTS = ["a red circle", "a blue square"]


class ImageSink(LoggerDestination):
    def __init__(self):
        self.images = []

    def log_images(self, images, name="Images", channels_last=False, step=None, *args, **kwargs):
        self.images.append((name, step, tuple(images.shape)))


class WeightsAtSampling(Callback):
    """The UNet weights the grid at batch `batch` was drawn with (read inside the model's generate)."""

    def __init__(self, batch):
        self.batch, self.seen = batch, None

    def fit_start(self, state, logger):
        model, generate = state.model, state.model.generate

        def spy(*args, **kwargs):
            if self.seen is None and int(state.timestamp.batch) == self.batch:
                self.seen = {k: v.clone() for k, v in model.unet.state_dict().items()}
            return generate(*args, **kwargs)

        model.generate = spy


def _train(shapes_mds, out, samples: bool, *extra):
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "algorithms.ema.half_life=2ba",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {out / 'loss.jsonl'}}}",
        *extra,
    ]
    if samples:  # tiny_run switches them off; put them back, small
        overrides += [
            "+callbacks.samples={_target_: extensions.sample_grids.SampleGrids}",
            f"+callbacks.samples.prompts=[{','.join(PROMPTS)}]",
            "+callbacks.samples.interval=2ba",
            "+callbacks.samples.per_prompt=3",
            "+callbacks.samples.guidance=[1.0,4.0]",
            "+callbacks.samples.steps=4",
            f"+callbacks.samples.folder={out / 'samples'}",
        ]
    return build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))


@pytest.mark.fit
def test_grids_at_the_interval_and_the_end_without_changing_training(shapes_mds, tmp_path):
    sink, spy = ImageSink(), WeightsAtSampling(4)  # warmup: batches 1-2 train at lr 0
    with_grids = _train(shapes_mds, tmp_path / "with", True)
    with_grids.logger.destinations = (*with_grids.logger.destinations, sink)
    with_grids.state.callbacks.append(spy)
    ema_at_4 = []
    with_grids.state.callbacks.insert(0, _EmaAt(4, ema_at_4))
    with_grids.fit()
    without = _train(shapes_mds, tmp_path / "without", False)
    without.fit()

    folder = tmp_path / "with/samples"
    assert sorted(p.name for p in folder.iterdir()) == [
        "ba2.json", "ba2.png", "ba4.json", "ba4.png", "ba5.json", "ba5.png",
    ]  # fmt: skip
    record = json.loads((folder / "ba4.json").read_text())
    rows = [{"guidance": g, "prompt": p} for g in (1.0, 4.0) for p in PROMPTS]
    assert record == {
        "batch": 4, "rows": rows, "per_prompt": 3, "seed": 0, "steps": 4, "sampler": "ddim", "resolution": 32,
        "ema": True,
    }  # fmt: skip
    side, pad = 32, 2  # tiny model: 32 px; torchvision's grid pads 2 px
    assert Image.open(folder / "ba4.png").size == (3 * (side + pad) + pad, 4 * (side + pad) + pad)
    # Every logger gets one image set per guidance scale at each of those batches.
    assert sink.images == [
        (f"samples/guidance_{g}", b, (6, 3, side, side)) for b in (2, 4, 5) for g in ("1", "4")
    ]
    # Drawn from the EMA average, which is not the raw weights.
    assert all(torch.equal(spy.seen[k], ema_at_4[0][f"unet.{k}"]) for k in spy.seen)
    assert any(not torch.equal(spy.seen[k], v) for k, v in ema_at_4[1].items())
    # Training is bitwise the same as without the callback: losses, weights and the average.
    assert read_loss_log(tmp_path / "with/loss.jsonl") == read_loss_log(tmp_path / "without/loss.jsonl")
    a, b = with_grids.state.model.unet.state_dict(), without.state.model.unet.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ema_a = find_ema(with_grids.state.algorithms).state_dict()["ema"]
    ema_b = find_ema(without.state.algorithms).state_dict()["ema"]
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)


class _EmaAt(Callback):
    """The EMA average and the raw UNet after batch `batch` (before the grid is drawn)."""

    def __init__(self, batch, out):
        self.batch, self.out = batch, out

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            ema = find_ema(state.algorithms).state_dict()["ema"]
            self.out.append({k: v.clone() for k, v in ema.items()})
            self.out.append({k: v.clone() for k, v in state.model.unet.state_dict().items()})


def test_a_model_that_cannot_generate_is_refused():
    from extensions.sample_grids import SampleGrids

    state = type("State", (), {"model": torch.nn.Linear(1, 1), "callbacks": [], "run_name": "x"})()
    with pytest.raises(TypeError, match="needs a model that generates; Linear does not"):
        SampleGrids(prompts=["x"]).fit_start(state, None)
    with pytest.raises(ValueError, match="at least one prompt"):
        SampleGrids(prompts=[])
