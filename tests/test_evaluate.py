"""evaluation.evaluate: FID / KID / CLIP score with the tiny extractors, on 1 and 2 processes, resumed."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from PIL import Image

from evaluation import evaluate, extractors
from evaluation.image_metrics import KEYS, fid, kid
from tests.conftest import REPO
from tests.resume_check import LAUNCH, train_env

# 24 captions, 3 batches of 8, two guidance scales: 48 images of 32 px.
ARGS = ["--num-captions", "24", "--guidance", "1", "4", "--steps", "6", "--seed", "0", "--batch-size", "8"]
ARGS += ["--extractors", "tiny"]


def shapes(shapes_mds, n: int = 64) -> torch.Tensor:
    dataset = evaluate.open_dataset(
        evaluate.parse_args(["x", "--data", str(shapes_mds / "mds"), "--out", "-"])
    )
    return torch.stack([evaluate.real_image(dataset[i], "image", 32) for i in range(n)])


def test_fid_and_kid_rank_sets(shapes_mds):
    inception = extractors.inception("tiny")
    images = shapes(shapes_mds)
    first, second = inception(images[:32]).double(), inception(images[32:]).double()
    noise = inception(
        torch.randint(
            0, 256, images[:32].shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8
        )
    ).double()
    same, other_shapes, different = fid(first, first), fid(first, second), fid(first, noise)
    assert abs(same) < 1e-3 * different
    assert same < other_shapes < different / 10, (same, other_shapes, different)
    kid_same, kid_other, kid_different = (kid(first, x)[0] for x in (first, second, noise))
    # KID is unbiased: ~0 (either sign) for sets from one distribution.
    assert max(abs(kid_same), abs(kid_other)) < kid_different / 10, (kid_same, kid_other, kid_different)
    assert kid(first, noise, seed=1) == kid(first, noise, seed=1)


@pytest.mark.heavy  # builds the CLIP scorer three times
def test_clip_score_is_deterministic(shapes_mds):
    images, captions = shapes(shapes_mds, 8), ["a red circle"] * 4 + ["a blue square"] * 4
    scores = extractors.clip("tiny").scores(images, captions)
    assert scores.shape == (8,) and scores.abs().max() <= 1
    assert torch.equal(scores, extractors.clip("tiny").scores(images, captions))  # rebuilt: same seed
    assert not torch.equal(scores, extractors.clip("tiny").scores(images, captions[::-1]))


@pytest.mark.heavy
def test_missing_weights_are_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["ckpt.pt", "--data", str(tmp_path), "--out", str(tmp_path / "out")])
    message = str(exit_.value.code)
    assert "\n" not in message and extractors.INCEPTION_FILE in message and "--inception-weights" in message
    with pytest.raises(extractors.MissingWeights, match=r"ViT-H-14 weights .*--clip-model PATH"):
        extractors.clip("real", tmp_path / "absent.bin")


def images(folder) -> dict[str, bytes]:
    # Not the hidden .tmp-* file a SIGKILL can leave mid-write (empty, never renamed into place).
    files = [p for p in sorted(folder.glob("images/*/*.png")) if not p.name.startswith(".")]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def launch(source, data, out, nproc: int = 2) -> subprocess.Popen:
    command = [
        *LAUNCH,
        "-n",
        str(nproc),
        "-m",
        "evaluation.evaluate",
        str(source),
        "--data",
        str(data),
        "--out",
        str(out),
        *ARGS,
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_one_process_two_processes_and_a_killed_run_agree(tiny_checkpoint, shapes_mds, tmp_path):
    data = shapes_mds / "mds"
    # Two processes, killed once a batch of the first guidance scale is written, then rerun.
    killed = launch(tiny_checkpoint, data, tmp_path / "two")
    first_scale = tmp_path / "two/images/guidance-1"
    while len(list(first_scale.glob("*.png"))) < 15 and killed.poll() is None:
        time.sleep(0.01)  # 15 of 8 + 8 written at once: at least one batch complete
    assert killed.poll() is None, killed.stdout.read()[-3000:]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "two/metrics.json").exists(), "finished before the kill"
    assert killed.returncode == -signal.SIGKILL, killed.stdout.read()[-3000:]

    # One process, in-process, meanwhile.
    rows = evaluate.main([str(tiny_checkpoint), "--data", str(data), "--out", str(tmp_path / "one"), *ARGS])
    one = tmp_path / "one"
    assert json.loads((one / "metrics.json").read_text()) == rows
    assert [r["guidance"] for r in rows] == [1, 4] and all(list(r) == list(KEYS) for r in rows)
    assert all(r["n"] == 24 and r["fid"] > 0 and -1 <= r["clip_score"] <= 1 for r in rows)
    assert "| guidance | images | FID |" in (one / "metrics.md").read_text()
    for name in ("fid-vs-clip.png", "samples.png"):
        assert Image.open(one / name).format == "PNG"
    assert len(images(one)) == 48

    rerun = launch(tiny_checkpoint, data, tmp_path / "two")
    output = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, output[-3000:]
    generated, reused = map(int, evaluate_counts(output))
    assert reused >= 8 and generated >= 24 and generated + reused == 48, output[-2000:]
    assert images(tmp_path / "two") == images(one)  # bitwise, PNG by PNG
    # Same images, same features up to BLAS rounding (which varies between processes at ~1e-9).
    assert json.loads((tmp_path / "two/metrics.json").read_text()) == [
        pytest.approx(r, rel=1e-6) for r in rows
    ]

    # Other settings in the same folder are refused, not mixed in.
    with pytest.raises(SystemExit, match="steps differ"):
        evaluate.main([str(tiny_checkpoint), "--data", str(data), "--out", str(one), *ARGS, "--steps", "3"])


def evaluate_counts(output: str) -> tuple[str, str]:
    import re

    match = re.search(r"images: (\d+) generated, (\d+) reused", output)
    assert match, output[-3000:]
    return match.group(1), match.group(2)


def test_a_checkpoint_rewritten_at_the_same_path_is_another_source(tmp_path):
    checkpoint = tmp_path / "latest-rank0.pt"
    checkpoint.write_bytes(b"first run")
    folder = tmp_path / "images" / "guidance-4"
    settings = {"source": str(checkpoint), "source_version": evaluate.source_version(str(checkpoint))}
    evaluate.check_settings(folder, settings)
    evaluate.check_settings(folder, dict(settings))  # the same checkpoint: its images are reused
    checkpoint.write_bytes(b"a new training run")  # e.g. the demo retrained: same path, new weights
    changed = {**settings, "source_version": evaluate.source_version(str(checkpoint))}
    with pytest.raises(evaluate.SettingsChanged, match="source_version differ"):
        evaluate.check_settings(folder, changed)
