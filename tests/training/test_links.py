"""No file the package writes in a user's folder is written through a link: the lock, appends,
atomic writes, published folders and figures refuse a symbolic link (or a FIFO, a folder) at their
path, name it, and leave the link's target unchanged.  Failed safetensors writes are ``OSError``s
naming the file."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from bayeslayer.files import (
    UnsafeFileError,
    append_text,
    atomic_write_json,
    atomic_write_text,
    check_writable_file,
    open_regular,
    publish_directory,
)
from bayeslayer.training import OutputLock
from bayeslayer.training.state import read_safetensors, write_safetensors

TARGET_TEXT = "precious contents\n"


@pytest.fixture
def target(tmp_path):
    """A file the user can write, outside the output folder: what a planted link points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(TARGET_TEXT)
    return path


def _link(path, target):
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return path


def test_a_symlinked_lock_is_refused_and_its_target_kept(tmp_path, target):
    run = tmp_path / "run"
    _link(run / ".lock", target)
    with pytest.raises(UnsafeFileError, match=r"\.lock is a symbolic link"):
        OutputLock(run).acquire()
    assert target.read_text() == TARGET_TEXT
    assert os.path.islink(run / ".lock")


def test_a_dangling_lock_link_creates_nothing(tmp_path):
    run = tmp_path / "run"
    _link(run / ".lock", tmp_path / "would-be-created")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        OutputLock(run).acquire()
    assert not (tmp_path / "would-be-created").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    if kind == "fifo":
        os.mkfifo(run / ".lock")
    else:
        (run / ".lock").mkdir()
    with pytest.raises(UnsafeFileError, match="a FIFO" if kind == "fifo" else "a folder"):
        OutputLock(run).acquire()


def test_the_lock_still_works_on_a_regular_file(tmp_path):
    with OutputLock(tmp_path / "run") as lock:
        assert lock.held and (tmp_path / "run" / ".lock").is_file()


def test_atomic_writes_refuse_a_link_and_keep_its_target(tmp_path, target):
    link = _link(tmp_path / "out" / "results.json", target)
    for write in (lambda: atomic_write_json(link, {"a": 1}), lambda: atomic_write_text(link, "x")):
        with pytest.raises(UnsafeFileError, match="results.json is a symbolic link"):
            write()
    assert target.read_text() == TARGET_TEXT and os.path.islink(link)
    assert [p.name for p in link.parent.iterdir()] == ["results.json"]  # no temporary file left


def test_appends_refuse_a_link_and_a_fifo(tmp_path, target):
    link = _link(tmp_path / "run" / "log.jsonl", target)
    with pytest.raises(UnsafeFileError, match="log.jsonl is a symbolic link"):
        with append_text(link) as fh:
            fh.write("{}\n")
    assert target.read_text() == TARGET_TEXT
    fifo = tmp_path / "run" / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFileError, match="pipe is a FIFO"):
        open_regular(fifo, os.O_WRONLY | os.O_APPEND)
    plain = tmp_path / "run" / "plain.jsonl"
    with append_text(plain) as fh:
        fh.write("a\n")
    with append_text(plain) as fh:
        fh.write("b\n")
    assert plain.read_text() == "a\nb\n"


def test_check_writable_file(tmp_path, target):
    assert check_writable_file(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "plain").write_text("x")
    check_writable_file(tmp_path / "plain")
    with pytest.raises(UnsafeFileError, match="is a folder"):
        check_writable_file(tmp_path)


def test_publish_directory_refuses_a_link_in_place_of_the_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept")
    final = _link(tmp_path / "run" / "final", elsewhere)
    with pytest.raises(UnsafeFileError, match="final is a symbolic link"):
        publish_directory(final, lambda tmp: (tmp / "a.txt").write_text("new"))
    assert (elsewhere / "keep.txt").read_text() == "kept" and os.path.islink(final)


def test_figures_refuse_a_link(tmp_path, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bayeslayer.experiments.common.plotting import save_figure

    link = _link(tmp_path / "out" / "plot.png", target)
    fig, _ = plt.subplots()
    try:
        with pytest.raises(UnsafeFileError, match="plot.png is a symbolic link"):
            save_figure(fig, link)
        assert save_figure(fig, tmp_path / "out" / "real.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        plt.close(fig)
    assert target.read_text() == TARGET_TEXT


def test_a_full_disk_during_a_safetensors_write_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(safetensors.torch, "save_model", full)
    path = tmp_path / "ckpt" / "model.safetensors"
    for call in (lambda: write_safetensors(path, {"a": torch.zeros(2)}),
                 lambda: write_safetensors(path, model=torch.nn.Linear(2, 2))):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
        assert "No space left on device" in str(info.value) and str(path) in str(info.value)


def test_a_damaged_safetensors_file_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": torch.arange(4.0)})
    assert torch.equal(read_safetensors(path)["a"], torch.arange(4.0))
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match=f"{path} is damaged or not a safetensors file"):
        read_safetensors(path)


def test_an_unused_lock_removes_the_folders_it_made_and_nothing_else(tmp_path):
    out = tmp_path / "a" / "b"
    with OutputLock(out, remove_if_unused=True):
        assert (out / ".lock").is_file()
    assert not (tmp_path / "a").exists()  # the folder and the parent made for it
    with OutputLock(out, remove_if_unused=True):
        (out / "result.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "result.json"]
    existing = tmp_path / "existing"
    existing.mkdir()
    with OutputLock(existing, remove_if_unused=True):
        pass
    assert existing.is_dir()  # not made by the lock: kept


def test_a_lock_on_a_file_that_lost_its_name_is_not_held(tmp_path, monkeypatch):
    """A process that opened .lock just before the holder removed it must not think it holds the folder."""
    from bayeslayer.training import lock as lock_module

    out = tmp_path / "o"
    calls = []
    real = lock_module.OutputLock._still_named

    def first_time_stale(self, fd):
        calls.append(fd)
        return False if len(calls) == 1 else real(self, fd)

    monkeypatch.setattr(lock_module.OutputLock, "_still_named", first_time_stale)
    with OutputLock(out) as held:
        assert held.held and len(calls) == 2
