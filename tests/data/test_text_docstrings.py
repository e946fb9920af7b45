"""The python-docstrings corpus: the standard library's docstrings, read with ast and never run."""

from __future__ import annotations

import pytest

from bayeslayer.data.text import (
    NAMED_SOURCES,
    PYTHON_DOCSTRINGS,
    SPLITS,
    corpus_files,
    python_docstrings_files,
    stdlib_docstrings,
    stdlib_root,
)
from bayeslayer.data.text.sources import CorpusNotFoundError


def test_docstrings_in_source_order_and_no_code_runs(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text('"""Module doc."""\nraise SystemExit("ran")\n\nclass A:\n    """Class doc."""\n\n'
                   '    def f(self):\n        """Method doc."""\n\n\ndef g():\n    """Function doc."""\n'
                   '\n\ndef h():\n    return 1\n')
    assert stdlib_docstrings(src) == "Module doc.\n\nClass doc.\n\nMethod doc.\n\nFunction doc.\n"
    (tmp_path / "broken.py").write_text("def (:\n")
    assert stdlib_docstrings(tmp_path / "broken.py") == ""


def _library(root, n=40):
    for i in range(n):
        (root / f"m{i:02d}.py").write_text(f'"""Module number {i} explains things."""\n')
    for skipped in ("test", "site-packages"):
        (root / skipped).mkdir()
        (root / skipped / "t.py").write_text('"""Not part of the corpus."""\n')


def test_the_corpus_is_deterministic_and_leaves_tests_out(tmp_path):
    _library(tmp_path)
    a, b = python_docstrings_files(tmp_path), python_docstrings_files(tmp_path)
    names = {s: [d.name for d in a.splits[s]] for s in SPLITS}
    assert names == {s: [d.name for d in b.splits[s]] for s in SPLITS}
    every = sorted(n for s in SPLITS for n in names[s])
    assert every == [f"m{i:02d}.py" for i in range(40)]  # test/ and site-packages/ are not read
    assert a.fingerprint == b.fingerprint and a.fingerprint["kind"] == PYTHON_DOCSTRINGS
    doc = next(d for s in SPLITS for d in a.splits[s] if d.name == "m07.py")
    assert doc.read() == "Module number 7 explains things.\n"


def test_folders_left_out_at_any_depth_and_only_python_files(tmp_path):
    for name in ("pkg/a.py", "pkg/sub/b.py", "pkg/tests/c.py", "pkg/sub/idle_test/d.py", "pkg/__pycache__/e.py",
                 "z.py", "notes.txt", "pkg/f.pyc"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('"""Doc."""\n')
    (tmp_path / "folder.py").mkdir()  # a folder named like a module is no document
    files = python_docstrings_files(tmp_path)
    assert sorted(n for s in SPLITS for n in (d.name for d in files.splits[s])) == ["pkg/a.py", "pkg/sub/b.py",
                                                                                    "z.py"]
    assert [f[0] for f in files.fingerprint["files"]] == ["pkg/a.py", "pkg/sub/b.py", "z.py"]  # sorted as paths


def test_the_default_library_is_there_and_named():
    assert PYTHON_DOCSTRINGS in NAMED_SOURCES and "python-docs" in NAMED_SOURCES and "wikitext-103" in NAMED_SOURCES
    assert (stdlib_root() / "os.py").is_file()
    files = corpus_files(PYTHON_DOCSTRINGS)
    assert all(files.splits[s] for s in SPLITS)
    names = [d.name for s in SPLITS for d in files.splits[s]]
    assert "os.py" in names and not any(n.startswith("test/") for n in names)


def test_a_missing_library_folder_is_a_corpus_error(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="does not exist"):
        python_docstrings_files(tmp_path / "nowhere")
