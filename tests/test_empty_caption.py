"""Caption dropout on precomputed encodings without the text encoders: `sd-convert latents` writes the
empty caption's stored form once per output (convert/empty_caption.py), training on the set uses it
(data/latent_dataset.read_empty_caption, recipes/trainer.py), bitwise the loss of the model encoding ""
itself; a set without it keeps the model's own encoding."""

import shutil

import pytest
import torch
from safetensors.torch import save

import models.registry as families
from convert.encoders import load_encoders
from convert.latents import LatentsOptions, convert_latents, preset_columns
from convert.storage import LocalStore
from data.latent_dataset import EMPTY_CAPTION, LatentsDataset, load_empty_caption, read_empty_caption
from data.loader import ImageCaptionDataConfig, collate
from models import build_model
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (s3_server is a fixture)

RESOLUTION = 32


def convert(shapes_mds, out, preset, tmp_path, resolutions=(RESOLUTION,), **kwargs) -> dict:
    return convert_latents(
        str(shapes_mds / "mds"), str(out), list(resolutions), preset=preset, batch_size=32,
        work_dir=tmp_path / "work", progress=False, **{"precision": "fp32", **kwargs},
    )  # fmt: skip


def digest(preset: str, resolutions=(RESOLUTION,)) -> str:
    options = LatentsOptions(tuple(resolutions), preset, None, ())
    return options.digest(preset_columns(preset, list(resolutions)))


@pytest.fixture(scope="module")
def flux_set(shapes_mds, tmp_path_factory):
    """flux-tiny's precomputed set of the shapes (the preset's seed-0 random encoders)."""
    tmp = tmp_path_factory.mktemp("flux-set")
    convert(shapes_mds, tmp / "latents", "flux-tiny", tmp)
    return tmp / "latents"


def batch_of(out, n: int = 8) -> dict:
    dataset = LatentsDataset(local=str(out), resolution=RESOLUTION, batch_size=1, shuffle=False)
    return collate([dataset[i] for i in range(n)])  # as the data loader batches them


def training_loss(model, batch, seed: int = 3) -> torch.Tensor:
    """One training step's loss (the latent sample, caption dropout and the objective's draws from the
    global RNG, seeded here)."""
    torch.manual_seed(seed)
    model.train()
    with torch.no_grad():
        return model.loss(model(batch), batch)


@pytest.mark.parametrize("preset", ["flux-tiny", "mmdit-tiny", "tiny"])
@pytest.mark.heavy
def test_dropout_on_the_stored_empty_caption_is_the_models_own_encoding_bitwise(
    shapes_mds, flux_set, tmp_path, preset
):
    """A model whose text encoders are the conversion's: its loss with half the captions dropped is
    bitwise the same with the set's empty caption as with its own encoding of "". With other text
    encoders (what a run on precomputed encodings may hold, or not load at all) its own encoding gives
    another loss, the set's the same one; a set without the file keeps the model's own encoding."""
    out = tmp_path / "latents"
    if preset == "flux-tiny":
        shutil.copytree(flux_set, out)  # the module's set, which this test changes
    else:
        convert(shapes_mds, out, preset, tmp_path)
    stored, metadata = load_empty_caption((out / EMPTY_CAPTION).read_bytes())
    assert metadata["options"] == digest(preset)
    assert all(value.dtype == torch.float32 and value.shape[0] == 1 for value in stored.values())

    model = build_model(preset, caption_drop_prob=0.5)
    encoders = load_encoders(preset)  # the conversion's: the preset's seed-0 random weights
    for name in families.of(preset).conditioner.text_parts:
        setattr(model, name, getattr(encoders, name))
    batch = batch_of(out)
    own = training_loss(model, batch)
    with torch.no_grad():  # other text encoders
        for name in families.of(preset).conditioner.text_parts:
            if isinstance(getattr(model, name), torch.nn.Module):  # not the tokenizers
                for parameter in getattr(model, name).parameters():
                    parameter.add_(0.05)
    model.set_empty_caption(None)  # forget the empty caption encoded with the old weights
    assert not torch.equal(training_loss(model, batch), own)  # some caption was dropped

    cfg = ImageCaptionDataConfig(local=str(out), latents=True)
    model.set_empty_caption(read_empty_caption(cfg))
    assert torch.equal(training_loss(model, batch), own)

    (out / EMPTY_CAPTION).unlink()  # a set converted before the file existed
    assert read_empty_caption(cfg) is None


def test_written_once_restartable_and_replaced_with_its_conversion(shapes_mds, tmp_path):
    """A rerun of a finished conversion leaves the file as it is; one whose inputs were converted
    before the file existed writes it at the end (the same tensors); --overwrite with other options
    replaces it with the new conversion's."""
    out = tmp_path / "latents"
    convert(shapes_mds, out, "tiny", tmp_path)
    path = out / EMPTY_CAPTION
    first, written = path.read_bytes(), path.stat().st_mtime_ns
    report = convert(shapes_mds, out, "tiny", tmp_path)
    assert report["inputs_done_this_run"] == 0 and path.stat().st_mtime_ns == written
    path.unlink()
    convert(shapes_mds, out, "tiny", tmp_path)
    (again, again_meta), (tensors, metadata) = (load_empty_caption(b) for b in (path.read_bytes(), first))
    assert again_meta == metadata and again.keys() == tensors.keys()
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)

    convert(shapes_mds, out, "tiny", tmp_path, resolutions=(16,), overwrite=True)
    assert load_empty_caption(path.read_bytes())[1]["options"] == digest("tiny", (16,)) != digest("tiny")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]  # atomic writes left nothing


def test_a_wrong_or_mismatched_empty_caption_is_one_line(flux_set, tmp_path):
    """A file whose tensors are not the set's text columns, and two streams with different empty
    captions (encoded with different text encoders), are errors naming the file; a stream without
    one takes the others'."""
    sets = {}
    for name in ("a", "b"):
        sets[name] = tmp_path / name
        shutil.copytree(flux_set, sets[name])
    streams = {name: {"local": str(folder)} for name, folder in sets.items()}
    cfg = ImageCaptionDataConfig(streams=streams, latents=True)
    stored, _ = load_empty_caption((flux_set / EMPTY_CAPTION).read_bytes())
    assert read_empty_caption(cfg).keys() == stored.keys() == {"text_embeds", "pooled_text_embeds"}

    (sets["b"] / EMPTY_CAPTION).unlink()
    assert torch.equal(read_empty_caption(cfg)["text_embeds"], stored["text_embeds"])

    (sets["b"] / EMPTY_CAPTION).write_bytes(save({k: v + 1 for k, v in stored.items()}))
    with pytest.raises(ValueError, match="different empty captions") as err:
        read_empty_caption(cfg)
    assert "\n" not in str(err.value)

    (sets["b"] / EMPTY_CAPTION).write_bytes(save({"text_embeds": stored["text_embeds"]}))
    with pytest.raises(
        ValueError, match=r"not the set's text columns \['pooled_text_embeds', 'text_embeds'\]"
    ):
        read_empty_caption(cfg)


def test_the_model_refuses_a_stored_form_that_is_not_one_captions():
    model = build_model("flux-tiny")
    with pytest.raises(ValueError, match="holds some of"):
        model.set_empty_caption({"input_ids": torch.zeros(1, 77)})
    with pytest.raises(ValueError, match=r"one caption's, \(1, \.\.\.\), not \(2, 8, 64\)"):
        model.set_empty_caption({"text_embeds": torch.zeros(2, 8, 64)})


@pytest.mark.heavy
def test_the_trainer_hands_the_set_s_empty_caption_to_the_model(flux_set):
    """recipes/trainer.py: a run on precomputed encodings with caption dropout sets the set's empty
    caption on its model once, before training; without dropout it reads nothing."""
    from recipes import load_config, parse_config
    from recipes.trainer import trainer_kwargs
    from tests.conftest import REPO, TINY_TEST

    overrides = [f"data.train.local={flux_set}", "~data.train.prepare", "data.train.latents=true",
                 f"data.train.resolution={RESOLUTION}", "data.eval=null", *TINY_TEST]  # fmt: skip
    stored, _ = load_empty_caption((flux_set / EMPTY_CAPTION).read_bytes())
    run = parse_config(load_config(REPO / "yamls/tiny-flux-cpu.yaml", overrides))
    assert run.model["caption_drop_prob"] > 0
    model = trainer_kwargs(run, 1)["model"]
    assert all(torch.equal(model.empty_stored("cpu")[k], v) for k, v in stored.items())
    run = parse_config(
        load_config(REPO / "yamls/tiny-flux-cpu.yaml", [*overrides, "model.caption_drop_prob=0"])
    )
    assert trainer_kwargs(run, 1)["model"]._empty_caption is None


def test_the_store_reads_back_what_it_wrote(tmp_path):
    store = LocalStore(str(tmp_path / "out"))
    assert store.read_bytes(EMPTY_CAPTION) is None
    store.write_bytes(EMPTY_CAPTION, b"\x00\x01")
    assert store.read_bytes(EMPTY_CAPTION) == b"\x00\x01"


@pytest.mark.server
def test_written_to_s3_and_read_from_there(s3_server, shapes_mds, tmp_path, monkeypatch):  # noqa: F811
    """An s3:// output gets the file beside its index.json, a run reads it from the remote (not in its
    local cache), and a remote set without it reads as none."""
    for name in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, s3_server.env()[name])
    out = f"s3://{BUCKET}/flux-latents"
    convert(shapes_mds, out, "flux-tiny", tmp_path)
    body = s3_server.client().get_object(Bucket=BUCKET, Key=f"flux-latents/{EMPTY_CAPTION}")["Body"].read()
    stored, metadata = load_empty_caption(body)
    assert metadata["options"] == digest("flux-tiny") and set(stored) == {"text_embeds", "pooled_text_embeds"}

    cfg = ImageCaptionDataConfig(remote=out, local=str(tmp_path / "cache"), latents=True)
    read = read_empty_caption(cfg)
    assert all(torch.equal(read[k], v) for k, v in stored.items())
    s3_server.client().delete_object(Bucket=BUCKET, Key=f"flux-latents/{EMPTY_CAPTION}")
    assert read_empty_caption(cfg) is None
