"""The command line against a hostile folder: planted links, names that climb out of ``--out``, model
folders that ask to run code, damaged model folders, and two evaluations writing one folder.  Each is
refused with ONE line on stderr and exit code 2, before anything is written, and the file a link
points at is unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bayeslayer.cli import main
from bayeslayer.training import OutputLock

from .model_folders import (
    TARGET_TEXT,
    flip_byte,
    link,
    lm_record,
    tiny_model,
    write_lm_results,
    write_lm_run,
    write_remote_code_folder,
    write_target,
)
from .test_cli import one_line_error


@pytest.fixture
def target(tmp_path) -> Path:
    return write_target(tmp_path / "elsewhere" / "precious.txt")


@pytest.fixture
def lm_results(tmp_path) -> Path:
    """An ``lm eval`` output folder holding a results record, for ``--plot-only``."""
    return write_lm_results(tmp_path / "results")


@pytest.fixture
def lm_run(tmp_path) -> Path:
    """A finished ``lm train`` run folder of a tiny model (``final/`` as training writes it, manifest included)."""
    return write_lm_run(tiny_model(hidden_size=16, num_hidden_layers=1, head_dim=8), tmp_path / "run")


# ----------------------------------------------------------------------------- links


def test_lm_train_refuses_a_symlinked_lock(tmp_path, target, capsys):
    run = tmp_path / "R"
    link(run / ".lock", target)
    source = tmp_path / "corpus"
    source.mkdir()
    one_line_error(["lm", "train", "--preset", "tiny", "--source", str(source), "--out", str(run), "--device", "cpu"],
                   capsys, ".lock is a symbolic link")
    assert target.read_text() == TARGET_TEXT and os.path.islink(run / ".lock")


@pytest.mark.parametrize("command", ["recall", "crowding"])
def test_core_experiments_refuse_a_symlinked_runs_lock(tmp_path, target, capsys, command):
    out = tmp_path / "R2"
    link(out / "runs" / ".lock", target)
    one_line_error([command, "--preset", "tiny", "--out", str(out)], capsys,
                   "runs/.lock is a symbolic link")
    assert target.read_text() == TARGET_TEXT


def test_lm_eval_plot_only_refuses_a_symlinked_output_file(lm_results, target, capsys):
    link(lm_results / "lm.md", target)
    one_line_error(["lm", "eval", "--plot-only", "--out", str(lm_results)], capsys, "lm.md is a symbolic link")
    assert target.read_text() == TARGET_TEXT and os.path.islink(lm_results / "lm.md")


def test_lm_eval_plot_only_still_redraws(lm_results, capsys):
    assert main(["lm", "eval", "--plot-only", "--out", str(lm_results)]) == 0
    assert (lm_results / "lm.md").is_file() and (lm_results / "lm.png").is_file()


# ----------------------------------------------------------------------------- --name


TRAVERSING = ["../../x", "../x", "sub/x", "..", ".", "/tmp/x", "a\\b", ""]


@pytest.mark.parametrize("name", TRAVERSING)
def test_lm_eval_name_cannot_leave_out(tmp_path, lm_results, lm_run, name, capsys):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    one_line_error(["lm", "eval", str(lm_run), "--name", name, "--out", str(lm_results / "o")], capsys, "--name")
    one_line_error(["lm", "eval", "--plot-only", "--name", name, "--out", str(lm_results)], capsys, "--name")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("name", TRAVERSING)
def test_heldout_name_cannot_leave_out(tmp_path, lm_run, name, capsys):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    one_line_error(["heldout", "--model", str(lm_run), "--name", name, "--out", str(tmp_path / "o" / "p")], capsys,
                   "--name")
    one_line_error(["heldout", "--plot-only", "--name", name, "--out", str(tmp_path)], capsys, "--name")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_write_report_apis_refuse_a_traversing_name(tmp_path):
    from bayeslayer.experiments import heldout, lm

    with pytest.raises(ValueError, match="plain file name"):
        lm.write_report(lm_record(), tmp_path / "o", "../x")
    with pytest.raises(ValueError, match="plain file name"):
        heldout.HeldoutConfig(models=[], name="../x")
    assert not (tmp_path / "x.json").exists()


# ----------------------------------------------------------------------------- busy output folders


def test_two_lm_evals_on_one_out_the_second_is_refused(lm_results, capsys):
    with OutputLock(lm_results):
        one_line_error(["lm", "eval", "--plot-only", "--out", str(lm_results)], capsys, "is in use by another run")
    assert not (lm_results / "lm.md").exists()


def test_a_busy_niah_or_heldout_out_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    with OutputLock(out):
        one_line_error(["niah", "--plot-only", "--out", str(out)], capsys, "is in use by another run")
        one_line_error(["heldout", "--plot-only", "--out", str(out)], capsys, "is in use by another run")


# ----------------------------------------------------------------------------- remote code


def test_niah_refuses_remote_code_without_a_prompt(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "code-ran"
    model = write_remote_code_folder(tmp_path / "evil", marker)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked on the terminal"))
    one_line_error(["niah", "--model", str(model), "--out", str(tmp_path / "o")], capsys, "asks to run Python code",
                   "--trust-remote-code")
    assert not marker.exists()


# ----------------------------------------------------------------------------- damaged model folders


def test_lm_eval_names_a_damaged_model_file(tmp_path, lm_run, capsys):
    flip_byte(lm_run / "final")
    one_line_error(["lm", "eval", str(lm_run), "--out", str(tmp_path / "o"), "--device", "cpu"], capsys,
                   "final/model.safetensors fails its SHA-256 check")


def test_lm_eval_names_a_config_that_disagrees_with_the_weights(tmp_path, lm_run, capsys):
    from bayeslayer.models.loading import write_model_manifest

    config = json.loads((lm_run / "final" / "config.json").read_text())
    config["hidden_size"] = 32
    (lm_run / "final" / "config.json").write_text(json.dumps(config))
    write_model_manifest(lm_run / "final")
    one_line_error(["lm", "eval", str(lm_run), "--out", str(tmp_path / "o"), "--device", "cpu"], capsys,
                   str(lm_run / "final"), "model.embeddings.weight", "(50, 16)", "(50, 32)")


def test_distill_names_a_damaged_teacher_before_any_work(tmp_path, lm_run, capsys):
    flip_byte(lm_run / "final")
    one_line_error(["distill", "train", "--teacher", str(lm_run / "final"), "--out", str(tmp_path / "d"),
                    "--device", "cpu"], capsys, "model.safetensors fails its SHA-256 check")
    assert not (tmp_path / "d").exists()


def test_state_budget_json_refuses_a_link_before_the_search(tmp_path, target, capsys):
    path = link(tmp_path / "out" / "configs.json", target)
    one_line_error(["state-budget", "--json", str(path)], capsys, "--json", "symbolic link")
    assert target.read_text() == TARGET_TEXT
