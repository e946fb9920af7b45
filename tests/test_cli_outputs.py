"""Where the commands write: one lock per output folder, nothing outside ``--out``, and nothing under
``results/`` unless ``--out`` names it.

* Every command that writes into a folder takes the same lock on it (``<folder>/.lock``), so while
  ``lm train`` runs in ``X`` every other command given ``--out X`` (an experiment, a ``--plot-only``
  redraw, an evaluation) is refused with one line naming ``X`` and the ``lm train`` holding it, and
  writes nothing there.
* ``lm eval RUN --out Y`` only reads ``RUN``: each run's evaluation is kept under ``Y``.
* The default ``--out`` of every command is under ``runs/<command>/`` (git-ignored), so the README's
  commands run from a clone leave the committed records under ``results/`` as they are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bayeslayer.cli import build_parser, main
from bayeslayer.training import OutputLock

from .experiments.corpus import write_word_corpus
from .model_folders import tiny_model, write_lm_run
from .test_cli import one_line_error
from .training.faults import Forked, hold_until_killed, single_thread

ROOT = Path(__file__).resolve().parents[1]

def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path → SHA-256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def lm_training(tmp_path):
    """A folder ``X`` that a live ``bayeslayer lm train`` process holds: ``(X, its pid)``.  The process is forked
    from the test's (``tests/training/faults.py``): it runs the command line's ``main`` and stops, holding the run
    folder's lock, just after taking it."""
    from bayeslayer.experiments.common import lm_run

    run = tmp_path / "X"
    corpus = write_word_corpus(tmp_path / "corpus", {"train": 4, "validation": 2, "test": 2}, sentences=4)
    argv = ["lm", "train", "--preset", "tiny", "--source", str(corpus), "--vocab-size", "300", "--steps", "4",
            "--device", "cpu", "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]

    def lm_train(say):
        def pause(run_dir):  # the first thing done with the lock held
            say("training")
            hold_until_killed()

        lm_run.remove_stale_temporaries = pause  # in the child only
        sys.argv = ["bayeslayer", *argv]
        main(argv)

    with single_thread():  # the child never inherits a busy OpenMP pool
        proc = Forked(lm_train)
    try:
        said = proc.readline()
        assert said == "training", f"lm train said {said!r} (its error is on stderr)"
        yield run, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _model_folder(path: Path) -> Path:
    """A tiny model folder with a word-level tokenizer, as ``niah`` and ``heldout`` load one."""
    import tokenizers

    tiny_model().save_pretrained(path)
    words = "the cat sat on a mat </s>".split()
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}},
                                                          unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (path / "tokenizer.json").write_text(tk.to_str())
    return path


def _finished_run(tmp_path: Path, name: str = "run") -> Path:
    """A finished ``lm train`` run of a tiny model on a small corpus in ``tmp_path``."""
    corpus = write_word_corpus(tmp_path / "corpus", {"train": 4, "validation": 2, "test": 2}, sentences=4)
    return write_lm_run(tiny_model(vocab_size=300), tmp_path / name, source=str(corpus), vocab_size=300)


# every command that writes into its --out, as it would be pointed at a folder in use; {x} is the folder
WRITERS = [
    ["collision", "--out", "{x}"],
    ["collision", "--plot-only", "--out", "{x}"],
    ["recall", "--preset", "tiny", "--out", "{x}"],
    ["recall", "--plot-only", "--out", "{x}"],
    ["crowding", "--preset", "tiny", "--out", "{x}"],
    ["mqar", "base", "--preset", "tiny", "--out", "{x}"],
    ["mqar", "--plot-only", "--out", "{x}"],
    ["variance", "--preset", "tiny", "--out", "{x}"],
    ["variance", "--plot-only", "--out", "{x}"],
    ["niah", "--model", "{model}", "--haystack", "{corpus}", "--device", "cpu", "--out", "{x}"],
    ["niah", "--plot-only", "--out", "{x}"],
    ["heldout", "--model", "{model}", "--source", "{corpus}", "--lengths", "16", "--device", "cpu", "--out", "{x}"],
    ["heldout", "--plot-only", "--out", "{x}"],
    ["lm", "eval", "{run}", "--device", "cpu", "--out", "{x}"],
    ["lm", "eval", "--plot-only", "--out", "{x}"],
    ["lm", "train", "--preset", "tiny", "--source", "{corpus}", "--device", "cpu", "--out", "{x}"],
]


def test_while_lm_train_runs_in_a_folder_every_other_writer_is_refused(tmp_path, lm_training, capsys):
    x, pid = lm_training
    run = _finished_run(tmp_path)
    places = {"x": str(x), "run": str(run), "model": str(_model_folder(tmp_path / "model")),
              "corpus": str(tmp_path / "corpus")}
    before = _files(x)
    capsys.readouterr()  # what writing the model folders said
    for argv in WRITERS:
        line = one_line_error([a.format(**places) for a in argv], capsys, f"{x} is in use by another run",
                              f"pid {pid} on ", "bayeslayer lm train --preset tiny")
        assert line.startswith(f"bayeslayer {argv[0]}"), line
    assert _files(x) == before == {".lock": before[".lock"]}  # nothing written beside lm train's lock


def test_distill_eval_is_refused_while_its_folder_is_in_use(tmp_path, capsys):
    """``distill eval --out D`` writes into ``D``: not while ``distill train`` (or anything) holds it."""
    d = tmp_path / "D"
    _model_folder(d / "phase_b" / "final")
    (d / "distill.json").write_text(json.dumps({"teacher_dir": str(d / "phase_b" / "final"), "stages": {}}))
    before = _files(d)
    capsys.readouterr()
    with OutputLock(d):
        one_line_error(["distill", "eval", "--out", str(d), "--skip-niah", "--device", "cpu"], capsys,
                       f"{d} is in use by another run")
    assert _files(d) == {**before, ".lock": hashlib.sha256(b"").hexdigest()}  # the released lock is empty
    assert not (d / "eval").exists()


def test_lm_eval_reads_the_runs_and_writes_only_under_out(tmp_path, capsys):
    run = _finished_run(tmp_path)
    before = _files(run)
    out = tmp_path / "Y"
    argv = ["lm", "eval", str(run), "--device", "cpu", "--seq-len", "16", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert _files(run) == before  # the run folder is only read: no eval-*.json, no lock file
    cached = out / "run" / "eval-test-L16-fp32.json"
    assert json.loads(cached.read_text())["groups"] == json.loads((out / "lm.json").read_text())[
        "models"]["BL"]["seeds"][0]["groups"]
    # the kept evaluation is reused: the same record again, without loading the corpus
    stamp = cached.stat().st_mtime_ns
    assert main(argv) == 0 and cached.stat().st_mtime_ns == stamp
    assert _files(run) == before


def test_lm_eval_refuses_two_runs_of_one_folder_name(tmp_path, capsys):
    a = _finished_run(tmp_path / "a")
    b = _finished_run(tmp_path / "b")
    one_line_error(["lm", "eval", str(a), str(b), "--out", str(tmp_path / "Y")], capsys,
                   "have the same folder name 'run'", "rename one")
    assert not (tmp_path / "Y").exists()


# ----------------------------------------------------------------------------- defaults


def _out_defaults(parser: argparse.ArgumentParser, words=()) -> dict[str, object]:
    """``{"lm eval": default of --out, ...}`` over every (sub)command that has ``--out``."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_out_defaults(sub, (*words, name)))
        elif "--out" in action.option_strings:
            found[" ".join(words)] = action.default
    return found


def test_every_default_out_is_under_runs_command():
    from bayeslayer.experiments.common.heldout_run import HeldoutConfig
    from bayeslayer.experiments.common.niah_run import NiahConfig
    from bayeslayer.experiments.variance import VarianceConfig

    defaults = _out_defaults(build_parser())
    assert {"collision", "recall", "crowding", "mqar", "niah", "heldout", "variance", "lm train", "lm eval",
            "distill train", "distill eval"} <= set(defaults)
    for command, default in defaults.items():
        if default is None:  # lm train, distill train: runs/lm/<run>, runs/distill/<preset>; distill eval: required
            continue
        assert Path(default).parts[:2] == ("runs", command.replace(" ", "-")), (command, default)
    assert [c.out for c in (NiahConfig(), HeldoutConfig(), VarianceConfig())] == [
        "runs/niah", "runs/heldout", "runs/variance"]
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_lm_eval_and_variance_with_default_out_leave_results_untouched(tmp_path, monkeypatch, capsys):
    """Run from a checkout as the README does (the working folder holds the committed ``results/``): the
    records stay as committed, ``git status results/`` is clean, and the outputs are under ``runs/``."""
    clone = tmp_path / "clone"
    for record in ("results/variance", "results/lm"):
        shutil.copytree(ROOT / record, clone / record, ignore=shutil.ignore_patterns("*-seed*"))
    shutil.copy(ROOT / ".gitignore", clone / ".gitignore")
    git = shutil.which("git") is not None
    if git:
        _git("init", "-q", cwd=clone)
        _git("add", "-A", cwd=clone)
        _git("commit", "-q", "-m", "the committed records", cwd=clone)
    before = _files(clone / "results")
    run = _finished_run(tmp_path)
    monkeypatch.chdir(clone)
    assert main(["variance", "--preset", "tiny"]) == 0, capsys.readouterr().err
    assert main(["lm", "eval", str(run), "--device", "cpu", "--seq-len", "16",
                 "--cache-dir", str(tmp_path / "cache")]) == 0, capsys.readouterr().err
    assert _files(clone / "results") == before
    assert (clone / "runs" / "variance" / "variance.json").is_file()
    assert (clone / "runs" / "lm-eval" / "lm.json").is_file()
    assert (clone / "runs" / "lm-eval" / "run" / "eval-test-L16-fp32.json").is_file()
    if git:
        assert _git("status", "--porcelain", "--untracked-files=all", cwd=clone) == ""  # runs/ is ignored too
