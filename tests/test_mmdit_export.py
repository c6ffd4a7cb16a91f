"""The mmdit family (issue 26) beyond training: the checkpoint's record, export to a diffusers
StableDiffusion3Pipeline folder that samples our generate()'s image, EMA and raw exports,
models.generate and evaluation.evaluate on checkpoints and folders, T5 through all of them, and a
training run's checkpoint.

On mmdit-tiny with random weights (the round trips are what is tested, not what the model learnt),
32 px, 4 sampling steps. The fixture's model has every option away from its default where export could
lose it: a VAE shift, a scheduler shift of 3, non-default rectified-flow options (timestep_shift auto,
so it samples and exports with its native 32 px's shift, sqrt(32^2 / 256^2) = 0.125, not the 3)."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from PIL import Image

from models import RectifiedFlowTransformer, build_model, export, generate
from models.checkpoints.record import describe, read_record, rebuild
from models.engine.tokenizer import tokenize
from models.export import infer_preset, load_model_from_checkpoint, weights_family

PROMPTS = ["a red circle", "a blue square"]
SAMPLING = dict(guidance_scale=4.0, num_inference_steps=4)
NETWORKS = ("transformer", "vae", "text_encoder", "text_encoder_2")
OPTIONS = dict(timestep_mean=0.3, timestep_std=0.8, timestep_shift="auto", loss_weighting="cosmap")


def _checkpoint_of(model, path, ema: dict | None = None):
    """What a Composer checkpoint holds for export: the weights, the ModelRecord callback's record and,
    with `ema`, extensions.ema.EMA's average (tests/test_sdxl_export.py does the same for SDXL)."""
    algorithms = [] if ema is None else [("EMA", {"start_batch": 0, "ema": ema, "smoothing": 0.5})]
    state = {
        "model": model.state_dict(),
        "callbacks": {"ModelRecord": describe(model)},
        "algorithms": algorithms,
    }
    torch.save({"state": state}, path)
    return path


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pipeline(folder, t5: bool = False) -> StableDiffusion3Pipeline:
    # Without T5 diffusers loads an SD3 folder only when told to leave it off.
    no_t5 = {} if t5 else dict(text_encoder_3=None, tokenizer_3=None)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True, **no_t5)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_images(pipe, seed: int, max_sequence_length: int = 8, **kwargs) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)  # generate() draws its noise the same way
    return pipe(
        PROMPTS,
        generator=generator,
        max_sequence_length=max_sequence_length,
        output_type="pt",
        **SAMPLING,
        **kwargs,
    ).images


def _front_matter(folder) -> dict:
    import yaml

    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text[4 : text.index("\n---", 4)])


@pytest.fixture(scope="module")
def mmdit(tmp_path_factory):
    """(model, checkpoint, ema, exported folder): a random mmdit-tiny model with a VAE shift and a
    scheduler shift of 3, its checkpoint with the record and an EMA average of the transformer, and
    that checkpoint exported by the CLI without flags (so from the average)."""
    folder = tmp_path_factory.mktemp("mmdit")
    torch.manual_seed(0)
    model = build_model("mmdit-tiny", **OPTIONS).eval()
    model.latent_shift.fill_(0.0625)
    model.noise_scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        model.noise_scheduler.config, shift=3.0
    )
    generator = torch.Generator().manual_seed(1)
    ema = {
        name: p.detach() + 0.01 * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    checkpoint = _checkpoint_of(model, folder / "ckpt.pt", ema)
    export.main([str(checkpoint), str(folder / "pipeline")])
    return model, checkpoint, ema, folder / "pipeline"


@pytest.mark.heavy
def test_the_record_rebuilds_the_mmdit_model(mmdit):
    model, checkpoint, _, _ = mmdit
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["family"] == "mmdit" and record["version"] == 3 and record["preset"] == "mmdit-tiny"
    assert "unet" not in record and record["transformer"]["joint_attention_dim"] == 128
    assert record["text_encoder"]["projection_dim"] == 32 and record["text_encoder_2"]["hidden_size"] == 32
    assert record["tokenizer"]["pad_token"] == "<|endoftext|>" and record["tokenizer_2"]["pad_token"] == "!"
    assert record["scheduler"]["shift"] == 3.0 and record["prediction_type"] == "flow_prediction"
    assert record["latent_shift"] == 0.0625 and record["latent_scale"] == pytest.approx(0.18215)
    assert record["t5_tokens"] == 8 and record["text_encoder_3"] is None and record["tokenizer_3"] is None
    assert {key: record[key] for key in OPTIONS} == OPTIONS
    json.dumps(record)  # plain values

    loaded = load_model_from_checkpoint(checkpoint, ema=False)
    assert type(loaded) is RectifiedFlowTransformer and loaded.preset == "mmdit-tiny"
    assert _same(loaded.state_dict(), model.state_dict())
    assert {key: getattr(loaded, key) for key in OPTIONS} == OPTIONS and loaded.t5_tokens == 8
    assert loaded.noise_scheduler.config.shift == 3.0 and float(loaded.latent_shift) == 0.0625
    assert type(loaded.text_encoder).__name__ == "CLIPTextModelWithProjection"
    assert loaded.tokenizer.pad_token == "<|endoftext|>" and loaded.tokenizer_2.pad_token == "!"
    assert loaded.text_encoder_3 is None and not any(p.is_meta for p in loaded.parameters())


def test_records_of_other_versions_are_refused(mmdit):
    _, checkpoint, _, _ = mmdit
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    with pytest.raises(ValueError, match="version 2.*this code reads version 3 for family 'mmdit'"):
        rebuild({**record, "version": 2})
    with pytest.raises(ValueError, match="family 'flux'"):
        rebuild({**record, "family": "flux"})


@pytest.mark.heavy
def test_ema_and_raw_weights(mmdit, tmp_path):
    model, checkpoint, ema, folder = mmdit
    raw = model.state_dict()
    averaged = load_model_from_checkpoint(checkpoint)  # the default: the average, as the fixture's export
    assert all(torch.equal(averaged.state_dict()[k], v) for k, v in ema.items())
    assert _same(load_model_from_checkpoint(checkpoint, ema=True).state_dict(), averaged.state_dict())
    export.main([str(checkpoint), str(tmp_path / "raw"), "--raw"])
    for name, expected in (
        ("ema", averaged.transformer.state_dict()),
        ("raw", model.transformer.state_dict()),
    ):
        path = folder if name == "ema" else tmp_path / "raw"
        exported = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", local_files_only=True)
        assert _same(exported.state_dict(), expected), name
    # Only the transformer is averaged: the frozen parts are the checkpoint's in both.
    pipe = _pipeline(tmp_path / "raw")
    for name in ("vae", "text_encoder", "text_encoder_2"):
        state = getattr(pipe, name).state_dict()
        assert all(torch.equal(v, raw[f"{name}.{k}"]) for k, v in state.items()), name


@pytest.mark.heavy
def test_pipeline_samples_like_generate(mmdit, caplog):
    _, checkpoint, _, folder = mmdit
    pipe = _pipeline(folder)
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    assert (
        type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
        and pipe.scheduler.config.shift == 0.125  # auto at the native 32 px, as training there
    )
    assert pipe.vae.config.scaling_factor == pytest.approx(0.18215) and pipe.vae.config.shift_factor == 0.0625
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["_class_name"] == "StableDiffusion3Pipeline"
    assert _front_matter(folder)["max_sequence_length"] == 8
    assert "max_sequence_length=8" in (folder / "README.md").read_text()

    model = load_model_from_checkpoint(checkpoint)
    expected = model.generate(PROMPTS, seed=3, **SAMPLING)
    images = _pipe_images(pipe, seed=3)
    assert images.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)
    # A negative prompt: both encode it with both CLIPs.
    negative = model.generate(PROMPTS, negative_prompt="green", seed=3, **SAMPLING)
    assert not torch.allclose(negative, expected, atol=1e-4)
    torch.testing.assert_close(
        _pipe_images(pipe, seed=3, negative_prompt="green"), negative, atol=1e-6, rtol=0
    )
    # The pipeline's default T5 length (256 zero tokens, not the trained 8) is another image: why the
    # folder's README says the number.
    assert not torch.allclose(_pipe_images(pipe, seed=3, max_sequence_length=256), expected, atol=1e-3)


def _timesteps_seen(model, run) -> list[torch.Tensor]:
    """The `timestep` argument of each of the transformer's calls during `run()`."""
    seen = []
    handle = model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    try:
        run()
    finally:
        handle.remove()
    return seen


# timestep_shift -> its shift at 32 px (mmdit-tiny's native size) and at 16 px, with a scheduler shift of 3.
SHIFTS = {None: (3.0, 3.0), 2.5: (2.5, 2.5), "auto": (0.125, 0.0625)}


@pytest.mark.parametrize("option", list(SHIFTS), ids=str)
@pytest.mark.heavy
def test_training_sampling_and_export_share_the_shift(option, tmp_path):
    """One shift per size for training's timesteps, generate's sampler and the exported scheduler:
    None the scheduler's (3 here), a number itself, auto sqrt(pixels / 256^2) at each size; the record
    keeps the option as given and rebuilds it."""
    from models.engine.objectives import seeded_flow_draws, shift_timesteps

    torch.manual_seed(0)
    model = build_model("mmdit-tiny", timestep_shift=option).eval()
    model.noise_scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        model.noise_scheduler.config, shift=3.0
    )
    for size, expected in zip((32, 16), SHIFTS[option], strict=True):
        assert model.shift_for((size, size)) == pytest.approx(expected)
        # Training at this size: the logit-normal draws shifted by it.
        batch = {
            "image": torch.rand(2, 3, size, size) * 2 - 1,
            "input_ids": tokenize(model.tokenizer, PROMPTS),
            "input_ids_2": tokenize(model.tokenizer_2, PROMPTS),
        }
        with torch.no_grad():
            _, _, t = model._diffuse(batch, seeds=[1, 2])
        normal = seeded_flow_draws([1, 2], (4, size // 4, size // 4), "cpu")["normal"]
        torch.testing.assert_close(t, shift_timesteps(torch.sigmoid(normal), expected))
        # Sampling at this size: the Euler steps of a scheduler with that shift.
        seen = _timesteps_seen(
            model,
            lambda size=size: model.generate(
                PROMPTS[:1], height=size, width=size, guidance_scale=1.0, num_inference_steps=3
            ),
        )
        reference = FlowMatchEulerDiscreteScheduler(shift=expected)
        reference.set_timesteps(3)
        torch.testing.assert_close(torch.stack([step[0] for step in seen]), reference.timesteps)
    # The export: the native size's shift, in the scheduler config and the README.
    export.export_pipeline(model, tmp_path / "out")
    config = json.loads((tmp_path / "out/scheduler/scheduler_config.json").read_text())
    assert config["shift"] == pytest.approx(SHIFTS[option][0])
    readme = (tmp_path / "out/README.md").read_text()
    assert f"The scheduler's shift is {SHIFTS[option][0]:g}:" in readme
    assert ("To sample at another size" in readme) == (option == "auto")
    # The record keeps the option as given (None, a number, "auto"), through JSON, and rebuilds it.
    record = json.loads(json.dumps(describe(model)))
    assert record["timestep_shift"] == option
    assert RectifiedFlowTransformer(**rebuild(record)).timestep_shift == option


@pytest.mark.heavy
def test_resuming_compares_the_shift_a_record_stands_for(caplog):
    """A timestep_shift of None is its scheduler's shift: resuming a checkpoint recorded with the
    explicit number is no change, another number is."""
    from models.checkpoints.record import ModelRecord

    recorded = describe(build_model("mmdit-tiny", timestep_shift=1.0))  # mmdit-tiny's scheduler: 1.0
    default = ModelRecord(describe(build_model("mmdit-tiny")))
    with caplog.at_level(logging.WARNING):
        default.load_state_dict(recorded)
    assert "timestep_shift" not in caplog.text
    with caplog.at_level(logging.WARNING):
        default.load_state_dict({**recorded, "timestep_shift": 3.0})
    assert "recorded with timestep_shift=3.0 into a model with timestep_shift=1.0" in caplog.text


def test_sample_grids_at_the_training_resolution_use_its_shift(tmp_path):
    """SampleGrids(resolution=16) on an auto model: 16 px pictures, sampled with 16 px's shift."""
    from types import SimpleNamespace

    from extensions.sample_grids import SampleGrids

    torch.manual_seed(0)
    model = build_model("mmdit-tiny", timestep_shift="auto").eval()
    grids = SampleGrids(PROMPTS[:1], per_prompt=1, guidance=1.0, steps=2, folder=str(tmp_path), resolution=16)
    state = SimpleNamespace(
        model=model, algorithms=[], callbacks=[], run_name="x", timestamp=SimpleNamespace(batch=0)
    )
    logger = SimpleNamespace(log_images=lambda *args, **kwargs: None)
    grids.fit_start(state, logger)
    seen = _timesteps_seen(model, lambda: grids.draw(state, logger))
    reference = FlowMatchEulerDiscreteScheduler(shift=0.0625)  # sqrt(16^2 / 256^2)
    reference.set_timesteps(2)
    torch.testing.assert_close(torch.stack([step[0] for step in seen]), reference.timesteps)
    assert Image.open(tmp_path / "ba0.png").size == (16, 16)  # one picture: no grid padding
    assert json.loads((tmp_path / "ba0.json").read_text())["resolution"] == 16
    with pytest.raises(ValueError, match="resolution=0 must be a positive integer"):
        SampleGrids(PROMPTS, resolution=0)


@pytest.mark.heavy
def test_an_unrecorded_mmdit_checkpoint_is_inferred_from_its_shapes(mmdit, tmp_path, caplog):
    model, checkpoint, _, _ = mmdit
    full = torch.load(checkpoint, weights_only=False)
    del full["state"]["callbacks"]
    torch.save(full, tmp_path / "old.pt")
    assert weights_family(full["state"]["model"]) == "mmdit"
    with caplog.at_level(logging.WARNING):
        loaded = load_model_from_checkpoint(tmp_path / "old.pt", ema=False)
    assert "has no model record" in caplog.text
    assert type(loaded) is RectifiedFlowTransformer and loaded.preset == "mmdit-tiny"
    assert _same(loaded.state_dict(), model.state_dict())  # the latent shift too: it is a buffer
    assert loaded.t5_tokens == 8 and loaded.tokenizer_2.pad_token == "!"
    with pytest.raises(ValueError, match="does not hold preset 'sdxl-tiny'"):
        load_model_from_checkpoint(tmp_path / "old.pt", preset="sdxl-tiny")
    with pytest.raises(ValueError, match="predicts the flow"):
        load_model_from_checkpoint(tmp_path / "old.pt", prediction_type="epsilon")


def test_sd3_medium_is_inferred_from_its_shapes():
    shapes = export._preset_shapes("sd3-medium")  # meta-device shapes: no 11 GB of weights
    assert shapes["latent_shift"] == () and not any(k.startswith("unet.") for k in shapes)
    weights = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    assert weights_family(weights) == "mmdit" and infer_preset(weights) == "sd3-medium"


def test_a_prediction_type_contradicting_the_record_is_an_error(mmdit, tmp_path):
    _, checkpoint, _, _ = mmdit
    with pytest.raises(SystemExit, match="--prediction-type epsilon contradicts the checkpoint"):
        export.main([str(checkpoint), str(tmp_path / "out"), "--prediction-type", "epsilon"])
    with pytest.raises(ValueError, match=r"load \['transformer', 'vae', 'text_encoder', 'text_encoder_2'\]"):
        build_model("mmdit-tiny", pretrained=str(tmp_path), pretrained_components=["vae"], lora={"rank": 4})


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.heavy
def test_generate_cli_on_checkpoint_and_folder(mmdit, tmp_path, capsys):
    _, checkpoint, _, folder = mmdit
    loaded = generate.load_model(folder)
    assert type(loaded) is RectifiedFlowTransformer and loaded.t5_tokens == 8
    # The folder's shift is the one the checkpoint samples with at its native size (auto: 0.125).
    assert float(loaded.latent_shift) == 0.0625 and loaded.noise_scheduler.config.shift == 0.125
    assert loaded.timestep_shift is None and loaded.shift_for((32, 32)) == 0.125
    fast = ["--n-per-prompt", "2", "--steps", "3", "--seed", "5"]  # no --sampler: the family's (euler)
    from_ckpt, from_dir = tmp_path / "ckpt.png", tmp_path / "dir.png"
    generate.main([str(checkpoint), *PROMPTS, "--out", str(from_ckpt), *fast])
    generate.main([str(folder), *PROMPTS, "--out", str(from_dir), *fast])
    a, b = np.asarray(Image.open(from_ckpt)), np.asarray(Image.open(from_dir))
    assert a.shape == b.shape == (2 * 34 + 2, 2 * 34 + 2, 3)
    assert np.array_equal(a, b)
    with pytest.raises(SystemExit, match="sampler 'ddim': an mmdit model samples with euler") as exit_:
        generate.main([str(folder), "x", "--out", str(tmp_path / "x.png"), "--sampler", "ddim"])
    assert "\n" not in str(exit_.value.code)


def test_a_folder_without_our_readme_reads_sd3_s_t5_length(mmdit, tmp_path):
    *_, folder = mmdit
    shutil.copytree(folder, tmp_path / "foreign")
    (tmp_path / "foreign" / "README.md").unlink()
    assert generate.load_model(tmp_path / "foreign").t5_tokens == 77


def _tiny_t5():
    from transformers import T5Config, T5EncoderModel

    from models.engine.tokenizer import build_t5_tokenizer
    from models.registry import PRESETS

    tokenizer = build_t5_tokenizer()
    torch.manual_seed(4)
    config = dict(PRESETS["mmdit-tiny"]["text_encoder_3"], vocab_size=len(tokenizer))
    return T5EncoderModel(T5Config(**config)).eval(), tokenizer


@pytest.mark.heavy
def test_a_model_with_t5_round_trips(mmdit, tmp_path):
    """T5 from a pretrained folder: its config and its tokenizer's folder in the record, its weights in
    the checkpoint; the export has text_encoder_3 and tokenizer_3 and loads without being told anything,
    and samples as generate() does."""
    _, _, _, folder = mmdit
    pipe = _pipeline(folder)
    pipe.text_encoder_3, pipe.tokenizer_3 = _tiny_t5()
    base = tmp_path / "base"
    pipe.save_pretrained(base)
    model = build_model(
        "mmdit-tiny",
        pretrained=str(base),
        pretrained_components=["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_3"],
    ).eval()
    checkpoint = _checkpoint_of(model, tmp_path / "ckpt.pt")
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["text_encoder_3"]["d_model"] == 128 and record["tokenizer_3"] == {"source": str(base)}

    loaded = load_model_from_checkpoint(checkpoint)
    assert type(loaded.text_encoder_3).__name__ == "T5EncoderModel" and loaded.tokenizer_3 is not None
    assert _same(loaded.state_dict(), model.state_dict())
    assert torch.equal(loaded.tokenize_t5(PROMPTS), model.tokenize_t5(PROMPTS))

    export.main([str(checkpoint), str(tmp_path / "out")])
    out = tmp_path / "out"
    assert (out / "text_encoder_3").is_dir() and _front_matter(out)["max_sequence_length"] == 8
    expected = loaded.generate(PROMPTS, seed=2, **SAMPLING)
    torch.testing.assert_close(_pipe_images(_pipeline(out, t5=True), seed=2), expected, atol=1e-6, rtol=0)
    from_folder = generate.load_model(out)
    assert from_folder.text_encoder_3 is not None
    torch.testing.assert_close(from_folder.generate(PROMPTS, seed=2, **SAMPLING), expected, atol=1e-6, rtol=0)

    # The record names the folder T5's tokenizer came from: gone, it is a one-line error that says so.
    base.rename(tmp_path / "moved")
    with pytest.raises(SystemExit, match="tokenizer came from .*base/tokenizer_3: not found") as exit_:
        export.main([str(checkpoint), str(tmp_path / "again")])
    assert "\n" not in str(exit_.value.code)


@pytest.mark.heavy  # builds the tiny Inception and CLIP scorers (~10 CPU-seconds)
def test_evaluate_an_mmdit_checkpoint_and_its_folder(mmdit, shapes_mds, tmp_path):
    """evaluation.evaluate on the checkpoint and on its export: the family's sampler (euler) and native
    size (32 px) by default, the same images and metrics from both."""
    from evaluation import evaluate

    _, checkpoint, _, folder = mmdit
    args = ["--data", str(shapes_mds / "mds"), "--num-captions", "10", "--guidance", "3", "--steps", "2"]
    args += ["--extractors", "tiny", "--seed", "0"]
    rows = {}
    for name, source in (("ckpt", checkpoint), ("folder", folder)):
        rows[name] = evaluate.main([str(source), "--out", str(tmp_path / name), *args])
        settings = json.loads((tmp_path / name / "images/guidance-3/settings.json").read_text())
        assert settings["sampler"] == "euler" and settings["resolution"] == 32
    assert rows["ckpt"] == [pytest.approx(r, rel=1e-6) for r in rows["folder"]]
    pngs = sorted((tmp_path / "ckpt/images/guidance-3").glob("*.png"))
    assert len(pngs) == 10  # evaluation/image_metrics.py's MIN_IMAGES
    for png in pngs:
        assert png.read_bytes() == (tmp_path / "folder/images/guidance-3" / png.name).read_bytes()
    with pytest.raises(SystemExit, match="an mmdit model samples with euler"):
        evaluate.main([str(checkpoint), "--out", str(tmp_path / "ddim"), *args, "--sampler", "ddim"])


@pytest.mark.fit
def test_a_training_run_records_and_exports_the_mmdit_model(shapes_mds, tmp_path):
    """yamls/tiny-mmdit-cpu.yaml for 3 batches with EMA and a sample grid of the family's sampler: the
    checkpoint records an mmdit model, and its EMA and raw exports sample like generate()."""
    from recipes import build_trainer, load_config
    from tests.conftest import REPO, tiny_run

    overrides = [
        *tiny_run(shapes_mds, 3),
        f"trainer.save_folder={tmp_path / 'run'}",
        "trainer.save_filename=ckpt.pt",
        "scheduler.t_warmup=0ba",  # the recipe's warmup would train these batches at lr 0
        "algorithms.ema.half_life=2ba",
        "+callbacks.samples={_target_: extensions.sample_grids.SampleGrids}",
        f"+callbacks.samples.prompts=[{','.join(PROMPTS)}]",
        "+callbacks.samples.per_prompt=1",
        "+callbacks.samples.steps=2",
        f"+callbacks.samples.folder={tmp_path / 'samples'}",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-mmdit-cpu.yaml", overrides))
    trainer.fit()
    trainer.close()
    assert json.loads((tmp_path / "samples/ba3.json").read_text())["sampler"] == "euler"
    checkpoint = tmp_path / "run" / "ckpt.pt"
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["family"] == "mmdit" and record["preset"] == "mmdit-tiny" and record["version"] == 3
    for flag in ("--ema", "--raw"):
        out = tmp_path / flag.strip("-")
        export.main([str(checkpoint), str(out), flag])
        expected = load_model_from_checkpoint(checkpoint, ema=flag == "--ema").generate(
            PROMPTS, seed=1, **SAMPLING
        )
        torch.testing.assert_close(_pipe_images(_pipeline(out), seed=1), expected, atol=1e-6, rtol=0)
    ema, raw = (
        SD3Transformer2DModel.from_pretrained(tmp_path / name, subfolder="transformer").state_dict()
        for name in ("ema", "raw")
    )
    assert any(not torch.equal(ema[k], raw[k]) for k in ema)
