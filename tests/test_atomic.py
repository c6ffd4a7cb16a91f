"""common/atomic.py: the one write-beside-then-rename helper that checkpoints, exports, datasets,
the `latest` link and the converter's markers all go through."""

import os

import pytest

from common.atomic import atomic_path, atomic_write_bytes, temporary_sibling
from convert.storage import LocalStore


class Boom(Exception):
    pass


def test_a_file_is_replaced_whole_and_nothing_else_is_left(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    atomic_write_bytes(tmp_path / "sub" / "made.bin", b"x")  # a missing parent folder is made
    assert (tmp_path / "sub" / "made.bin").read_bytes() == b"x"


def test_the_temporary_is_a_hidden_sibling_that_keeps_the_suffix(tmp_path):
    target = tmp_path / "ep1-ba2-rank0.pt.tar"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path  # same folder: the rename cannot cross filesystems
        assert tmp.name.startswith(".") and str(os.getpid()) in tmp.name
        assert tmp.name.endswith(target.name)  # composer picks a checkpoint's format by its name
        assert not tmp.exists()
        tmp.write_text("done")
    assert target.read_text() == "done"
    assert tmp == temporary_sibling(target)


def test_an_error_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_text("old")
    with pytest.raises(Boom), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise Boom
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_stale_temporary_of_this_pid_is_cleared_first(tmp_path):
    target = tmp_path / "data"
    stale = temporary_sibling(target)
    (stale / "junk").mkdir(parents=True)
    with atomic_path(target) as tmp:
        assert not tmp.exists()
        tmp.mkdir()
        (tmp / "index.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["index.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_a_symlink_is_swung_atomically(tmp_path):
    (tmp_path / "a.pt").write_text("a")
    (tmp_path / "b.pt").write_text("b")
    latest = tmp_path / "latest.pt"
    latest.symlink_to("a.pt")
    with atomic_path(latest) as tmp:
        tmp.symlink_to("b.pt")
    assert latest.is_symlink() and latest.read_text() == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt", "latest.pt"]


def _folder(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)


def test_a_folder_lands_whole_or_not_at_all(tmp_path):
    target = tmp_path / "mds"
    with pytest.raises(Boom), atomic_path(target) as tmp:
        _folder(tmp, shard="half")
        raise Boom
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        _folder(tmp, shard="0", index="{}")
    assert sorted(p.name for p in target.iterdir()) == ["index", "shard"]
    assert [p.name for p in tmp_path.iterdir()] == ["mds"]


def test_replace_refuses_a_full_folder_and_leaves_it_alone(tmp_path):
    target = tmp_path / "out"
    _folder(target, index="old")
    with pytest.raises(OSError), atomic_path(target) as tmp:
        _folder(tmp, index="new")
    assert (target / "index").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_swap_replaces_an_old_folder_and_an_error_keeps_it(tmp_path):
    target = tmp_path / "export"
    _folder(target, vae="old", stale="x")
    with pytest.raises(Boom), atomic_path(target, existing="swap") as tmp:
        _folder(tmp, vae="half")
        raise Boom
    assert sorted(p.name for p in target.iterdir()) == ["stale", "vae"]
    with atomic_path(target, existing="swap") as tmp:
        _folder(tmp, vae="new")
    assert [p.name for p in target.iterdir()] == ["vae"] and (target / "vae").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # neither the old one nor a temporary


def test_keep_lets_a_concurrent_writer_win(tmp_path):
    target = tmp_path / "shapes"
    with atomic_path(target, existing="keep") as tmp:
        _folder(tmp, index="mine")
        _folder(target, index="theirs")  # another rank renamed its copy into place meanwhile
    assert (target / "index").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["shapes"]
    # Without "keep" the same race is an error, and still leaves nothing behind.
    other = tmp_path / "other"
    with pytest.raises(OSError), atomic_path(other) as tmp:
        _folder(tmp, index="mine")
        _folder(other, index="theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "shapes"]


def test_local_store_writes_atomically_and_lists_no_temporaries(tmp_path):
    store = LocalStore(str(tmp_path))
    store.write_bytes("markers/part-0.json", b"{}")
    (tmp_path / "markers" / temporary_sibling("part-1.json").name).write_text("torn")  # a killed write
    assert store.list_names("markers", ".json") == ["part-0"]
    assert store.read_json("markers/part-0.json") == {}
