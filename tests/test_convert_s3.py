"""`--out s3://...` against a real S3-compatible server (SeaweedFS on 127.0.0.1)."""

import json

import pytest

from convert.storage import S3Store
from tests.convert_fixtures import make_i2d_tars, read_mds, run_cli
from tests.s3_server import BUCKET, free_ports, s3_server  # noqa: F401  (s3_server is a fixture)


@pytest.fixture
def s3_env(s3_server, monkeypatch):  # noqa: F811
    for name in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, s3_server.env()[name])
    return s3_server


def keys_under(server, prefix: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(obj["Key"][len(prefix) :] for obj in listing.get("Contents", []))


def test_round_trip_through_s3(s3_env, tmp_path):
    src, out, work = tmp_path / "shards", f"s3://{BUCKET}/round/trip", tmp_path / "work"
    expected = make_i2d_tars(src, shards=3, per_shard=4)
    argv = ["img2dataset", "--src", src, "--out", out, "--work-dir", work, "--buckets", "0.75,1.5"]
    assert run_cli(*argv) == 0

    rows = read_mds(tmp_path / "cache", remote=out)
    assert [r["key"] for r in rows] == sorted(expected)
    for row in rows:
        assert (row["image"], row["caption"]) == expected[row["key"]]
    assert len(read_mds(tmp_path / "cache-ar1.5", remote=f"{out}/ar1.5")) == 12  # 48x32 photos: all in ar1.5
    stored = keys_under(s3_env, "round/trip/")
    assert {"index.json", "ar1.5/index.json", "convert-report.json", "_done/00000.json"} <= set(stored)
    assert "ar1.5/00002/shard.00000.mds" in stored
    assert not work.exists()  # staging uploaded and cleaned up

    assert run_cli(*argv) == 0  # a rerun finds every input finished, on S3
    report = json.loads(
        s3_env.client().get_object(Bucket=BUCKET, Key="round/trip/convert-report.json")["Body"].read()
    )
    assert (report["inputs_done"], report["inputs_done_this_run"], report["samples_written"]) == (3, 0, 12)


def fatal_line(capsys, *argv) -> str:
    assert run_cli(*argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sd-convert: error: "), lines
    return lines[0]


def test_bad_credentials_missing_bucket_and_unreachable_endpoint(s3_env, tmp_path, monkeypatch, capsys):
    src = tmp_path / "shards"
    make_i2d_tars(src, shards=1, per_shard=2)
    argv = ["img2dataset", "--src", src, "--work-dir", tmp_path / "work"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    line = fatal_line(capsys, *argv, "--out", f"s3://{BUCKET}/denied")
    assert "refused the credentials" in line and s3_env.endpoint in line and f"s3://{BUCKET}/denied" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.env()["AWS_SECRET_ACCESS_KEY"])
    line = fatal_line(capsys, *argv, "--out", "s3://no-such-bucket/x")
    assert "bucket 'no-such-bucket' does not exist" in line
    closed = f"http://127.0.0.1:{free_ports(1)[0]}"
    monkeypatch.setenv("S3_ENDPOINT_URL", closed)
    line = fatal_line(capsys, *argv, "--out", f"s3://{BUCKET}/x")
    assert f"cannot reach S3 endpoint {closed}" in line


@pytest.mark.slow
def test_server_stopped_mid_upload_then_restarted(s3_env, tmp_path, monkeypatch, capsys):
    src, out, work = tmp_path / "shards", f"s3://{BUCKET}/interrupted", tmp_path / "work"
    expected = make_i2d_tars(src, shards=5, per_shard=3)
    argv = ["img2dataset", "--src", src, "--out", out, "--work-dir", work]
    uploads, upload = [], S3Store.write_file

    def stop_server_midway(self, rel, path):
        uploads.append(rel)
        if len(uploads) == 4:  # input 00000 is uploaded, 00001's shard too, its index.json is next
            s3_env.kill()
        return upload(self, rel, path)

    monkeypatch.setattr(S3Store, "write_file", stop_server_midway)
    line = fatal_line(capsys, *argv)
    assert (
        f"uploading {out}/00001/index.json" in line and f"cannot reach S3 endpoint {s3_env.endpoint}" in line
    )
    monkeypatch.undo()
    s3_env.start()  # the same data folder: what was uploaded before the stop is still there
    for name in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, s3_env.env()[name])
    assert keys_under(s3_env, "interrupted/_done/") == ["00000.json"]
    assert keys_under(s3_env, "interrupted/00001/") == ["shard.00000.mds"]  # half an input, no marker

    assert run_cli(*argv) == 0
    report = json.loads(
        s3_env.client().get_object(Bucket=BUCKET, Key="interrupted/convert-report.json")["Body"].read()
    )
    assert (report["inputs_done"], report["inputs_done_this_run"], report["complete"]) == (5, 4, True)
    rows = read_mds(tmp_path / "cache", remote=out)
    assert [(r["key"], r["image"], r["caption"]) for r in rows] == [
        (k, *v) for k, v in sorted(expected.items())
    ]


def test_one_conversion_per_prefix(s3_env, tmp_path, capsys):
    a, b, work = tmp_path / "a", tmp_path / "b", tmp_path / "work"
    first, second = make_i2d_tars(a, shards=2, per_shard=3), make_i2d_tars(b, shards=1, per_shard=2)
    out = f"s3://{BUCKET}/one"
    client = s3_env.client()
    client.put_object(Bucket=BUCKET, Key="one-more/notes.txt", Body=b"a sibling prefix, not under one/")
    assert run_cli("img2dataset", "--src", a, "--out", out, "--work-dir", work) == 0

    line = fatal_line(capsys, "img2dataset", "--src", b, "--out", out, "--work-dir", work)
    assert f"img2dataset --src {a} --format auto" in line and f"img2dataset --src {b} --format auto" in line
    assert "--overwrite" in line
    assert [r["key"] for r in read_mds(tmp_path / "cache-a", remote=out)] == sorted(first)

    client.put_object(Bucket=BUCKET, Key="one/README", Body=b"the user's own file")
    assert run_cli("img2dataset", "--src", b, "--out", out, "--work-dir", work, "--overwrite") == 0
    assert [r["key"] for r in read_mds(tmp_path / "cache-b", remote=out)] == sorted(second)
    assert keys_under(s3_env, "one/") == [
        "00000/index.json", "00000/shard.00000.mds", "README", "_done/00000.json", "convert-report.json",
        "index.json", "sd-convert.json",
    ]  # fmt: skip

    client.put_object(Bucket=BUCKET, Key="other/photo.jpg", Body=b"not ours")
    line = fatal_line(capsys, "img2dataset", "--src", a, "--out", f"s3://{BUCKET}/other", "--work-dir", work)
    assert f"--out s3://{BUCKET}/other holds files that sd-convert did not write (photo.jpg)" in line
