"""recipes/resume.py: which checkpoint a rerun with a remote save_folder resumes from (the listing
against the SeaweedFS test server; the whole kill-and-restart path is in test_resume_s3.py)."""

import pytest

from recipes.resume import SAVE_FILENAME, checkpoint_pattern, newest_checkpoint, remote_autoresume
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)


def test_the_pattern_matches_rank_zeros_checkpoints_and_reads_their_batch():
    default = checkpoint_pattern(SAVE_FILENAME, "run")
    assert default.match("ep3-ba120-rank0.pt")["batch"] == "120"
    for other in (
        "ep3-ba120-rank1.pt",
        "ep3-ba120-rank0.pt.tmp",
        "latest-rank0.pt",
        "samples/ep1-ba2-rank0.pt",
    ):
        assert default.match(other) is None, other
    named = checkpoint_pattern("{run_name}/ba{batch}-{sample}.pt", "sd2.base")
    assert named.match("sd2.base/ba7-896.pt")["batch"] == "7"
    assert named.match("sd2xbase/ba7-896.pt") is None  # the run name is literal, not a regex
    assert checkpoint_pattern("ep{epoch}.pt", "run") is None  # no batch: cannot be ordered


@pytest.fixture
def bucket(s3_server, monkeypatch):  # noqa: F811
    for name in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, s3_server.env()[name])
    client = s3_server.client()

    def put(*keys):
        for key in keys:
            client.put_object(Bucket=BUCKET, Key=key, Body=b"x")

    return put


def test_the_newest_checkpoint_is_the_one_with_most_batches(bucket, tmp_path):
    prefix = f"newest-{tmp_path.name}"
    folder = f"s3://{BUCKET}/{prefix}/ckpt"
    assert newest_checkpoint(folder, SAVE_FILENAME, "run") is None
    bucket(
        *(f"{prefix}/ckpt/ep{b // 4}-ba{b}-rank0.pt" for b in (9, 40, 100)),  # 100 > 40 > 9, not as text
        f"{prefix}/ckpt/ep9-ba999-rank1.pt",  # another rank's file
        f"{prefix}/ckpt/latest-rank0.pt.symlink",
        f"{prefix}/ckpt/samples/ep9-ba500-rank0.pt",  # in a subfolder
        f"{prefix}/ckpt-other/ep9-ba700-rank0.pt",  # a sibling folder with the same prefix
    )
    assert newest_checkpoint(folder, SAVE_FILENAME, "run") == f"{folder}/ep25-ba100-rank0.pt"
    assert newest_checkpoint(f"{folder}/", SAVE_FILENAME, "run") == f"{folder}/ep25-ba100-rank0.pt"


def test_a_remote_folder_loads_the_newest_checkpoint_whole(bucket, tmp_path):
    folder = f"s3://{BUCKET}/whole-{tmp_path.name}/{{run_name}}"
    first_stage = {
        "load_path": "s3://bucket/stage1.pt",
        "load_weights_only": True,
        "load_ignore_keys": ["state/optimizers"],
    }
    trainer = {"save_folder": folder, "autoresume": True, **first_stage}
    # No checkpoint yet: the run starts from its own load_path, without Composer's autoresume.
    assert remote_autoresume(trainer, "sd") == {**trainer, "autoresume": False}
    bucket(f"whole-{tmp_path.name}/sd/ep0-ba5-rank0.pt")
    assert remote_autoresume(trainer, "sd") == {
        "save_folder": folder,
        "autoresume": False,
        "load_path": f"s3://{BUCKET}/whole-{tmp_path.name}/sd/ep0-ba5-rank0.pt",
        "load_weights_only": False,
        "load_ignore_keys": None,
        "load_exclude_algorithms": None,
    }


@pytest.mark.parametrize(
    "trainer",
    [
        {"save_folder": "runs/local", "autoresume": True},
        {"save_folder": "s3://b/p", "autoresume": False},
        {"save_folder": None, "autoresume": True},
        {"save_folder": "s3://b/p", "autoresume": True, "save_filename": "ep{epoch}.pt"},
    ],
)
def test_other_runs_keep_composers_autoresume(trainer):
    assert remote_autoresume(trainer, "run") is trainer  # nothing listed: no server is needed
