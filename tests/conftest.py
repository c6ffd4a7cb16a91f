import os
import shutil
import sys
from pathlib import Path

import pytest

import compat.torchao  # noqa: F401  (before any test module imports diffusers: compat/torchao.py)

# Shrinks yamls/tiny-cpu.yaml to a seconds-long test run: a random VAE instead of the one the demo's
# first stage trains (so no stage-1 run is needed), and the batch the 64-sample test set was sized for.
# Sample grids (extensions/sample_grids.py) are tested on their own (tests/test_samples.py), not drawn at the
# end of every test run.
TINY_TEST = ["model.pretrained=null", "global_train_batch_size=16", "callbacks.samples=null"]
REPO = Path(__file__).resolve().parents[1]


def tiny_run(shapes_mds: Path, batches: int) -> list[str]:
    """Overrides of yamls/tiny-cpu.yaml for an in-process test run: `batches` batches on the shared
    shapes set, no checkpoints, no progress bar."""
    return [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        *TINY_TEST,
        f"trainer.max_duration={batches}ba",
        "trainer.save_folder=null",
        "trainer.progress_bar=false",
    ]


def merged(*overrides: str) -> list[str]:
    """`overrides` with each key once, the last value kept (train.py refuses a key given twice)."""
    last = {o.split("=", 1)[0].lstrip("+~"): o for o in overrides}
    return list(last.values())


sys.path.insert(0, str(REPO))
# The fast and full test tiers: marks, and the guard that keeps unmarked tests unit tests.
pytest_plugins = ["tests.tiers"]
# Tests never reach a hub or a logging service.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_session():
    """Session fixtures too run one torch thread (autouse: before the others of the session). CPU
    convolutions give different last bits on 1 and 2 threads, so `plain_latents`, built in-process,
    would not equal `--workers 2`'s one-thread output when its test happened to build it first."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread(one_thread_per_session):
    """Every test runs one torch thread: pytest-xdist runs a worker per core, and two threads on a
    shared 2-core machine ran the tiny model ~40x slower than one (tests/test_nan_guard.py)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def no_leftover_streaming_shm():
    """Shared memory that killed test runs left behind (prefixes whose folders are gone, pytest's
    old temp dirs): every new StreamingDataset opens each leftover prefix again and keeps the file
    descriptors, thousands over the suite, until "Too many open files"."""
    from recipes.shm import remove_registrations

    remove_registrations(lambda registered: not any(os.path.exists(f) for f in registered))


@pytest.fixture(scope="session", autouse=True)
def streaming_closes_its_probes():
    """Streaming 0.13 keeps a file descriptor open until the process exits for every shared-memory
    block it merely probes: a new StreamingDataset opens each block of every prefix in use (6 per
    dataset alive or dropped: its atexit hook holds it) to find a free one, so a process that builds
    k datasets holds about 3 k^2 descriptors (measured: 40 datasets, 9,847). A training run builds
    one or two; a test worker builds a hundred and ran out ("Too many open files" in CI). Here the
    probes are opened without the atexit hook, so each closes as soon as the probe is done."""
    from compat.streaming import prefix_probes_close_after_use

    with prefix_probes_close_after_use():
        yield


def shared_folder(tmp_path_factory, name: str, build) -> Path:
    """`name` under a folder that every test process of this session shares (pytest-xdist workers
    each have their own basetemp below it), built once by `build(folder)` under a file lock: the
    first worker that asks builds it, the others wait for it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


# Modules run in the order of their most expensive test: a slow test with a server (the S3 resume,
# ~1.5 minutes), then the other slow ones (the quick demo), then those that start processes or fit a
# trainer, then the unit tests. With `--maxschedchunk 1` (Makefile) pytest-xdist hands out one test
# at a time from this queue, so the long ones start first and the quick ones fill the other worker;
# a module's tests stay together, so that its module-scoped fixtures (a SeaweedFS server) are built
# once per worker.
COST_RANKS = [("slow", "server"), ("slow",), ("server",), ("subprocess",), ("fit",), ("heavy",)]


def _cost_rank(item) -> int:
    marks = {mark.name for mark in item.iter_markers()}
    return next((i for i, needed in enumerate(COST_RANKS) if marks.issuperset(needed)), len(COST_RANKS))


def pytest_collection_modifyitems(items):
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, len(COST_RANKS)), _cost_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: file order within a rank


@pytest.fixture(scope="session")
def shapes_mds(tmp_path_factory) -> Path:
    """64 synthetic shape images with captions, as an image folder and as MDS (shared by all
    test processes)."""
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder

    def build(root: Path) -> None:
        write_shapes_folder(root / "images", n=64, size=32, seed=0)
        write_mds(iter_samples(root / "images"), str(root / "mds"))

    return shared_folder(tmp_path_factory, "shapes", build)


@pytest.fixture(scope="session")
def tiny_checkpoint(shapes_mds, tmp_path_factory) -> Path:
    """A checkpoint of 3 batches of the tiny recipe with EMA (half-life 2 batches, so the average
    differs from the raw UNet), shared by every test process: read it, never write it."""
    from recipes import build_trainer, load_config

    def build(folder: Path) -> None:
        overrides = [
            *tiny_run(shapes_mds, 3),
            f"trainer.save_folder={folder}",
            "trainer.save_filename=ckpt.pt",
            "algorithms.ema.half_life=2",
        ]
        trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
        trainer.fit()
        trainer.close()

    return shared_folder(tmp_path_factory, "tiny-checkpoint", build) / "ckpt.pt"


@pytest.fixture(scope="session")
def reference_run(shapes_mds, tmp_path_factory):
    """`reference_run(nproc)`: the folder of one uninterrupted run of tests.resume_check's command on
    `nproc` processes, trained once per session and shared by every test that compares against it
    (kill-and-resume, kill during a save, S3 resume, elastic order, DDP checkpoints). Tests ask for it
    after their own runs, so one worker trains the reference while another trains the test's run."""
    from tests.resume_check import run, train_command, train_env

    def build(out: Path, nproc: int) -> None:
        result = run(train_command(nproc, out, shapes_mds), REPO, train_env())
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    def get(nproc: int) -> Path:
        return shared_folder(tmp_path_factory, f"reference-{nproc}proc", lambda out: build(out, nproc))

    return get


@pytest.fixture(scope="session")
def mmdit_reference(shapes_mds, tmp_path_factory):
    """`mmdit_reference(name)`: the folder of one uninterrupted run of a sharded tiny MMDiT shape
    (tests/fsdp2_runs.py SHAPES), trained once per session and shared by the FSDP2 tests. Its ranks are
    new interpreters, each with its own hash seed; the tests' runs are forked (tests/launch.py), so a
    rank-dependent order (a set's) would show as a difference."""
    from tests.fsdp2_runs import mmdit_command
    from tests.resume_check import LAUNCH_EXEC, run, train_env

    def build(out: Path, name: str) -> None:
        result = run(mmdit_command(name, out, shapes_mds, launch=LAUNCH_EXEC), REPO, train_env())
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    def get(name: str) -> Path:
        return shared_folder(tmp_path_factory, f"mmdit-{name}", lambda out: build(out, name))

    return get


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """(folder, weights): a small SD pipeline written with diffusers' own save_pretrained (random tiny
    weights, a v-prediction schedule, so the objective visibly comes from the folder), and its UNet,
    VAE and text encoder state dicts. Per test process; read it, never write it."""
    import torch
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    from models import build_model

    torch.manual_seed(1)
    model = build_model("tiny")
    pipe = StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, prediction_type="v_prediction"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    folder = tmp_path_factory.mktemp("pipeline")
    pipe.save_pretrained(folder)
    return folder, {name: getattr(model, name).state_dict() for name in ("unet", "vae", "text_encoder")}


@pytest.fixture
def nothing_built(monkeypatch):
    """Every builder in recipes.trainer fails the test if it is called."""
    import recipes.trainer

    built = []

    def refuse(name):
        def builder(*args, **kwargs):
            built.append(name)
            raise AssertionError(f"{name} was called before the config error was raised")

        return builder

    for name in ("build", "build_image_caption_dataloader", "Trainer"):  # all recipes.trainer builds
        monkeypatch.setattr(recipes.trainer, name, refuse(name))  # raises if a name is gone
    yield built
    assert built == []
