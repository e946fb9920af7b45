"""The ``bayeslayer`` command line as a user meets it: every call goes through ``bayeslayer.cli.main``.

Each subcommand's common mistakes (a bad number, an unknown name, a missing file, a bad ``--out``,
``--device cuda`` without a GPU, a bad preset) must end in exit code 2 and ONE line on stderr,
before any training or file writing; ``--debug`` shows the traceback instead; Ctrl-C is exit code
130 and one line; a bug still shows its traceback.  The tables of cases below are what
docs/reliability.md counts.
"""

from __future__ import annotations

import json

import pytest
import torch

from bayeslayer import cli
from bayeslayer.cli import main
from bayeslayer.errors import Interrupted, UsageError

NO_GPU = not torch.cuda.is_available()


def one_line_error(argv, capsys, *needles) -> str:
    """Run ``bayeslayer argv``; assert exit code 2 and exactly one stderr line holding every needle."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, (rc, captured.err)
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and "Traceback" not in captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def places(tmp_path):
    """A file where a folder is expected, an empty folder, and a folder that does not exist."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"file": str(a_file), "empty": str(empty), "missing": str(tmp_path / "missing"),
            "below_file": str(a_file / "sub"), "new": str(tmp_path / "new")}


def fill(argv, places):
    return [a.format(**places) for a in argv]


# (subcommand, argv, text the one line must hold).  {file}, {empty}, {missing}, {below_file} and
# {new} are replaced by the fixture's paths; no case may create {new}.
CASES = [
    # demo
    ("demo", ["demo", "--T", "0"], "--T"),
    ("demo", ["demo", "--T", "ten"], "'ten'"),
    # collision
    ("collision", ["collision", "--rho", "1.5", "--out", "{new}"], "rho must be a key overlap"),
    ("collision", ["collision", "--rho", "x"], "invalid float value"),
    ("collision", ["collision", "--p0", "-1", "--out", "{new}"], "p0"),
    ("collision", ["collision", "--out", "{file}"], "is a file"),
    ("collision", ["collision", "--out", "{below_file}"], "cannot create it"),
    ("collision", ["collision", "--plot-only", "--out", "{empty}"], "collision.json, which does not exist"),
    # recall / crowding
    ("recall", ["recall", "--steps", "0", "--out", "{new}"], "--steps"),
    ("recall", ["recall", "--seeds", "two", "--out", "{new}"], "--seeds"),
    ("recall", ["recall", "--preset", "huge"], "invalid choice: 'huge'"),
    ("recall", ["recall", "--models", "mamba"], "invalid choice: 'mamba'"),
    ("recall", ["recall", "--preset", "tiny", "--out", "{file}"], "is a file"),
    ("recall", ["recall", "--plot-only", "--out", "{empty}"], "recall.json, which does not exist"),
    ("crowding", ["crowding", "--batch-size", "-4", "--out", "{new}"], "--batch-size"),
    ("crowding", ["crowding", "--preset", "tiny", "--out", "{below_file}"], "cannot create it"),
    ("crowding", ["crowding", "--plot-only", "--out", "{empty}"], "crowding.json"),
    ("recall", ["recall", "--preset", "tiny", "--models", "delta", "--compute-match", "time", "--out", "{new}"],
     "include it in models"),
    ("crowding", ["crowding", "--compute-match", "wall"], "invalid choice: 'wall'"),
    # mqar
    ("mqar", ["mqar", "--out", "{new}"], "name a task"),
    ("mqar", ["mqar", "recall"], "invalid choice: 'recall'"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--shard", "zero3", "--out", "{new}"], "invalid choice: 'zero3'"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--shard", "ddp", "--out", "{new}"],
     "invalid choice: 'ddp'"),
    ("mqar", ["mqar", "base", "--mixers", "transformer"], "invalid choice: 'transformer'"),
    ("mqar", ["mqar", "base", "--epochs", "0", "--out", "{new}"], "--epochs"),
    ("mqar", ["mqar", "base", "--lr", "-1e-3", "--out", "{new}"], "--lr"),
    ("mqar", ["mqar", "base", "--preset", "paper-ish"], "invalid choice"),
    ("mqar", ["mqar", "update", "--preset", "tiny", "--mixers", "gated_deltanet", "--compute-match", "time",
              "--out", "{new}"], "include it in mixers"),
    ("mqar", ["mqar", "update", "--preset", "tiny", "--out", "{file}"], "is a file"),
    ("mqar", ["mqar", "--plot-only", "--out", "{empty}"], "holds no mqar_<task>*.json"),
    # variance
    ("variance", ["variance", "--preset", "huge"], "invalid choice: 'huge'"),
    ("variance", ["variance", "--tasks", "niah"], "invalid choice: 'niah'"),
    ("variance", ["variance", "--seeds", "0", "--out", "{new}"], "--seeds"),
    ("variance", ["variance", "--preset", "tiny", "--out", "{file}"], "is a file"),
    ("variance", ["variance", "--plot-only", "--out", "{empty}"], "variance.json, which does not exist"),
    # state-budget
    ("state-budget", ["state-budget", "--budget", "0"], "--budget"),
    ("state-budget", ["state-budget", "--width", "wide"], "--width"),
    ("state-budget", ["state-budget", "--mixers", "lstm"], "invalid choice: 'lstm'"),
    ("state-budget", ["state-budget", "--budget", "10", "--width", "7"], "cannot hold"),
    ("state-budget", ["state-budget", "--json", "{empty}"], "is a folder"),
    ("state-budget", ["state-budget", "--json", "{below_file}/x.json"], "is a file"),
    # niah
    ("niah", ["niah", "--out", "{new}"], "at least one --model"),
    ("niah", ["niah", "--model", "{missing}", "--out", "{new}"], "no such model folder"),
    ("niah", ["niah", "--model", "{empty}", "--out", "{new}"], "no config.json"),
    ("niah", ["niah", "--model", "{empty}", "--lengths", "8", "--out", "{new}"], "--lengths"),
    ("niah", ["niah", "--model", "{empty}", "--lengths", "2k"], "--lengths"),
    ("niah", ["niah", "--model", "{empty}", "--depths", "0,150", "--out", "{new}"], "--depths"),
    ("niah", ["niah", "--model", "{empty}", "--tasks", "niah_cwe", "--out", "{new}"], "unknown task 'niah_cwe'"),
    ("niah", ["niah", "--model", "{empty}", "--samples-per-cell", "0"], "--samples-per-cell"),
    ("niah", ["niah", "--model", "A={empty}", "--diff", "A,B", "--out", "{new}"], "'B' is not a --model label"),
    ("niah", ["niah", "--model", "{empty}", "--device", "tpu"], "--device"),
    ("niah", ["niah", "--model", "{empty}", "--out", "{file}"], "is a file"),
    ("niah", ["niah", "--plot-only", "--out", "{empty}"], "niah.json, which does not exist"),
    # lm train
    ("lm train", ["lm", "train", "--preset", "huge"], "invalid choice: 'huge'"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--mixer", "lstm", "--out", "{new}"], "mixer must be one of"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--steps", "many"], "--steps"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--mixer", "gated_deltanet", "--compute-match", "time",
                  "--out", "{new}"], "needs --reference-run"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--mixer", "gated_deltanet", "--compute-match", "time",
                  "--reference-run", "{empty}", "--out", "{new}"], "has no train_summary.json"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--steps", "0", "--out", "{new}"], "steps"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--lr", "-1", "--out", "{new}"], "lr"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--mixer-kwargs", "[1]", "--out", "{new}"], "JSON object"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--mixer-kwargs", '{{"p00": 1}}', "--out", "{new}"],
     "p00"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--source", "{missing}", "--out", "{new}"], "no such file"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--tokenizer", "{missing}", "--out", "{new}"], "--tokenizer"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--out", "{file}"], "is a file"),
    ("lm train", ["lm", "train", "--preset", "tiny", "--stop-after", "0"], "--stop-after"),
    # lm eval (Table 2)
    ("lm eval", ["lm", "eval", "--out", "{new}"], "at least one run directory"),
    ("lm eval", ["lm", "eval", "{missing}", "--out", "{new}"], "no such run directory"),
    ("lm eval", ["lm", "eval", "{empty}", "--out", "{new}"], "no finished model"),
    ("lm eval", ["lm", "eval", "{empty}", "--out", "{file}"], "is a file"),
    ("lm eval", ["lm", "eval", "{empty}", "--batch-size", "0"], "--batch-size"),
    ("lm eval", ["lm", "eval", "--plot-only", "--out", "{empty}"], "lm.json, which does not exist"),
    ("lm eval", ["lm", "eval", "{empty}", "--plot-only", "--out", "{empty}"], "takes no run directories"),
    # heldout (Table 7; formerly a mode of lm eval)
    ("heldout", ["heldout", "--lengths", "2048", "--out", "{new}"], "at least one --model"),
    ("heldout", ["heldout", "--model", "{missing}", "--out", "{new}"], "no such model or run folder"),
    ("heldout", ["heldout", "--model", "{empty}", "--lengths", "2k"], "--lengths"),
    ("heldout", ["lm", "eval", "--model", "{empty}", "--lengths", "64", "--out", "{new}"],
     "unrecognized arguments: --model"),
    ("heldout", ["heldout", "--model", "A={empty}", "--reference", "B", "--out", "{new}"], "reference"),
    ("heldout", ["heldout", "--model", "{empty}", "--windows", "sliding", "--out", "{new}"], "stride"),
    ("heldout", ["heldout", "--model", "{empty}", "--windows", "slide"], "invalid choice: 'slide'"),
    ("heldout", ["heldout", "--model", "{empty}", "--out", "{below_file}"], "cannot create it"),
    ("heldout", ["heldout", "--max-documents", "2", "--max-documents", "PG-19=3", "--model", "{empty}",
                 "--out", "{new}"], "--max-documents either once"),
    ("heldout", ["heldout", "--plot-only", "--out", "{empty}"], "heldout.json, which does not exist"),
    # distill train / eval
    ("distill train", ["distill", "train", "--preset", "tiny", "--out", "{new}"], "no teacher"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--teacher", "{missing}", "--out", "{new}"],
     "no checkpoint directory"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--stages", "phase_c"], "--stages"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--layers", "one"], "--layers"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--lr-a", "0", "--teacher", "{empty}"], "lr_a"),
    ("distill train", ["distill", "train", "--preset", "tiny", "--teacher", "{empty}", "--out", "{file}"],
     "is a file"),
    ("distill train", ["distill", "train", "--preset", "gpu"], "invalid choice: 'gpu'"),
    ("distill eval", ["distill", "eval", "--out", "{missing}"], "no such distillation folder"),
    ("distill eval", ["distill", "eval", "--out", "{empty}"], "distill.json does not exist"),
    ("distill eval", ["distill", "eval", "--out", "{empty}", "--niah-lengths", "2k"], "--niah-lengths"),
    ("distill eval", ["distill", "eval", "--out", "{empty}", "--samples-per-cell", "-1"], "--samples-per-cell"),
]
GPU_CASES = [
    ("niah", ["niah", "--model", "{empty}", "--device", "cuda"]),
    ("lm train", ["lm", "train", "--preset", "tiny", "--device", "cuda", "--out", "{new}"]),
    ("lm eval", ["lm", "eval", "{empty}", "--device", "cuda:0"]),
    ("heldout", ["heldout", "--model", "{empty}", "--device", "cuda"]),
    ("distill train", ["distill", "train", "--preset", "tiny", "--device", "cuda"]),
    ("distill eval", ["distill", "eval", "--out", "{empty}", "--device", "cuda"]),
]


@pytest.mark.parametrize("command, argv, needle", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_common_mistakes_are_one_line_and_exit_code_2(command, argv, needle, places, capsys):
    line = one_line_error(fill(argv, places), capsys, needle)
    assert line.startswith("bayeslayer")
    assert not (places["new"] and __import__("os").path.exists(places["new"])), "an output folder was created"


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("command, argv", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_device_cuda_without_a_gpu_is_one_line(command, argv, places, capsys):
    one_line_error(fill(argv, places), capsys, "no CUDA GPU is visible")


def test_every_subcommand_has_a_case():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    commands = set(sub.choices) - {"lm", "distill"} | {"lm train", "lm eval", "heldout", "distill train",
                                                      "distill eval"}
    assert commands <= {c[0] for c in CASES}


# ----------------------------------------------------------------------------- exit codes and --debug


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="rho must be a key overlap"):
        main(["--debug", "collision", "--rho", "1.5", "--out", str(tmp_path / "x")])
    with pytest.raises(UsageError, match="name a task"):
        main(["--debug", "mqar", "--out", str(tmp_path)])


def test_debug_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("BAYESLAYER_DEBUG", "1")
    with pytest.raises(ValueError):
        main(["collision", "--rho", "1.5", "--out", str(tmp_path / "x")])


def _patch_demo(monkeypatch, behaviour):
    from bayeslayer.experiments import demo

    monkeypatch.setattr(demo, "run", lambda config: behaviour())


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(**_):
        raise KeyboardInterrupt

    _patch_demo(monkeypatch, interrupted)
    assert main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "bayeslayer demo: interrupted"


def test_ctrl_c_after_a_checkpoint_says_where_it_is(monkeypatch, capsys):
    def interrupted(**_):
        raise Interrupted("runs/lm/x/step-000020")

    _patch_demo(monkeypatch, interrupted)
    assert main(["demo"]) == 130
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "interrupted; the last checkpoint is kept in runs/lm/x/step-000020" in line


def test_a_training_loop_stopped_by_ctrl_c_says_where_to_resume(monkeypatch, capsys):
    """The training loops raise TrainingInterrupted after saving; the CLI names that checkpoint."""
    from bayeslayer.training import TrainingInterrupted

    def interrupted(**_):
        raise TrainingInterrupted("recall: interrupted after step 4; saved it to runs/x.ckpt/step-4", step=4,
                                  checkpoint="runs/x.ckpt/step-4")

    _patch_demo(monkeypatch, interrupted)
    assert main(["demo"]) == 130
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "interrupted; the last checkpoint is kept in runs/x.ckpt/step-4" in line


def test_a_busy_output_folder_is_one_line(tmp_path, capsys):
    """A second run on a folder another run holds: one line naming the holder, exit code 2, nothing trained."""
    import os

    from bayeslayer.training import OutputLock

    out = tmp_path / "recall"
    with OutputLock(out / "runs"):
        line = one_line_error(["recall", "--preset", "tiny", "--models", "delta", "--seeds", "1", "--out", str(out),
                               "--no-progress"], capsys, "in use by another run", f"pid {os.getpid()}")
    assert "recall" in line and not (out / "recall.json").exists()


def test_a_bug_still_shows_its_traceback(monkeypatch):
    def bug(**_):
        raise RuntimeError("an internal error")

    _patch_demo(monkeypatch, bug)
    with pytest.raises(RuntimeError, match="an internal error"):
        main(["demo"])
    _patch_demo(monkeypatch, lambda **_: {}["missing"])
    with pytest.raises(KeyError):
        main(["demo"])


def test_a_missing_file_and_an_exit_message_are_one_line(monkeypatch, capsys):
    def missing(**_):
        raise FileNotFoundError("no results file at x.json")

    _patch_demo(monkeypatch, missing)
    assert main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == "bayeslayer demo: error: no results file at x.json"

    def exits(**_):
        raise SystemExit("a message\nover two lines")

    _patch_demo(monkeypatch, exits)
    assert main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == "bayeslayer demo: error: a message over two lines"


def test_return_values_become_exit_codes():
    assert cli.exit_code(None) == 0
    assert cli.exit_code({"models": {}}) == 0  # a record (niah.run returns its results)
    assert cli.exit_code(0) == 0 and cli.exit_code(3) == 3
    assert cli.exit_code(True) == 0


def test_no_command_prints_help_and_exit_code_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["demo", "--help"]) == 0
    assert "--length" in capsys.readouterr().out


def test_demo_runs_through_main(capsys):
    assert main(["demo", "--T", "64"]) == 0
    assert "chunked vs exact filter" in capsys.readouterr().out


def test_state_budget_json_is_written_where_asked(tmp_path, capsys):
    path = tmp_path / "new" / "heads.json"
    assert main(["state-budget", "--width", "64", "--mixers", "bayesian", "--json", str(path)]) == 0
    assert json.loads(path.read_text())[0]["mixer"] == "bayesian"
