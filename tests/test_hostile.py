"""A new user's mistakes with train.py, table-driven (issue 37): each ends in one `config error:` line
before any model, dataloader or Trainer is built, and leaves every file of the user's unchanged.

The user's world is made once per module: a folder of 40 photos, the same as a 40-sample MDS set, the
shared 64-sample shapes set and damaged copies of it (a truncated shard, a missing shard, no
index.json, an index.json that does not parse), precomputed latents of two presets, a folder of an
earlier run's checkpoints, a bucketed set with a 4-image bucket, a YAML that does not parse and the
tiny VAE's export folder. Each case runs train.py's own `main` in-process (a subprocess would only
add ~7 s of imports per case) in that folder.
"""

import hashlib
import random
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO

TINY = str(REPO / "yamls" / "tiny-cpu.yaml")
MMDIT = str(REPO / "yamls" / "tiny-mmdit-cpu.yaml")
VAE = str(REPO / "yamls" / "tiny-vae.yaml")
# The tiny recipe on the shapes set, shortened, saving under the world's runs/ folder.
BASE = {
    "data.train.local": "shapes",
    "data.train.prepare": "null",
    "model.pretrained": "null",
    "global_train_batch_size": "16",
    "callbacks.samples": "null",
    "trainer.max_duration": "2ba",
    "trainer.save_folder": "runs/out",
    "trainer.progress_bar": "false",
}


@pytest.fixture(scope="module")
def world(shapes_mds, tmp_path_factory) -> Path:
    from convert.__main__ import main as sd_convert
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder
    from recipes.prepare import prepare_random_latents

    root = tmp_path_factory.mktemp("user")
    write_shapes_folder(root / "photos", n=40, size=32, seed=5)
    write_mds(iter_samples(root / "photos"), str(root / "mds40"))
    shutil.copytree(shapes_mds / "mds", root / "shapes")
    for name in ("trunc", "noshard", "noindex", "badindex"):
        shutil.copytree(shapes_mds / "mds", root / name)
    shard = sorted((root / "trunc").glob("shard.*.mds"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    for shard in (root / "noshard").glob("shard.*.mds"):
        shard.unlink()
    (root / "noindex" / "index.json").unlink()
    (root / "badindex" / "index.json").write_text('{"shards": [')
    prepare_random_latents(root / "lat-tiny", "tiny", n=32, resolutions=(32,))
    argv = ["latents", "--src", str(root / "mds40"), "--out", str(root / "lat-sdxl"), "--preset", "sdxl-tiny"]
    assert sd_convert([*argv, "--resolution", "32", "--work-dir", str(root / "work")]) == 0
    shutil.rmtree(root / "work", ignore_errors=True)
    (root / "ckpts").mkdir()
    (root / "ckpts" / "ep0-ba4-rank0.pt").write_bytes(b"an earlier run's checkpoint")
    rng = random.Random(0)
    (root / "bimages").mkdir()
    for label, size, count in (("ar1", (32, 32), 30), ("ar0.75", (24, 32), 4)):
        for i in range(count):
            Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3))).save(
                root / "bimages" / f"{label}-{i}.png"
            )
            (root / "bimages" / f"{label}-{i}.txt").write_text(f"a {label} picture")
    argv = ["folder", "--src", str(root / "bimages"), "--out", str(root / "buckets"), "--buckets", "1,0.75"]
    assert sd_convert([*argv, "--work-dir", str(root / "work")]) == 0
    shutil.rmtree(root / "work", ignore_errors=True)
    (root / "bad.yaml").write_text("defaults: [_base\nmodel: {preset: tiny\n")
    (root / "notes.txt").write_text("not a dataset")
    (root / "runs" / "tiny-vae" / "export").mkdir(parents=True)
    (root / "runs" / "other").mkdir()
    mark = '{"writer": "extensions.save_pretrained.SavePretrained", "run_name": "their-vae"}'
    (root / "runs" / "other" / "save-pretrained.json").write_text(mark)
    (root / "runs" / "tiny-vae" / "export" / "model_index.json").write_text('{"mine": true}')
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


# An eval set, on the tiny recipe: the shapes themselves.
EVAL = {"+data.eval": "{local: shapes, resolution: 32}", "trainer.eval_interval": "2ba"}
# (case id, overrides on top of BASE (None removes a key), expected start of the message after
# "config error: "), on the tiny recipe unless the overrides name another.
CASES = [
    # Names
    ("unknown key", {"no_such_key": "1"}, "unknown config key 'no_such_key'"),
    ("trainer key typo", {"trainer.max_durations": "2ba"}, "unknown config key 'trainer.max_durations'"),
    ("data key typo", {"data.train.resolutoin": "32"}, "unknown config key 'data.train.resolutoin'"),
    ("model key typo", {"model.presett": "tiny"}, "unknown config key 'model.presett'"),
    ("unknown preset", {"model.preset": "sd9"}, "'model.preset' must be one of"),
    ("optimizer typo", {"optimizer.weight_decy": "0.1"}, "unknown config key 'optimizer.weight_decy'"),
    ("optimizer class", {"optimizer._target_": "torch.optim.Adamw"}, "'optimizer._target_': cannot import"),
    ("callback typo", {"callbacks.nan_guard.check_inff": "false"}, "unknown config key 'callbacks.nan_guard"),
    ("ema typo", {"algorithms.ema.half_lfe": "3"}, "unknown config key 'algorithms.ema.half_lfe'"),
    ("recipe-set trainer key", {"trainer.seed": "3"}, "'trainer.seed' is set by the recipe"),
    ("recipe-set model", {"trainer.model": "x"}, "'trainer.model' is set by the recipe"),
    ("empty run name", {"run_name": "null"}, "config key 'run_name' must be set"),
    # Numbers out of range
    ("drop prob above 1", {"model.caption_drop_prob": "1.5"}, "'model.caption_drop_prob' must be a probabil"),
    (
        "drop prob below 0",
        {"model.caption_drop_prob": "-0.1"},
        "'model.caption_drop_prob' must be a probabil",
    ),
    ("drop prob text", {"model.caption_drop_prob": "often"}, "'model.caption_drop_prob' must be a probabil"),
    ("negative offset noise", {"model.offset_noise": "-1"}, "'model.offset_noise' must be zero or more"),
    ("zero min-snr gamma", {"model.min_snr_gamma": "0"}, "'model.min_snr_gamma' must be a positive"),
    ("prediction type", {"model.prediction_type": "x0"}, "'model.prediction_type' must be one of"),
    ("zero resolution", {"data.train.resolution": "0"}, "'data.train.resolution' must be a positive"),
    ("negative resolution", {"data.train.resolution": "-32"}, "'data.train.resolution' must be a positive"),
    (
        "resolution not a multiple",
        {"data.train.resolution": "30"},
        "'data.train.resolution' is 30, not a mult",
    ),
    ("resolution text", {"data.train.resolution": "big"}, "config key 'data.train.resolution' must be int"),
    ("zero batch", {"global_train_batch_size": "0"}, "global_train_batch_size"),
    ("negative batch", {"global_train_batch_size": "-4"}, "global_train_batch_size"),
    ("batch text", {"global_train_batch_size": "lots"}, "config key 'global_train_batch_size' must be int"),
    ("negative lr", {"optimizer.lr": "-1"}, "'optimizer' (torch.optim.AdamW): Invalid learning rate"),
    ("lr text", {"optimizer.lr": "fast"}, "'optimizer.lr' must be a number, got 'fast'"),
    ("beta above 1", {"optimizer.betas": "[2.0,0.9]"}, "'optimizer' (torch.optim.AdamW): Invalid beta"),
    ("negative weight decay", {"optimizer.weight_decay": "-1"}, "'optimizer' (torch.optim.AdamW): Invalid"),
    ("negative eps", {"optimizer.eps": "-1"}, "'optimizer' (torch.optim.AdamW): Invalid epsilon"),
    ("zero duration", {"trainer.max_duration": "0ba"}, "'trainer.max_duration' must be more than zero"),
    ("negative duration", {"trainer.max_duration": "-5ba"}, "'trainer.max_duration' must be"),
    ("duration text", {"trainer.max_duration": "forever"}, "'trainer.max_duration' must be a duration"),
    ("duration in dur", {"trainer.max_duration": "0.5dur"}, "'trainer.max_duration' cannot be in dur"),
    ("zero microbatch", {"+trainer.device_train_microbatch_size": "0"}, "trainer.device_train_microbatch"),
    ("auto microbatch on cpu", {"+trainer.device_train_microbatch_size": "auto"}, "'trainer.device_train_m"),
    ("negative ema half life", {"algorithms.ema.half_life": "-1ba"}, "'algorithms.ema' (extensions.ema.EMA)"),
    ("scheduler warmup text", {"scheduler.t_warmup": "soon"}, "'scheduler'"),
    # This machine
    ("bf16 on cpu", {"trainer.precision": "amp_bf16"}, "'trainer.precision' is amp_bf16, which the CPU"),
    ("gpu without one", {"trainer.device": "gpu"}, "'trainer.device' is gpu but this machine has no CUDA"),
    # Model options of the other family, or none of any
    (
        "flow option on a unet",
        {"model.timestep_shift": "3.0"},
        "model.timestep_shift is a rectified-flow opt",
    ),
    ("param dtype", {"model.param_dtype": "float16"}, "model.param_dtype='float16'; choose one of"),
    ("train draws", {"+model.train_draws": "everywhere"}, "model.train_draws='everywhere'; choose one of"),
    ("attention", {"model.attention": "flash"}, "model: attention='flash'; choose 'sdpa' or 'math'"),
    ("fsdp wrap", {"model.fsdp_wrap": "everything"}, "model: fsdp_wrap='everything'; choose one of"),
    ("lora without base", {"+model.lora": "{rank: 4}"}, "model.lora trains an adapter on a pretrained"),
    ("lora rank", {"+model.lora": "{rank: 0}"}, "model.lora.rank must be a positive integer"),
    ("components", {"+model.pretrained_components": "[unett]"}, "model: pretrained_components: unknown"),
    ("mmdit negative shift", {"@": MMDIT, "model.timestep_shift": "-1"}, "'model.timestep_shift' must be a"),
    ("mmdit zero std", {"@": MMDIT, "model.timestep_std": "0"}, "'model.timestep_std' must be a positive"),
    ("mmdit ddpm option", {"@": MMDIT, "model.offset_noise": "0.1"}, "model.offset_noise is a DDPM option"),
    ("mmdit weighting", {"@": MMDIT, "model.loss_weighting": "snr"}, "model.loss_weighting='snr'; choose"),
    ("mmdit patch size", {"@": MMDIT, "data.train.resolution": "36"}, "'data.train.resolution' is 36, not a"),
    (
        "mmdit lora without a base",
        {"@": MMDIT, "+model.lora": "{rank: 4}"},
        "model.lora trains an adapter on a pretrained model: set model.pretrained",
    ),
    # Sharding (recipes/parallelism.py), on one process
    ("shard typo", {"@": MMDIT, "parallelism.shard": "nodes"}, "parallelism.shard must be a positive number"),
    ("shard over 2 of 1", {"@": MMDIT, "parallelism.shard": "2"}, "parallelism.shard=2 does not divide the"),
    ("2 copies on 1", {"@": MMDIT, "parallelism.replicate": "2"}, "parallelism.shard=1 x parallelism.rep"),
    # Data
    ("typo in the data folder", {"data.train.local": "shapez"}, "data.train.local=shapez does not exist"),
    (
        "typo with the recipe's preparer",
        {"data.train.local": "shapez", "data.train.prepare": None},
        "data.train.local=shapez does not exist",
    ),  # fmt: skip
    ("photo folder", {"data.train.local": "photos"}, "data.train.local=photos holds 40 image files"),
    (
        "photo folder with preparer",
        {"data.train.local": "photos", "data.train.prepare": None},
        "data.train.local=photos holds 40 image files",
    ),  # fmt: skip
    ("a file", {"data.train.local": "notes.txt"}, "data.train.local=notes.txt is a file"),
    ("no data", {"data.train.local": "null"}, "data.train: set `local`"),
    (
        "set smaller than a batch",
        {"data.train.local": "mds40", "global_train_batch_size": "64"},
        "data.train: an epoch holds 40 samples, fewer than one global batch",
    ),  # fmt: skip
    (
        "bucket smaller than a batch",
        {
            "data.train.local": "buckets",
            "data.train.buckets": "true",
            "data.train.batching_method": "per_stream",
            "global_train_batch_size": "8",
        },
        "data.train: with batching_method per_stream every batch comes from one stream, and data/ar0.75 (4)",
    ),  # fmt: skip
    (
        "stream smaller than a batch",
        {
            "data.train.local": "null",
            "data.train.batching_method": "per_stream",
            "+data.train.streams": "{a: {local: mds40}, b: {local: shapes}}",
            "global_train_batch_size": "48",
        },
        "data.train: with batching_method per_stream every batch comes from one stream, and a (40)",
    ),  # fmt: skip
    (
        "epoch of chosen samples",
        {
            "data.train.local": "null",
            "global_train_batch_size": "32",
            "+data.train.streams": "{a: {local: shapes, choose: 20}}",
        },
        "data.train: an epoch holds 20 samples",
    ),  # fmt: skip
    (
        "truncated shard",
        {"data.train.local": "trunc"},
        "data.train: shard trunc/shard.00000.mds is 1,000 bytes",
    ),
    ("missing shard", {"data.train.local": "noshard"}, "data.train: shard noshard/shard.00000.mds listed in"),
    ("missing index.json", {"data.train.local": "noindex"}, "data.train.local=noindex holds no MDS dataset"),
    (
        "broken index.json",
        {"data.train.local": "badindex"},
        "data.train: badindex/index.json is not valid JSON",
    ),
    (
        "latents under an image recipe",
        {"data.train.local": "lat-tiny"},
        "data.train: lat-tiny holds precomputed latents",
    ),  # fmt: skip
    ("images under a latents recipe", {"data.train.latents": "true"}, "data.train: shapes holds images"),
    (
        "latents at another resolution",
        {"data.train.local": "lat-tiny", "data.train.latents": "true", "data.train.resolution": "64"},
        "data.train: lat-tiny holds latents at 32 px, not at data.train.res",
    ),  # fmt: skip
    (
        "latents of another preset",
        {"data.train.local": "lat-sdxl", "data.train.latents": "true"},
        "data.train: lat-sdxl holds latents made for preset sdxl-tiny",
    ),  # fmt: skip
    (
        "latents of another family",
        {"data.train.local": "lat-tiny", "data.train.latents": "true", "model.preset": "sdxl-tiny"},
        "data.train: lat-tiny lacks crop_top_left_32, original_size, pooled",
    ),  # fmt: skip
    ("image column", {"data.train.image_key": "img"}, "data.train: shapes has no 'img' column"),
    ("caption column", {"data.train.caption_key": "text"}, "data.train: shapes has no 'text' column"),
    ("unknown preparer", {"data.train.prepare": "nosuch"}, "data.train.prepare='nosuch' is not one of"),
    (
        "proportions",
        {
            "data.train.local": "null",
            "+data.train.streams": "{a: {local: shapes, proportion: 0.5}, b: {local: mds40, proportion: 0.4}}",  # noqa: E501,
        },
        "data.train.streams: the proportions add up to 0.9",
    ),  # fmt: skip
    (
        "stream key",
        {"data.train.local": "null", "+data.train.streams": "{a: {lcoal: shapes}}"},
        "data.train.streams.a: unknown keys",
    ),  # fmt: skip
    (
        "stream folder typo",
        {"data.train.local": "null", "+data.train.streams": "{a: {local: shapez}}"},
        "data.train: streams.a: cannot read shapez/index.json",
    ),  # fmt: skip
    ("buckets without per_stream", {"data.train.buckets": "true"}, "data.train.buckets: true needs batching"),
    (
        "buckets on a plain set",
        {"data.train.buckets": "true", "data.train.batching_method": "per_stream"},
        "data.train: local/remote: buckets: true, but 64 samples are outside",
    ),  # fmt: skip
    ("cache limit", {"data.train.cache_limit": "lots"}, "data.train.cache_limit='lots' is not a size"),
    ("sampling method", {"data.train.sampling_method": "x"}, "data.train.sampling_method='x'; choose"),
    ("shuffle algorithm", {"data.train.shuffle_algo": "x"}, "data.train.shuffle_algo='x'; choose"),
    ("eval folder typo", {"+data.eval": "{local: evl}"}, "data.eval.local=evl does not exist"),
    # A quality target (extensions/quality_target.py) that could never be judged or reached (issue 47)
    (
        "target without eval data",
        {"callbacks.quality_target.target": "0.5"},
        "'callbacks.quality_target.target' is set but the run has no data.eval to measure it on",
    ),  # fmt: skip
    (
        "target never evaluated",
        {**EVAL, "callbacks.quality_target.target": "0.5", "trainer.eval_interval": "0"},
        "'trainer.eval_interval' is 0, which never evaluates, so callbacks.quality_target.target=0.5 can "
        "never be judged; set trainer.eval_interval to a positive interval",
    ),  # fmt: skip
    (
        "target evaluated every 0 batches",
        {**EVAL, "callbacks.quality_target.target": "0.5", "trainer.eval_interval": "0ba"},
        "'trainer.eval_interval' is '0ba', which never evaluates",
    ),  # fmt: skip
    (
        "target evaluated every -100 samples",
        {**EVAL, "callbacks.quality_target.target": "0.5", "trainer.eval_interval": "-100sp"},
        "'trainer.eval_interval' is '-100sp', which never evaluates",
    ),  # fmt: skip
    (
        "target evaluated on no batch",
        {**EVAL, "callbacks.quality_target.target": "0.5", "+trainer.eval_subset_num_batches": "0"},
        "'trainer.eval_subset_num_batches' is 0, which evaluates no batch",
    ),  # fmt: skip
    (
        "negative target",
        {**EVAL, "callbacks.quality_target.target": "-0.1"},
        "callbacks.quality_target.target=-0.1 can never be reached: the validation loss is a mean squared "
        "error, never below 0; a target must be > 0",
    ),  # fmt: skip
    (
        "zero target",
        {**EVAL, "callbacks.quality_target.target": "0"},
        "callbacks.quality_target.target=0 can never be reached",
    ),  # fmt: skip
    (
        "infinite target",
        {**EVAL, "callbacks.quality_target.target": "inf"},
        "callbacks.quality_target.target=inf must be a validation loss",
    ),  # fmt: skip
    # Their earlier work
    (
        "earlier run's checkpoints",
        {"trainer.save_folder": "ckpts", "trainer.autoresume": "false"},
        "'trainer.save_folder' ckpts holds checkpoints of an earlier run (newest: ep0-ba4-rank0.pt)",
    ),  # fmt: skip
    (
        "typo in model.pretrained",
        {"model.pretrained": "runs/tiny-vae/exprot"},
        "model.pretrained=runs/tiny-vae/exprot does not exist (prepare_pretrained runs",
    ),  # fmt: skip
    (
        "pretrained folder missing",
        {"model.pretrained": "nowhere/at/all", "prepare_pretrained": "null"},
        "model.pretrained=nowhere/at/all: no such folder",
    ),  # fmt: skip
    (
        "another run's export",
        {"@": VAE, "callbacks.save_pretrained.folder": "runs/other"},
        "callbacks.save_pretrained.folder=runs/other holds the export of run 'their-vae'",
    ),  # fmt: skip
    (
        "a pipeline of their own",
        {"@": VAE, "callbacks.save_pretrained.folder": "runs/tiny-vae/export"},
        "callbacks.save_pretrained.folder=runs/tiny-vae/export holds files that no SavePretrained",
    ),  # fmt: skip
    # The command line itself
    ("a key twice", {"optimizer.lr": "1e-3", "=optimizer.lr": "2e-3"}, "'optimizer.lr' is given twice"),
    ("missing recipe", {"@": "yamls/nosuch.yaml"}, "config file yamls/nosuch.yaml does not exist"),
    ("recipe that does not parse", {"@": "bad.yaml"}, "bad.yaml, line 2, column"),
]


def argv_of(overrides: dict) -> list[str]:
    recipe = overrides.get("@", TINY)
    merged = {
        **BASE,
        **{k.lstrip("="): v for k, v in overrides.items() if k != "@" and not k.startswith("=")},
    }
    args = [f"{k}={v}" for k, v in merged.items() if v is not None]
    args += [f"{k[1:]}={v}" for k, v in overrides.items() if k.startswith("=")]  # a key given twice
    if recipe == VAE:  # an autoencoder: no text side, no pretrained folder
        args = [a for a in args if a.split("=")[0] not in ("model.pretrained", "callbacks.samples")]
    if recipe == MMDIT:  # the transformer's recipe at the shapes' size
        args = [a for a in args if not a.startswith("data.train.prepare")] + ["~data.train.prepare"]
    return [recipe, *args]


@pytest.mark.parametrize("case, overrides, expected", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_before_anything_is_built(
    case, overrides, expected, world, monkeypatch, nothing_built
):
    import train as train_py

    monkeypatch.chdir(world)
    before = snapshot(world)
    with pytest.raises(SystemExit) as exit_:
        train_py.main(argv_of(overrides))
    message = str(exit_.value.code)
    assert message.startswith("config error: " + expected), message
    assert "\n" not in message and "Traceback" not in message
    assert snapshot(world) == before, f"{case}: the user's files changed"


def test_there_are_at_least_sixty_cases():
    assert len(CASES) >= 60


@pytest.mark.fit
def test_the_world_trains_where_the_mistakes_are_fixed(world, monkeypatch):
    """The control: BASE itself on the user's 40-image set, at a batch it holds, trains."""
    import train as train_py

    monkeypatch.chdir(world)
    overrides = {"data.train.local": "mds40", "global_train_batch_size": "8", "trainer.save_folder": "null"}
    train_py.main(argv_of(overrides))  # returns: no SystemExit
