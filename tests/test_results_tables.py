"""The results tables of README.md and docs/ are what ``python tools/build_tables.py tables`` makes from results/."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    """``tools/build_tables.py`` as a module (``tools/`` is a folder of the checkout's scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("tools_build_tables", ROOT / "tools" / "build_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build_tables = _load_tool()


def test_every_marked_table_matches_its_records():
    assert build_tables.regenerate(ROOT, check=True) == []


@pytest.fixture
def copy(tmp_path):
    for document in build_tables.DOCUMENTS:
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
    problems = build_tables.regenerate(copy, check=True)
    assert len(problems) == 1 and "lm-cpu" in problems[0] and "docs/experiments.md" in problems[0]
    assert doc.read_text(encoding="utf-8") != text  # --check changes nothing
    assert build_tables.regenerate(copy) == []
    assert doc.read_text(encoding="utf-8") == text


def test_a_changed_record_fails(copy):
    import json

    path = copy / "results/mqar/layouts/mqar_update.json"
    record = json.loads(path.read_text())
    record["models"]["bayesian"]["summary"]["train_seconds"]["mean"] += 100
    path.write_text(json.dumps(record))
    problems = build_tables.regenerate(copy, check=True)
    assert len(problems) == 1 and "mqar-update-stacked" in problems[0]


def test_a_table_of_two_records_reads_both(copy):
    """The four-layer Block table joins two commands' records: a change in the second is caught too."""
    import json

    path = copy / "results/mqar/hybrid4_bl_noconv/mqar_block_hybrid.json"
    record = json.loads(path.read_text())
    record["models"]["bayesian_noconv"]["summary"]["accuracy"]["mean"][-1] -= 0.5
    path.write_text(json.dumps(record))
    problems = build_tables.regenerate(copy, check=True)
    assert len(problems) == 1 and "mqar-block-hybrid4" in problems[0]


def test_unknown_unclosed_and_unmarked_tables_are_reported(copy):
    doc = copy / "docs/experiments.md"
    text = doc.read_text(encoding="utf-8")
    begin = "<!-- results-table {}: python tools/build_tables.py tables -->"
    doc.write_text(text + "\n" + begin.format("no-such") + "\n| a |\n<!-- /results-table no-such -->\n"
                   + begin.format("lm-cpu") + "\n", encoding="utf-8")
    problems = build_tables.regenerate(copy, check=True)
    assert any("'no-such' has no generator" in p for p in problems)
    assert any("no closing marker" in p for p in problems)
    doc.write_text(text.replace("<!-- results-table lm-cpu60:", "<!-- not-a-table lm-cpu60:"), encoding="utf-8")
    assert any("'lm-cpu60'" in p and "marked in no document" in p for p in build_tables.regenerate(copy, check=True))


def test_command_line(copy, capsys):
    assert build_tables.main(["tables", "--check", "--root", str(copy)]) == 0
    assert build_tables.main(["tables", "--root", str(copy / "docs")]) == 2  # no results/ there: one line, exit 2
    assert "has no results/ folder" in capsys.readouterr().err


# Tables of measured numbers that are not generated yet, by document and the start of their header.  Each
# should move into bayeslayer.build_tables.TABLES; a new table of numbers outside the markers fails the test below.
# Every document that may hold a generated table is checked.
CHECKED = build_tables.DOCUMENTS
NOT_GENERATED_YET = {
    # kernels: a CPU precision measurement without a committed record
    ("docs/kernels.md", "| | long-memory | stress |"),
    # measured by a named test or benchmark script whose output is not a committed record
    ("docs/kernels.md", "| inputs | regime | scan |"),
    ("docs/reliability.md", "| p0 | recurrent o, before → now |"),
    ("docs/reliability.md", "| regime | state | tokens |"),
    ("docs/reliability.md", "| p0 | plain `P̄ − βuuᵀ` |"),
    ("docs/reliability.md", "| keys | p0 | recurrent |"),
    ("docs/reliability.md", "| regime | covariance pass | forward |"),
    # kernels compiled for sm_90: register and spill counts of earlier builds, printed, not kept
    ("docs/kernels.md", "| kernel, tiles | warps | registers |"),
    ("docs/kernels.md", "| kernel (use) | warps | D = 64 |"),
    ("docs/kernels.md", "| C, warps | D | B2 | B4 |"),
    # the python-docs corpus as built from the Debian package (printed by the data module, not kept)
    ("docs/data.md", "| split | documents | tokens |"),
    ("docs/data.md", "| split | windows | evaluated tokens |"),
}
# Tables of outcomes counted by the tests themselves (each names its test, which checks the counts).
CHECKED_BY_TESTS = {
    ("docs/reliability.md", "| loop | run | kill points |"),
    ("docs/reliability.md", "| what was damaged | cases |"),
    ("docs/reliability.md", "| case | cases | outcome |"),
    ("docs/reliability.md", "| category | demo | collision |"),
    ("docs/reliability.md", "| surface | category | bad calls |"),
}
# Tables of numbers that are not measurements: the paper's figures, settings, the status of each command.
NOT_RESULTS = {
    ("README.md", "| command | what"),
    ("docs/layers.md", "| mixer | dims per head |"),  # sizes that follow from the configuration
    ("docs/experiments.md", "| model | 2k | 4k | 8k | 16k |"),
    ("docs/experiments.md", "| setting | value |"),
    ("docs/experiments.md", "| preset | steps | batch |"),
    ("docs/experiments.md", "| | `--preset paper`"),
    ("docs/experiments.md", "| width | BL | GDN (both) |"),  # the solver's head configurations
    ("README.md", "| mixer | dims per head |"),
    ("docs/kernels.md", "| feature | Triton | notes |"),
    ("docs/kernels.md", "| inputs | outputs, variance, final M and P | gradients |"),  # the tests' tolerances
    ("docs/kernels.md", "| piece | where | runs as |"),
    ("docs/kernels.md", "| equation (docs/theory.md) | PyTorch |"),  # where each equation of the theory lives
    ("docs/kernels.md", "| # | launch | grid |"),  # bytes counted from the code
    ("docs/data.md", "| `source` | what it reads |"),
}


def _numeric_tables_outside_markers(root):
    import re

    found = set()
    for document in CHECKED:
        lines, inside = (root / document).read_text(encoding="utf-8").split("\n"), False
        for i, line in enumerate(lines):
            inside = (inside or line.startswith("<!-- results-table ")) and not line.startswith("<!-- /results-table")
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")) and not inside:
                j = i
                while j < len(lines) and lines[j].startswith("|"):
                    j += 1
                rows = lines[i + 2:j]
                decimals = sum(len(re.findall(r"\d+\.\d+", row)) for row in rows)
                numbers = sum(len(re.findall(r"\d+(?:[.,]\d+)*", row)) for row in rows)
                if decimals >= 3 or numbers >= 6:  # decimals, or counts and sizes (registers, tokens, cases)
                    found.add((document, line))
    return found


def test_no_new_table_of_numbers_outside_the_generated_ones():
    """The ratchet on quoted numbers: a new table of decimals in the results documents must be generated."""
    known = NOT_GENERATED_YET | NOT_RESULTS | CHECKED_BY_TESTS
    found = _numeric_tables_outside_markers(ROOT)
    unknown = sorted((d, h) for d, h in found if not any(d == kd and h.startswith(kh) for kd, kh in known))
    assert unknown == []


def test_the_ratchet_sees_a_new_table(copy):
    doc = copy / "docs/experiments.md"
    doc.write_text(doc.read_text(encoding="utf-8") + "\n| x | y |\n|---|---|\n| 1.5 | 2.5 |\n| 3.5 | 4.5 |\n",
                   encoding="utf-8")
    assert ("docs/experiments.md", "| x | y |") in _numeric_tables_outside_markers(copy)


def test_every_generated_table_fails_when_a_number_in_it_changes(copy):
    """Each generated table, not only one: a digit changed in its first data row is caught, naming the table.
    Every table gets its changed digit at once, and one check must name each of them (and no other)."""
    import re

    for name, (document, _) in build_tables.TABLES.items():
        doc = copy / document
        text = doc.read_text(encoding="utf-8")
        begin = f"<!-- results-table {name}: python tools/build_tables.py tables -->"
        start = text.index(begin) + len(begin)
        row_at = text.index("\n|", text.index("\n|---", start) + 1) + 1  # the first row below the separator
        row = text[row_at:text.index("\n", row_at)]
        digit = re.search(r"\d", row.split("|", 2)[2])  # a digit after the first cell (the row's label)
        assert digit, (name, row)
        at = row_at + len(row.split("|", 2)[0]) + len(row.split("|", 2)[1]) + 2 + digit.start()
        doc.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:], encoding="utf-8")
    named = {}
    for problem in build_tables.regenerate(copy, check=True):
        found = re.fullmatch(r"(\S+): tables differ from their records: (.+) \(run `.+`\)", problem)
        assert found, problem
        named[found[1]] = set(found[2].split(", "))
    expected = {}
    for name, (document, _) in build_tables.TABLES.items():
        expected.setdefault(document, set()).add(name)
    assert named == expected


def test_every_listed_table_still_exists():
    """The lists above name tables that are there: a table since generated or removed leaves them."""
    found = _numeric_tables_outside_markers(ROOT)
    stale = sorted((d, h) for d, h in NOT_GENERATED_YET | NOT_RESULTS | CHECKED_BY_TESTS
                   if not any(d == fd and fh.startswith(h) for fd, fh in found))
    assert stale == []


def test_every_marked_number_of_the_text_fails_when_it_changes_and_tables_puts_it_back(copy):
    """Each number of running text in :data:`build_tables.VALUES`: a digit changed is caught, naming it, and the
    command writes the record's number back."""
    import re

    originals = {}
    for name, (document, _) in build_tables.VALUES.items():
        doc = copy / document
        text = doc.read_text(encoding="utf-8")
        originals.setdefault(document, text)
        m = re.search(rf"<!-- value {name} -->(.*?)<!-- /value -->", text)
        assert m, name
        digit = re.search(r"\d", m[1])
        at = m.start(1) + digit.start()
        doc.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:], encoding="utf-8")
    named = {}
    for problem in build_tables.regenerate(copy, check=True):
        found = re.fullmatch(r"(\S+): numbers in the text differ from their records: (.+) \(run `.+`\)", problem)
        assert found, problem
        named[found[1]] = set(found[2].split(", "))
    expected = {}
    for name, (document, _) in build_tables.VALUES.items():
        expected.setdefault(document, set()).add(name)
    assert named == expected
    assert build_tables.regenerate(copy) == []
    for document, text in originals.items():
        assert (copy / document).read_text(encoding="utf-8") == text


def test_an_unknown_or_unused_value_is_reported(copy):
    doc = copy / "docs/experiments.md"
    text = doc.read_text(encoding="utf-8")
    doc.write_text(text.replace("<!-- value collision-seconds -->", "<!-- value no-such -->"), encoding="utf-8")
    problems = build_tables.regenerate(copy, check=True)
    assert any("value 'no-such' has no generator" in p for p in problems)
    assert any("value 'collision-seconds' of docs/experiments.md is marked in no document" in p for p in problems)


# Measured times quoted in running text (``12.3 s``, ``441 ms``, ``4–5 min``) without a value marker, per
# document: each should become a generated number of build_tables.VALUES (or go); the counts may only fall.
UNMARKED_TIMES = {"README.md": 1, "docs/experiments.md": 62, "docs/kernels.md": 29, "docs/data.md": 9,
                  "docs/layers.md": 0, "docs/models.md": 2, "docs/reliability.md": 34, "docs/distributed.md": 0}


def _unmarked_times(text: str) -> int:
    import re

    text = re.sub(r"<!-- value [a-z0-9-]+ -->.*?<!-- /value -->", "", text)
    count, inside, code = 0, False, False
    for line in text.split("\n"):
        if line.startswith("```"):
            code = not code
            continue
        inside = (inside or line.startswith("<!-- results-table ")) and not line.startswith("<!-- /results-table")
        if not (inside or code or line.startswith("|")):
            count += len(re.findall(r"\b\d[\d,]*(?:\.\d+)?(?:–\d[\d,]*(?:\.\d+)?)? (?:s|ms|min)\b", line))
    return count


def test_no_new_unmarked_time_in_the_text():
    """The ratchet on quoted times: a new measured time in running text must be a generated number."""
    found = {d: _unmarked_times((ROOT / d).read_text(encoding="utf-8")) for d in build_tables.DOCUMENTS}
    assert found == UNMARKED_TIMES


def test_the_time_ratchet_sees_a_new_time_and_not_a_marked_one():
    assert _unmarked_times("It took 12.5 s and 4–5 min.\n| 3 s |\n```\n9 s\n```") == 2
    assert _unmarked_times("It took <!-- value x -->12.5 s<!-- /value -->.") == 0
