import os
import sys
from pathlib import Path

import pytest

# Shrinks yamls/tiny-cpu.yaml to a seconds-long test run: a random VAE instead of the one the demo's
# first stage trains (so no stage-1 run is needed), and the batch the 64-sample test set was sized for.
TINY_TEST = ["model.pretrained=null", "global_train_batch_size=16"]
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Tests never reach a hub or a logging service.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session", autouse=True)
def no_leftover_streaming_shm():
    """Shared memory that killed test runs left behind (prefixes whose folders are gone, pytest's
    old temp dirs): every new StreamingDataset opens each leftover prefix again and keeps the file
    descriptors, thousands over the suite, until "Too many open files"."""
    from recipes.shm import remove_registrations

    remove_registrations(lambda registered: not any(os.path.exists(f) for f in registered))


@pytest.fixture(scope="session")
def shapes_mds(tmp_path_factory) -> Path:
    """64 synthetic shape images with captions, as an image folder and as MDS."""
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder

    root = tmp_path_factory.mktemp("shapes")
    write_shapes_folder(root / "images", n=64, size=32, seed=0)
    write_mds(iter_samples(root / "images"), str(root / "mds"))
    return root
