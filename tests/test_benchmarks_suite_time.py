"""benchmarks/suite_time.py refuses what is not a commit before it starts any suite."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark


def test_a_base_that_is_not_a_commit_ends_in_one_line_and_exit_code_2(capsys):
    suite_time = load_benchmark("suite_time")
    with pytest.raises(SystemExit) as err:
        suite_time.main(["--base", "no-such-commit-anywhere"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "--base/--head" in lines[-1] and "no-such-commit-anywhere" in lines[-1]
