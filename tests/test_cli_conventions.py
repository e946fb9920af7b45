"""Conventions every ``bayeslayer`` subcommand keeps, checked over all of them at once.

``--device cuda`` on a machine without a GPU: one line, exit code 2, nothing created.  ``--help``: a
one-paragraph plain-text description (no Sphinx roles, no double backticks), options with their
defaults.  ``--threads``: on every subcommand, one thread by default where the tensors are small.
A mistake found by the subcommand points to the subcommand's own ``--help``.
"""

from __future__ import annotations

import argparse
import os
import re

import pytest
import torch

from bayeslayer import cli
from bayeslayer.cli import main
from bayeslayer.experiments.common.threads import SMALL, TORCH_DEFAULT, apply_threads, resolve_threads

NO_GPU = not torch.cuda.is_available()


def leaf_parsers() -> dict[str, argparse.ArgumentParser]:
    """``{"demo": parser, "lm train": parser, ...}``: every parser that runs a command."""
    found = {}

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(words)] = parser
            return
        for name, child in subs[0].choices.items():
            walk(child, [*words, name])

    walk(cli.build_parser(), [])
    return found


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser, the top-level one and the groups (``lm``, ``distill``) included."""
    found = {"": cli.build_parser()}

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found[" ".join([*words, name])] = child
                    walk(child, [*words, name])

    walk(found[""], [])
    return found


# Each command with --device cuda and, where it needs them, the arguments that get it past parsing.
# {new} must never be created; {empty} is an existing empty folder.
DEVICE_CUDA = {
    "demo": ["demo"],
    "collision": ["collision", "--out", "{new}"],
    "recall": ["recall", "--preset", "tiny", "--out", "{new}"],
    "crowding": ["crowding", "--preset", "tiny", "--out", "{new}"],
    "lm train": ["lm", "train", "--preset", "tiny", "--out", "{new}"],
    "lm eval": ["lm", "eval", "{empty}", "--out", "{new}"],
    "state-budget": ["state-budget"],
    "mqar": ["mqar", "base", "--preset", "tiny", "--out", "{new}"],
    "niah": ["niah", "--model", "{empty}", "--out", "{new}"],
    "heldout": ["heldout", "--model", "{empty}", "--out", "{new}"],
    "distill train": ["distill", "train", "--preset", "tiny", "--out", "{new}"],
    "distill eval": ["distill", "eval", "--out", "{empty}"],
    "variance": ["variance", "--preset", "tiny", "--out", "{new}"],
}
# Commands whose work is arithmetic or float64 toys on the CPU: they have no --device.
CPU_ONLY = {"collision", "state-budget"}


def test_every_command_is_in_the_device_table():
    assert set(leaf_parsers()) == set(DEVICE_CUDA)


def test_device_on_every_command_that_trains_or_evaluates():
    for name, parser in leaf_parsers().items():
        has = any("--device" in a.option_strings for a in parser._actions)
        assert has == (name not in CPU_ONLY), name


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("command", sorted(DEVICE_CUDA))
def test_device_cuda_without_a_gpu_is_one_line_and_leaves_nothing(command, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    work = tmp_path / "work"  # the working folder: default outputs (results/, runs/) would land here
    work.mkdir()
    monkeypatch.chdir(work)
    new = tmp_path / "new"
    argv = [a.format(new=new, empty=empty) for a in DEVICE_CUDA[command]] + ["--device", "cuda"]
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"bayeslayer {command}: error:"), lines[0]
    if command in CPU_ONLY:
        assert "unrecognized arguments: --device" in lines[0]
        assert f"see `bayeslayer {command} --help`" in lines[0]
    else:
        assert "no CUDA GPU is visible" in lines[0]
    assert not new.exists() and not os.listdir(work) and not os.listdir(empty)


def test_an_unknown_option_points_to_the_subcommands_help(capsys):
    assert main(["recall", "--no-such-option"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("bayeslayer recall: error: unrecognized arguments: --no-such-option "
                    "(see `bayeslayer recall --help`)")
    assert main(["lm", "train", "--no-such-option", "1"]) == 2
    assert "(see `bayeslayer lm train --help`)" in capsys.readouterr().err


SPHINX = re.compile(r":(func|class|mod|meth|data|attr|obj|exc|ref|doc):|``")


@pytest.mark.parametrize("name", sorted(all_parsers()))
def test_help_is_plain_text_with_a_description(name):
    parser = all_parsers()[name]
    text = parser.format_help()
    assert not SPHINX.search(text), (name, SPHINX.search(text).group(0))
    assert parser.description and parser.description.strip(), f"`bayeslayer {name}` has no description"
    assert "\n\n" not in parser.description.strip(), f"`bayeslayer {name}`'s description is not one paragraph"


def test_help_shows_defaults_and_preset_values():
    parsers = leaf_parsers()
    text = " ".join(parsers["lm train"].format_help().split())
    assert "override the preset" not in text
    assert "(default: the preset's: cpu 200, paper 7935, tiny 20)" in text  # --steps
    assert "(default: the preset's: cpu 1024, paper 2048, tiny 128)" in text  # --seq-len
    recall = " ".join(parsers["recall"].format_help().split())
    assert "--steps" in recall and "(default: the preset's: default" in recall
    demo = parsers["demo"].format_help()
    assert "--length T" in demo and "--T" not in demo and "(default: 512)" in demo


def test_demo_keeps_its_old_option_spelling(capsys):
    assert main(["demo", "--T", "16"]) == 0
    assert "T=16" in capsys.readouterr().out


# ----------------------------------------------------------------------------- threads


def parse(argv):
    return cli.build_parser().parse_args(argv)


def test_every_command_has_threads():
    for name, parser in leaf_parsers().items():
        assert any("--threads" in a.option_strings for a in parser._actions), name


@pytest.mark.parametrize("argv, threads", [
    (["collision"], SMALL), (["demo"], SMALL), (["recall"], SMALL), (["crowding"], SMALL),
    (["state-budget"], SMALL), (["lm", "train", "--preset", "tiny"], SMALL),
    (["lm", "train", "--preset", "cpu"], TORCH_DEFAULT), (["lm", "train"], TORCH_DEFAULT),
    (["mqar", "base"], TORCH_DEFAULT), (["niah"], TORCH_DEFAULT), (["heldout"], TORCH_DEFAULT),
    (["collision", "--threads", "3"], 3), (["lm", "train", "--preset", "tiny", "--threads", "0"], TORCH_DEFAULT),
])
def test_thread_defaults_per_workload(argv, threads):
    assert resolve_threads(parse(argv)) == threads


def test_threads_are_applied_and_checked(capsys):
    before = torch.get_num_threads()
    try:
        assert apply_threads(parse(["collision", "--threads", "1"])) == 1 == torch.get_num_threads()
        from bayeslayer.experiments.common import threads as threads_mod

        # --threads 0: PyTorch's own default, as it was when the package was imported (an earlier command in
        # this process may have changed the current count)
        assert apply_threads(parse(["collision", "--threads", "0"])) == threads_mod._TORCH_THREADS
    finally:
        torch.set_num_threads(before)
    assert main(["demo", "--threads", "-1"]) == 2
    assert "--threads" in capsys.readouterr().err
