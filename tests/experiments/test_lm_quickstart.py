"""The README's language-model quick start works on a machine without Debian's python3-doc.

``lm train --preset tiny`` reads the python-docstrings corpus by default; here the standard library
is stood in for by a few real modules (the full one takes a minute to tokenize on a busy 2-core
machine: the slow test runs it) and python3-doc's folders are hidden.
"""

from __future__ import annotations

import shutil

import pytest

from bayeslayer.cli import main
from bayeslayer.data.text import sources
from bayeslayer.experiments.lm import PRESETS


@pytest.fixture
def no_debian_docs(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "PYTHON_DOCS_DIRS", (str(tmp_path / "no-doc" / "html"),))
    monkeypatch.setattr(sources, "PYTHON_DOCS_GLOB", str(tmp_path / "no-doc" / "python3.*" / "html"))
    assert sources.python_docs_dir() is None


@pytest.fixture
def small_stdlib(monkeypatch, tmp_path):
    """Sixty modules of the real standard library, in a folder that stands for it."""
    root = tmp_path / "stdlib"
    root.mkdir()
    real = sources.stdlib_root()
    for name in sorted(p.name for p in real.glob("*.py"))[:60]:
        shutil.copy(real / name, root / name)
    monkeypatch.setattr(sources, "stdlib_root", lambda: root)
    return root


def test_the_tiny_preset_reads_the_corpus_every_python_has():
    assert PRESETS["tiny"].source == sources.PYTHON_DOCSTRINGS


@pytest.mark.slow  # ~30 s on an idle 2-core machine (tokenizer, model, final evaluation); 200 s at load 14
def test_lm_train_tiny_without_debian_docs_and_without_source(no_debian_docs, small_stdlib, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["lm", "train", "--preset", "tiny", "--steps", "3", "--eval-every", "3", "--checkpoint-every", "3",
            "--vocab-size", "512", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert (out / "final" / "model.safetensors").is_file()
    assert "finished" in capsys.readouterr().out


def test_a_failed_start_leaves_no_folder(no_debian_docs, tmp_path, monkeypatch, capsys):
    """python-docs asked for and missing: one line naming the way out, and neither --out nor runs/ left behind."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "a" / "run"
    assert main(["lm", "train", "--preset", "tiny", "--source", "python-docs", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--no-progress"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "python3-doc" in line
    assert not (tmp_path / "a").exists()
    assert main(["lm", "train", "--preset", "tiny", "--source", "python-docs", "--cache-dir", str(tmp_path / "cache"),
                 "--no-progress"]) == 2  # the default folder, runs/lm/tiny-bayesian-seed0
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_lm_train_tiny_on_the_whole_standard_library(no_debian_docs, tmp_path):
    out = tmp_path / "run"
    assert main(["lm", "train", "--preset", "tiny", "--steps", "3", "--out", str(out), "--cache-dir",
                 str(tmp_path / "cache"), "--no-progress"]) == 0
    assert (out / "final" / "model.safetensors").is_file()
