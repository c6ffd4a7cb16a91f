"""DreamBooth (recipes/dreambooth.py, recipes/class_images.py, models/engine/prior_loss.py): the loss is
diffusers' `instance + w * prior`, class images are drawn once and reused, a partial set continues, a
folder made for another prompt or base refuses, each mistake is one line, and the tiny recipe trains."""

import json
import random
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from PIL import Image

import recipes.class_images as class_images
from data.synthetic import draw_shape
from models.engine.latent_diffusion import LatentDiffusion
from models.engine.objectives import DDPM
from models.engine.prior_loss import PRIOR, prior_preservation_loss
from recipes import build_trainer, load_config
from recipes.class_images import MANIFEST, make_class_images
from recipes.config import ConfigError, parse_config
from recipes.dreambooth import DreamBoothConfig, prepare_dreambooth

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "yamls/tiny-dreambooth-cpu.yaml"


def diffusers_loss(pred, target, weight):
    """examples/dreambooth/train_dreambooth.py, with_prior_preservation, no snr_gamma."""
    model_pred, model_pred_prior = torch.chunk(pred, 2, dim=0)
    target, target_prior = torch.chunk(target, 2, dim=0)
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
    return loss + weight * prior_loss


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0, 3.0])
def test_loss_is_diffusers_instance_plus_weighted_prior(weight):
    torch.manual_seed(0)
    pred, target = torch.randn(6, 4, 3, 3), torch.randn(6, 4, 3, 3)
    expected = diffusers_loss(pred, target, weight)
    # Through the model's own loss, any order in the batch: the flag, not the position, decides.
    model = types.SimpleNamespace(objective=DDPM(DDPMScheduler()), prior_loss_weight=weight, prior_share=0.5)
    order = torch.tensor([3, 0, 4, 1, 5, 2])
    flags = torch.tensor([0, 0, 0, 1, 1, 1])[order]
    outputs = (pred[order], target[order], torch.zeros(6, dtype=torch.long))
    got = LatentDiffusion.loss(model, outputs, {PRIOR: flags})
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert got.item() != pytest.approx(F.mse_loss(pred, target).item()) or weight == 1.0
    # No flag column: the objective's plain mean, as before.
    plain = LatentDiffusion.loss(model, outputs, {})
    torch.testing.assert_close(plain, F.mse_loss(pred, target))


def test_loss_is_the_same_however_the_batch_is_split_over_devices_and_microbatches():
    """Stratified batching puts a global batch's instance images first and its class images after;
    split over 2 devices (or into 2 microbatches) each part holds one kind. The mean of the parts'
    losses (what DDP and Composer's microbatching average) is still diffusers' loss."""
    torch.manual_seed(1)
    per_sample = torch.rand(8)
    flags = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected = per_sample[:4].mean() + 0.7 * per_sample[4:].mean()
    whole = prior_preservation_loss(per_sample, flags, 0.7)
    for parts in (2, 4, 8):
        split = [
            prior_preservation_loss(p, f, 0.7) for p, f in zip(per_sample.chunk(parts), flags.chunk(parts))
        ]
        torch.testing.assert_close(torch.stack(split).mean(), expected)
    torch.testing.assert_close(whole, expected)
    # Without prior preservation (no class images, share 0): the plain mean.
    torch.testing.assert_close(
        prior_preservation_loss(per_sample, torch.zeros(8), 0.7, 0.0), per_sample.mean()
    )


def test_loss_keeps_the_objectives_weight():
    objective = DDPM(DDPMScheduler(), min_snr_gamma=5.0)
    timesteps = torch.tensor([10, 500, 900, 999])
    pred, target = torch.randn(4, 4, 2, 2), torch.randn(4, 4, 2, 2)
    model = types.SimpleNamespace(objective=objective, prior_loss_weight=0.5, prior_share=0.5)
    got = LatentDiffusion.loss(model, (pred, target, timesteps), {PRIOR: torch.tensor([0, 1, 0, 1])})
    weighted = ((pred - target) ** 2).mean(dim=(1, 2, 3)) * objective.weight(timesteps)
    torch.testing.assert_close(got, weighted[[0, 2]].mean() + 0.5 * weighted[[1, 3]].mean())


def _db(class_dir, n, prompt="a circle", **options) -> DreamBoothConfig:
    return DreamBoothConfig(
        instance_dir="unused",
        instance_prompt="a sks circle",
        with_prior_preservation=True,
        class_prompt=prompt,
        class_dir=str(class_dir),
        num_class_images=n,
        class_steps=1,
        class_batch_size=2,
        **options,
    )


@pytest.fixture
def drawn(monkeypatch):
    """How many class images each call drew (the real drawing, counted)."""
    counts = []
    real = class_images._generate

    def counting(db, options, class_dir, count, resolution, device):
        counts.append(count)
        return real(db, options, class_dir, count, resolution, device)

    monkeypatch.setattr(class_images, "_generate", counting)
    return counts


def _state(folder: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


@pytest.mark.heavy
def test_class_images_made_once_then_reused_and_a_partial_set_continues(tiny_pipeline, tmp_path, drawn):
    base = {"preset": "tiny", "pretrained": str(tiny_pipeline[0])}
    whole, partial = tmp_path / "whole", tmp_path / "partial"
    made = make_class_images(_db(whole, 4), base, 32, "cpu")
    assert [p.name for p in made] == [f"class-{i:05d}.png" for i in range(4)] and drawn == [4]
    manifest = json.loads((whole / MANIFEST).read_text())
    assert manifest["prompt"] == "a circle" and manifest["count"] == 4 and manifest["seed"] == 0
    assert manifest["base"] == {"preset": "tiny", "pretrained": str(tiny_pipeline[0].resolve())}
    before = _state(whole)
    assert make_class_images(_db(whole, 4), base, 32, "cpu") == made  # the rerun draws none
    assert drawn == [4] and _state(whole) == before

    # A run stopped after 2 images (a hidden temporary left behind): the rerun draws the other 2,
    # the very images the uninterrupted run drew.
    make_class_images(_db(partial, 2), base, 32, "cpu")
    (partial / ".tmp-1-class-00002.png").write_bytes(b"half a png")
    kept = _state(partial)
    make_class_images(_db(partial, 4), base, 32, "cpu")
    assert drawn == [4, 2, 2]
    images = {n: v for n, v in _state(partial).items() if n.endswith(".png") and not n.startswith(".")}
    assert {n: v[1] for n, v in images.items()} == {n: v[1] for n, v in before.items() if n.endswith(".png")}
    assert all(_state(partial)[n] == kept[n] for n in ("class-00000.png", "class-00001.png"))


@pytest.mark.heavy
def test_users_class_images_are_used_as_is_and_another_prompt_or_base_refuses(tiny_pipeline, tmp_path, drawn):
    folder = tmp_path / "classes"
    folder.mkdir()
    rng = random.Random(0)
    for name in ("mine-a.png", "class-00000.png"):  # the user's, one of them named as ours would be
        draw_shape("blue", "circle", 32, rng).save(folder / name)
    mine = _state(folder)
    base = {"preset": "tiny", "pretrained": str(tiny_pipeline[0])}
    assert len(make_class_images(_db(folder, 2), base, 32, "cpu")) == 2
    assert drawn == [] and _state(folder) == mine and not (folder / MANIFEST).exists()
    make_class_images(_db(folder, 3), base, 32, "cpu")  # one more: drawn beside, never over theirs
    assert drawn == [1] and sorted(p.name for p in folder.glob("*.png")) == [
        "class-00000.png",
        "class-00001.png",
        "mine-a.png",
    ]
    assert all(_state(folder)[name] == mine[name] for name in mine)
    with pytest.raises(
        ValueError, match=r"made with prompt='a circle', this run asks for prompt='a dog'"
    ) as err:
        make_class_images(_db(folder, 3, prompt="a dog"), base, 32, "cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="made with base="):
        make_class_images(_db(folder, 3), {**base, "pretrained": str(tmp_path)}, 32, "cpu")


def _instance_dir(root: Path, n: int = 3) -> Path:
    folder = root / "subject"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    for i in range(n):
        draw_shape("red", "circle", 32, rng).save(folder / f"{i}.png")
    return folder


def _overrides(root: Path, pretrained, *more: str) -> list[str]:
    return [
        f"model.pretrained={pretrained}",
        f"dreambooth.instance_dir={root / 'subject'}",
        f"dreambooth.class_dir={root / 'classes'}",
        f"dreambooth.data_dir={root / 'data'}",
        "trainer.save_folder=null",
        "trainer.progress_bar=false",
        *more,
    ]


def _error(root: Path, pretrained, *more: str) -> str:
    with pytest.raises(ConfigError) as err:
        build_trainer(load_config(RECIPE, _overrides(root, pretrained, *more)))
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.heavy  # parses and checks the recipe eight times
def test_each_mistake_is_one_line(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    assert "instance_dir=" in _error(tmp_path, pipe) and "does not exist" in _error(tmp_path, pipe)
    (tmp_path / "subject").mkdir()
    (tmp_path / "subject" / "notes.txt").write_text("no images")
    assert "holds no images" in _error(tmp_path, pipe)
    (tmp_path / "subject" / "bad.png").write_bytes(b"not a png")
    assert "bad.png is not an image" in _error(tmp_path, pipe)
    _instance_dir(tmp_path)
    (tmp_path / "subject" / "bad.png").unlink()
    message = _error(tmp_path, "null")
    assert message.startswith("dreambooth: class images missing: class_dir=") and "holds 0 of" in message
    assert "prior_loss_weight must be 0 or more, got -1.0" in _error(
        tmp_path, pipe, "dreambooth.prior_loss_weight=-1"
    )
    assert "class_dir must be set" in _error(tmp_path, pipe, "dreambooth.class_dir=null")
    assert "data.train.local is set" in _error(tmp_path, pipe, f"data.train.local={tmp_path}")
    assert "global_train_batch_size=3 must be even" in _error(tmp_path, pipe, "global_train_batch_size=3")
    with pytest.raises(ConfigError, match="'dreambooth.num_class_image'; did you mean 'num_class_images'"):
        parse_config(load_config(RECIPE, _overrides(tmp_path, pipe, "dreambooth.num_class_image=3")))


@pytest.mark.heavy
def test_without_prior_preservation_one_set_made_once_and_the_users_folder_only_read(tmp_path):
    from streaming import StreamingDataset

    subject = _instance_dir(tmp_path)
    mine = _state(subject)
    overrides = _overrides(tmp_path, "null", "dreambooth.with_prior_preservation=false")
    run = prepare_dreambooth(parse_config(load_config(RECIPE, overrides)))
    local = Path(run.data.train.local)
    assert run.data.train.streams is None and local.parent == tmp_path / "data"
    assert not (tmp_path / "classes").exists() and _state(subject) == mine
    rows = list(StreamingDataset(local=str(local), batch_size=1, shuffle=False))
    assert [(r["caption"], r["prior"]) for r in rows] == [("a sks circle", 0)] * 3
    assert {r["image"] for r in rows} == {v[1] for v in mine.values()}  # the files as they are
    made = local.stat().st_mtime_ns
    again = prepare_dreambooth(parse_config(load_config(RECIPE, overrides)))
    assert again.data.train.local == str(local) and local.stat().st_mtime_ns == made  # reused
    draw_shape("red", "square", 32, random.Random(3)).save(subject / "3.png")
    changed = prepare_dreambooth(parse_config(load_config(RECIPE, overrides)))
    assert changed.data.train.local != str(local) and local.is_dir()  # a new set; the old one kept


@pytest.mark.fit
def test_tiny_recipe_trains_with_prior_preservation_and_reuses_its_class_images(
    tiny_pipeline, tmp_path, drawn
):
    _instance_dir(tmp_path)
    overrides = _overrides(
        tmp_path, tiny_pipeline[0], "trainer.max_duration=2ba", "dreambooth.num_class_images=4"
    )
    trainer = build_trainer(load_config(RECIPE, overrides))
    batches = [b for _, b in zip(range(3), trainer.state.train_dataloader)]
    assert all(b[PRIOR].tolist().count(1) == 2 and len(b[PRIOR]) == 4 for b in batches)  # half each
    assert trainer.state.model.prior_share == 0.5 and trainer.state.model.prior_loss_weight == 1.0
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 2 and torch.isfinite(trainer.state.loss).all()
    trainer.close()
    assert drawn == [4]
    classes = _state(tmp_path / "classes")
    build_trainer(load_config(RECIPE, overrides)).close()  # a rerun: the same images, none drawn
    assert drawn == [4] and _state(tmp_path / "classes") == classes
    Image.open(tmp_path / "classes" / "class-00003.png").verify()
