"""The slowest tests of one suite run, and whether each is in the default suite now.

Run the suite with a JUnit report, then make the record from it (paths inside the checkout, so that the
command the record keeps names no folder of this machine)::

    .venv/bin/python -m pytest -q --junitxml=out/tests/suite.xml
    .venv/bin/python benchmarks/slowest_tests.py out/tests/suite.xml --top 20 \
        --how "pytest -n 2 on a 2-core CPU beside three training jobs" --out results/tests/slowest.json

Each row is a test's time in the report (set-up, call and tear-down) and where it is now: ``default``
when ``pytest --collect-only -m 'not slow'`` still collects it, ``slow`` otherwise. ``--notes FILE``
(a JSON object of test id -> text) adds why. The table in docs/reliability.md is drawn from the record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bayeslayer.experiments.common.provenance import write_record  # noqa: E402


def node_id(classname: str, name: str, root: Path = ROOT) -> str:
    """``tests.ops.test_scan.TestX`` + ``test_y[a]`` -> ``tests/ops/test_scan.py::TestX::test_y[a]``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    raise ValueError(f"no test file under {root} for the JUnit class {classname!r}")


def timings(junit: Path) -> list[tuple[str, float]]:
    """Every test case of a JUnit XML report as ``(node id, seconds)``, slowest first."""
    cases = ET.parse(junit).getroot().iter("testcase")
    rows = [(node_id(c.get("classname", ""), c.get("name", "")), float(c.get("time", 0.0))) for c in cases]
    return sorted(rows, key=lambda r: -r[1])


def default_suite(root: Path = ROOT, paths: tuple[str, ...] = ()) -> set[str]:
    """The node ids the default run (``-m 'not slow'``) collects (from ``paths`` only, when given)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p",
                          "no:cacheprovider", "-m", "not slow", "-o", "addopts=", *paths], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit", type=Path, help="a JUnit XML report of a pytest run (--junitxml)")
    p.add_argument("--top", type=int, default=20, help="how many of the slowest tests to keep (default 20)")
    p.add_argument("--how", required=True, help="how the run was made: command, machine and load")
    p.add_argument("--notes", type=Path, default=None, help="JSON object: test id -> why it went where it did")
    p.add_argument("--out", type=Path, required=True, help="the record to write (JSON)")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top must be a positive integer, got {args.top}")
    if not args.junit.is_file():
        p.error(f"junit: no such file {args.junit}")
    if args.notes is not None and not args.notes.is_file():
        p.error(f"--notes: no such file {args.notes}")
    notes = json.loads(args.notes.read_text()) if args.notes else {}
    if not isinstance(notes, dict):
        p.error(f"--notes must hold a JSON object (test id -> text), got {type(notes).__name__}")
    rows = timings(args.junit)
    default = default_suite()
    total = sum(s for _, s in rows)
    kept = sum(s for t, s in rows if t in default)
    record = {
        "measurement": f"the {args.top} slowest tests of one run of the suite, and where each is now",
        "how": args.how,
        "tests": len(rows), "seconds_total": total, "seconds_in_default_now": kept,
        "rows": [{"test": t, "seconds": s, "where": "default" if t in default else "slow",
                  "note": notes.get(t, "")} for t, s in rows[:args.top]],
    }
    write_record(args.out, record)
    for r in record["rows"]:
        print(f"{r['seconds']:8.1f}  {r['where']:<7}  {r['test']}")
    print(f"{len(rows)} tests, {total:.0f} s; {kept:.0f} s of them in the default suite now -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
