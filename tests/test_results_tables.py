"""The results tables of README.md and docs/ are what ``python -m bayeslayer.results tables`` makes from results/."""

import shutil
from pathlib import Path

import pytest

from bayeslayer import results

ROOT = Path(__file__).resolve().parents[1]


def test_every_marked_table_matches_its_records():
    assert results.regenerate(ROOT, check=True) == []


@pytest.fixture
def copy(tmp_path):
    for document in results.DOCUMENTS:
        if (ROOT / document).is_file():
            (tmp_path / document).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / document, tmp_path / document)
    shutil.copytree(ROOT / "results", tmp_path / "results", ignore=shutil.ignore_patterns("*.png", "*.jsonl"))
    return tmp_path


def test_a_changed_number_fails_and_tables_puts_it_back(copy):
    doc = copy / "docs/experiments.md"
    text = doc.read_text(encoding="utf-8")
    assert "| BL (ours, `cpu`, 2 seeds) | 219.48 ± 10.04 |" in text
    doc.write_text(text.replace("| BL (ours, `cpu`, 2 seeds) | 219.48 ± 10.04 |",
                                "| BL (ours, `cpu`, 2 seeds) | 219.47 ± 10.04 |"), encoding="utf-8")
    problems = results.regenerate(copy, check=True)
    assert len(problems) == 1 and "lm-cpu" in problems[0] and "docs/experiments.md" in problems[0]
    assert doc.read_text(encoding="utf-8") != text  # --check changes nothing
    assert results.regenerate(copy) == []
    assert doc.read_text(encoding="utf-8") == text


def test_a_changed_record_fails(copy):
    import json

    path = copy / "results/mqar/layouts/mqar_update.json"
    record = json.loads(path.read_text())
    record["models"]["bayesian"]["summary"]["train_seconds"]["mean"] += 100
    path.write_text(json.dumps(record))
    problems = results.regenerate(copy, check=True)
    assert len(problems) == 1 and "mqar-update-stacked" in problems[0]


def test_unknown_unclosed_and_unmarked_tables_are_reported(copy):
    doc = copy / "docs/experiments.md"
    text = doc.read_text(encoding="utf-8")
    begin = "<!-- results-table {}: python -m bayeslayer.results tables -->"
    doc.write_text(text + "\n" + begin.format("no-such") + "\n| a |\n<!-- /results-table no-such -->\n"
                   + begin.format("lm-cpu") + "\n", encoding="utf-8")
    problems = results.regenerate(copy, check=True)
    assert any("'no-such' has no generator" in p for p in problems)
    assert any("no closing marker" in p for p in problems)
    doc.write_text(text.replace("<!-- results-table lm-cpu60:", "<!-- not-a-table lm-cpu60:"), encoding="utf-8")
    assert any("'lm-cpu60'" in p and "marked in no document" in p for p in results.regenerate(copy, check=True))


def test_command_line(copy, capsys):
    assert results.main(["tables", "--check", "--root", str(copy)]) == 0
    assert results.main(["tables", "--root", str(copy / "docs")]) == 2  # no results/ there: one line, exit 2
    assert "has no results/ folder" in capsys.readouterr().err
