"""The one results writer: every record carries where it came from (commit, command, versions, device, ...)."""

import json
import sys
from pathlib import Path

import pytest

import bayeslayer
from bayeslayer.experiments.common import provenance as prov
from bayeslayer.experiments.crowding import PRESETS, CrowdingConfig, run
from bayeslayer.training.optim import DECAY_POLICY


def test_provenance_fields_and_values():
    p = prov.provenance(device="cpu", seeds=(0, 1), wall_seconds=2.5, optimizer_groups=DECAY_POLICY,
                        command=["bayeslayer", "recall"])
    assert tuple(p)[:len(prov.FIELDS)] == prov.FIELDS and set(p) - set(prov.FIELDS) <= {"record_notes"}
    assert p["command"] == ["bayeslayer", "recall"] and p["seeds"] == [0, 1] and p["wall_seconds"] == 2.5
    assert p["optimizer_groups"] == DECAY_POLICY and p["backfilled"] is False
    assert set(p["versions"]) == {"python", *prov.PACKAGES} and p["versions"]["torch"]
    assert p["device"] == "cpu" and p["gpu"] is None and p["threads"] >= 1
    assert prov.provenance()["command"] == prov._command(sys.argv)
    assert prov.provenance()["wall_seconds"] is None or prov.provenance()["wall_seconds"] >= 0


@pytest.mark.parametrize("kwargs, match", [
    ({"device": ""}, "device"), ({"wall_seconds": -1.0}, "wall_seconds"),
    ({"wall_seconds": float("nan")}, "wall_seconds"),
    ({"optimizer_groups": 3}, "optimizer_groups"),
])
def test_provenance_rejects_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        prov.provenance(**kwargs)


def test_the_default_checkout_is_the_one_holding_the_package():
    """Without ``root``, the commit is read from the checkout the package was imported from (a record
    written from a git checkout carries its commit)."""
    root = Path(bayeslayer.__file__).resolve().parents[1]
    assert prov._PACKAGE_ROOT == root
    if (root / ".git").exists():
        assert prov.git_commit() is not None and prov.git_commit() == prov.git_commit(root)


def test_the_command_names_a_program_in_the_checkout_relative_to_it():
    cli = str(prov._PACKAGE_ROOT / "bayeslayer" / "cli.py")
    assert prov.provenance(command=[cli, "mqar", "--out", "/abs/out"])["command"] == [
        "bayeslayer/cli.py", "mqar", "--out", "/abs/out"]  # only the program is rewritten
    assert prov.provenance(command=["/usr/bin/tool", "x"])["command"] == ["/usr/bin/tool", "x"]
    assert prov.provenance(command=["-c"])["command"] == ["-c"]
    inside = str(prov._PACKAGE_ROOT / "results" / "x")  # a path argument inside the checkout, either spelling
    assert prov.provenance(command=[cli, "recall", "--out", inside, f"--cache-dir={inside}"])["command"] == [
        "bayeslayer/cli.py", "recall", "--out", "results/x", "--cache-dir=results/x"]


def test_a_record_without_a_commit_or_from_a_dirty_checkout_says_so(monkeypatch):
    monkeypatch.setattr(prov, "git_commit", lambda root=None: None)
    monkeypatch.setattr(prov, "git_dirty", lambda root=None: None)
    assert "not imported from a git checkout" in prov.provenance()["record_notes"][0]
    monkeypatch.setattr(prov, "git_commit", lambda root=None: "a" * 40)
    monkeypatch.setattr(prov, "git_dirty", lambda root=None: True)
    assert "uncommitted changes on commit " + "a" * 40 in prov.provenance()["record_notes"][0]
    monkeypatch.setattr(prov, "git_dirty", lambda root=None: False)
    assert "record_notes" not in prov.provenance()


def test_git_commit_reads_files_of_a_checkout(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert prov.git_commit(tmp_path) is None and prov.git_dirty(tmp_path) is None  # not a checkout
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    assert prov.git_commit(tmp_path) is None  # a branch without a commit
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert prov.git_commit(tmp_path) == sha
    (git / "refs" / "heads" / "main").write_text(sha.replace("0", "f") + "\n")
    assert prov.git_commit(tmp_path) == sha.replace("0", "f")  # a loose ref wins over packed-refs
    (git / "HEAD").write_text(sha + "\n")  # detached
    assert prov.git_commit(tmp_path) == sha
    (git / "HEAD").write_text("not a commit\n")
    assert prov.git_commit(tmp_path) is None


def test_write_record_adds_provenance_and_replaces_an_old_one(tmp_path):
    assert prov.jsonable({1: (2, 3)}) == {"1": [2, 3]}
    path = prov.write_record(tmp_path / "sub" / "r.json", {"x": 1, "provenance": {"old": True}}, seeds=[3])
    saved = json.loads(path.read_text())
    assert saved["x"] == 1 and prov.missing_fields(saved) == [] and saved["provenance"]["seeds"] == [3]
    assert "old" not in saved["provenance"]
    assert prov.missing_fields({"x": 1}) == list(prov.FIELDS)
    with pytest.raises(TypeError, match="record"):
        prov.write_record(tmp_path / "r.json", [1, 2])
    with pytest.raises(ValueError):
        prov.write_record(tmp_path / "nan.json", {"x": float("nan")}, allow_nan=False)


def test_a_tiny_experiment_writes_every_field(tmp_path):
    """A real run (crowding, tiny preset, one model) writes its results JSON through the one writer."""
    from dataclasses import replace

    preset = replace(PRESETS["tiny"], steps=2, eval_sequences=4)  # the tiny preset, shorter still
    run(CrowdingConfig(preset=preset, models=("delta",), out=str(tmp_path), progress=False))
    saved = json.loads((tmp_path / "crowding.json").read_text())
    assert prov.missing_fields(saved) == []
    p = saved["provenance"]
    assert p["command"] == prov._command(sys.argv) and p["seeds"] == [0] and p["optimizer_groups"] == DECAY_POLICY
    assert p["wall_seconds"] > 0 and p["device"] == "cpu" and p["backfilled"] is False
    assert p["versions"]["python"] and (p["cpu_model"] is None or isinstance(p["cpu_model"], str))


def _git(repo, *args):
    import subprocess

    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin:/usr/local/bin", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def test_git_dirty_reads_the_index_like_git_status(tmp_path):
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    (repo / "b.txt").write_text("two\n")
    _git(repo, "add", "a.txt", "b.txt")
    _git(repo, "commit", "-qm", "first")
    assert prov.git_commit(repo) == _git(repo, "rev-parse", "HEAD")
    assert prov.git_dirty(repo) is False
    (repo / "untracked.txt").write_text("not tracked\n")
    assert prov.git_dirty(repo) is False  # like `git status --untracked-files=no`
    (repo / "a.txt").write_text("changed\n")
    assert prov.git_dirty(repo) is True
    _git(repo, "add", "a.txt")  # staged, not committed: never reported clean
    assert prov.git_dirty(repo) is not False
    _git(repo, "commit", "-qm", "second")
    _git(repo, "gc", "-q")  # the commit now lives in a pack
    assert prov.git_commit(repo) == _git(repo, "rev-parse", "HEAD")
    assert prov.git_dirty(repo) is False
    (repo / "b.txt").unlink()
    assert prov.git_dirty(repo) is True
    (repo / "b.txt").mkdir()  # a folder where the tracked file was
    assert prov.git_dirty(repo) is True
    (repo / "b.txt").rmdir()
    (repo / "c.txt").write_text("two\n")
    (repo / "b.txt").symlink_to("c.txt")  # a link where the file was, to the same bytes
    assert prov.git_dirty(repo) is True
    (repo / "b.txt").unlink()
    (repo / "b.txt").write_text("two\n")
    assert prov.git_dirty(repo) is False


def test_every_committed_record_carries_provenance():
    """Every JSON under results/ has the provenance keys; a backfilled one says so and names its commits."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "results"
    paths = sorted(root.rglob("*.json"))
    assert len(paths) >= 57
    for path in paths:
        record = json.loads(path.read_text())
        assert prov.missing_fields(record) == [], f"{path} lacks provenance fields {prov.missing_fields(record)}"
        p = record["provenance"]
        assert set(p["versions"]) == {"python", *prov.PACKAGES}, path
        if p["backfilled"]:
            assert len(p["record_added_in"]) == 40 and len(p["record_last_changed_in"]) == 40, path
            assert p["git_commit"] is None and p["backfill_notes"], path  # the code's commit was never recorded
        else:
            assert p["versions"]["python"] and p["versions"]["torch"] and p["command"], path
            # a record without a commit, or from a dirty checkout, says why in the record
            if p["git_commit"] is None:
                assert any("git_commit" in note for note in p.get("record_notes", ())), path
            if p["git_dirty"]:
                assert any("git_dirty" in note for note in p.get("record_notes", ())), path
        assert _absolute_paths(record) == [], path  # no folder of the machine that wrote it


def _absolute_paths(obj) -> list[str]:
    """The absolute paths (``/x...``, alone or after a space, ``=`` or a quote) in the strings of ``obj``."""
    import re

    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _absolute_paths(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _absolute_paths(v)]
    return re.findall(r"""(?:^|[\s=('"])(/[A-Za-z][^\s,;)'"]*)""", obj) if isinstance(obj, str) else []


def test_the_absolute_path_check_sees_one():
    assert _absolute_paths({"provenance": {"command": ["bayeslayer/cli.py", "--out", "/tmp/x"]}}) == ["/tmp/x"]
    assert _absolute_paths(["--notes=/home/u/n.json", "a/b", "x /work/y z"]) == ["/home/u/n.json", "/work/y"]
    assert _absolute_paths({"how": "pytest -q -n 2 (two workers); 1/2 of the time"}) == []
