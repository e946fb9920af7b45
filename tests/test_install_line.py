"""The README's install line, `.ci/run`, `.ci/refresh-constraints` and `.ci/constraints.txt` say the same.

CI must install the way a user does; the parts of the line live in `.ci/extras` and the scripts read
them, so a change to one place that the others miss fails here (and at the top of `.ci/run`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (ROOT / ".ci" / "extras").read_text().splitlines()
             if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def _setup_line() -> str:
    """The README's set-up command (the first ```bash block)."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no ```bash block"
    return block.group(1).strip()


def test_the_readme_installs_what_ci_installs():
    parts = _extras()
    assert set(parts) == {"EXTRAS", "TORCH", "TORCH_INDEX"}, parts
    line = _setup_line()
    assert f'pip install "{parts["TORCH"]}" --extra-index-url {parts["TORCH_INDEX"]}' in line, line
    assert f'pip install -e ".[{parts["EXTRAS"]}]"' in line, line


def test_the_ci_scripts_install_the_extras_parts():
    for script in ("run", "refresh-constraints"):
        text = (ROOT / ".ci" / script).read_text()
        for name in ("EXTRAS", "TORCH", "TORCH_INDEX"):
            assert f"s/^{name}=//p" in text, (script, name)
        assert '"$torch" --extra-index-url "$torch_index"' in text, script
        assert '-e ".[$extras]"' in text, script
        assert "torch==" not in text, f".ci/{script} names a torch version of its own"


def test_the_constraints_pin_the_readme_torch():
    parts = _extras()
    pins = [line for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
            if line.lower().startswith("torch==")]
    assert pins == [parts["TORCH"]], pins


def test_ci_run_checks_the_readme_before_installing():
    text = (ROOT / ".ci" / "run").read_text()
    assert text.index("README.md") < text.index("python3 -m venv")


def _test_command() -> str:
    """The README's test command (the second ```bash block)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2, "README.md has no test command block"
    return blocks[1].strip()


def test_ci_runs_the_readme_test_command_then_the_regression_tests_on_avx2():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = _test_command()
    assert command in lines, f".ci/run does not run the README's test command: {command}"
    second = [line for line in lines if line.endswith("-m pytest -q tests/training/test_regression.py")]
    assert second == ["ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 "
                      ".venv/bin/python -m pytest -q tests/training/test_regression.py"], second
    assert lines.index(command) < lines.index(second[0])
