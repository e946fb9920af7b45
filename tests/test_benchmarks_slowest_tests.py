"""benchmarks/slowest_tests.py: a JUnit report becomes the record of the slowest tests and where each is now."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def slowest():
    return load_benchmark("slowest_tests")


def test_node_ids_from_junit_classes(slowest):
    assert slowest.node_id("tests.ops.test_numerics", "test_x[a-1]") == "tests/ops/test_numerics.py::test_x[a-1]"
    assert slowest.node_id("tests.test_results_tables.TestX", "test_y") == "tests/test_results_tables.py::TestX::test_y"
    with pytest.raises(ValueError, match="no test file"):
        slowest.node_id("tests.no_such_module", "test_z")


def test_record_marks_slow_and_default_tests(slowest, tmp_path, monkeypatch):
    junit = tmp_path / "suite.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.ops.test_numerics" name="test_step_long_decode_ill_conditioned_float64_state[1500]"'
        ' time="44.5"/>'
        '<testcase classname="tests.ops.test_numerics" name="test_step_long_decode_ill_conditioned_float64_state[200]"'
        ' time="1.5"/>'
        '<testcase classname="tests.ops.test_numerics" name="test_step_refuses_an_indefinite_state" time="0.1"/>'
        '</testsuite></testsuites>')
    default = {"tests/ops/test_numerics.py::test_step_long_decode_ill_conditioned_float64_state[200]",
               "tests/ops/test_numerics.py::test_step_refuses_an_indefinite_state"}
    monkeypatch.setattr(slowest, "default_suite", lambda: default)
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"tests/ops/test_numerics.py::test_step_long_decode_ill_conditioned_float64_state"
                                 "[1500]": "the 200-token case stays"}))
    out = tmp_path / "slowest.json"
    assert slowest.main([str(junit), "--top", "2", "--how", "a test", "--notes", str(notes), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [r["where"] for r in rec["rows"]] == ["slow", "default"]
    assert rec["rows"][0]["note"] == "the 200-token case stays" and rec["rows"][1]["note"] == ""
    assert rec["seconds_total"] == pytest.approx(46.1) and rec["seconds_in_default_now"] == pytest.approx(1.6)
    assert "provenance" in rec


def test_the_default_suite_leaves_out_slow_tests(slowest, tmp_path):
    """Collected with the project's pytest settings (its pyproject.toml: the ``slow`` marker, addopts that start
    xdist workers) in a folder whose one test file has a slow and a default case; the suite's own test files are
    not needed for this and would make the collection import torch."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_numerics.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.parametrize('n', [200, pytest.param(1500, marks=pytest.mark.slow)])\n"
        "def test_step_long_decode(n):\n    pass\n")
    ids = slowest.default_suite(tmp_path, paths=("tests/test_numerics.py",))
    assert ids == {"tests/test_numerics.py::test_step_long_decode[200]"}


def test_bad_arguments(slowest, tmp_path, capsys):
    junit = tmp_path / "suite.xml"
    junit.write_text('<testsuites><testsuite name="pytest"></testsuite></testsuites>')
    (tmp_path / "list.json").write_text("[]")
    out = ["--out", str(tmp_path / "o.json")]
    for argv, name in [([str(tmp_path / "missing.xml"), "--how", "x"], "junit"),
                       ([str(junit), "--top", "0", "--how", "x"], "--top"),
                       ([str(junit), "--how", "x", "--notes", str(tmp_path / "none.json")], "--notes"),
                       ([str(junit), "--how", "x", "--notes", str(tmp_path / "list.json")], "--notes")]:
        with pytest.raises(SystemExit) as e:
            slowest.main(argv + out)
        assert e.value.code == 2 and name in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "o.json").exists()
