"""The input checks behind the one-line errors: devices, output folders, checkpoint paths, config names."""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.errors import UsageError
from bayeslayer.experiments.common import options
from bayeslayer.experiments.common.options import check_out_dir, check_out_file
from bayeslayer.training.distributed import resolve_device

# ----------------------------------------------------------------------------- --device


def _fake_gpus(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cuda_gets_an_index(monkeypatch):
    """``--device cuda`` used to reach ``torch.cuda.set_device`` without an index and fail."""
    _fake_gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun, a bare cuda is this process's GPU
    assert resolve_device("cuda") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="2 CUDA device"):
        resolve_device("cuda:2")


def test_init_distributed_sets_an_indexed_device(monkeypatch):
    from bayeslayer.training.distributed import init_distributed

    _fake_gpus(monkeypatch, 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: chosen.append(dev))
    ctx = init_distributed("cuda")
    assert ctx.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]


def test_no_gpu_and_unknown_devices_are_refused(monkeypatch):
    _fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(UsageError, match="no CUDA GPU is visible"):
            resolve_device(spec)
    for spec in ("tpu", "gpu", "cuda:x", ""):
        with pytest.raises(UsageError, match="--device must be"):
            resolve_device(spec)


# ----------------------------------------------------------------------------- --out


def test_out_checks(tmp_path):
    (tmp_path / "f").write_text("x")
    assert check_out_dir(tmp_path) == tmp_path
    assert check_out_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # creatable
    assert not (tmp_path / "a").exists()  # and not created by the check
    with pytest.raises(UsageError, match="is a file"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(UsageError, match="cannot create it"):
        check_out_dir(tmp_path / "f" / "sub")
    with pytest.raises(UsageError, match="is a folder"):
        check_out_file(tmp_path, option="--json")
    assert check_out_file(tmp_path / "new.json", option="--json") == tmp_path / "new.json"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_out_in_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="not writable"):
            check_out_dir(ro)
        with pytest.raises(UsageError, match="not writable"):
            check_out_dir(ro / "new")
    finally:
        ro.chmod(0o700)


def test_read_only_folder_via_access(tmp_path, monkeypatch):
    """The same check on any account: os.access says the folder may not be written."""
    monkeypatch.setattr(options.os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match="the folder is not writable"):
        check_out_dir(tmp_path)
    with pytest.raises(UsageError, match="is not writable"):
        check_out_dir(tmp_path / "new")


# ----------------------------------------------------------------------------- checkpoint paths


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything tries to download; a cache lookup (local_files_only) is allowed."""
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("local_files_only", False)))
        if not kwargs.get("local_files_only"):
            raise AssertionError(f"tried the network for {repo_id!r}")
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


@pytest.mark.parametrize("name", ["./ckpts/gdn", "/nonexistent/gdn", "~/nonexistent-gdn", "ckpts/gdn/final",
                                  "ckpts/gdn"])
def test_a_missing_local_folder_fails_at_once(name, tmp_path, monkeypatch, no_network):
    from bayeslayer.models import load_gdn_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()  # so "ckpts/gdn" is a path here, not the hub repository ckpts/gdn
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        load_gdn_checkpoint(name)
    assert no_network == []  # not even a cache lookup: a path is never a hub id


def test_a_hub_id_offline_uses_only_the_cache(tmp_path, monkeypatch, no_network):
    from bayeslayer.models import load_gdn_checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        load_gdn_checkpoint("fla-hub/gdn-340M")
    assert no_network == [("fla-hub/gdn-340M", True)]


def test_a_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    import huggingface_hub

    from bayeslayer.models import load_gdn_checkpoint

    def snapshot_download(repo_id, **kwargs):
        raise ConnectionError("Name or service not known\nretrying")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(FileNotFoundError, match=r"fetching it as the hub id 'owner/name' failed: ConnectionError"):
        load_gdn_checkpoint("owner/name")


def test_distill_refuses_a_missing_teacher_before_training(tmp_path, monkeypatch, no_network, capsys):
    from bayeslayer.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    assert main(["distill", "train", "--preset", "tiny", "--teacher", "ckpts/gdn", "--out", "run"]) == 2
    assert "read as a local path, not a hub id" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and no_network == []


# ----------------------------------------------------------------------------- BayesLayerConfig


def test_layer_mixers_is_refused_with_the_right_argument():
    from bayeslayer.models import BayesLayerConfig

    with pytest.raises(ValueError, match=r"layer_mixers is derived .* pass mixers=\[one name per layer\]"):
        BayesLayerConfig(layer_mixers=["bayesian"] * 4)
    with pytest.raises(ValueError, match="intermediate_size="):
        BayesLayerConfig(mlp_intermediate_size=256)
    config = BayesLayerConfig(mixers=["bayesian", "gated_deltanet"], num_hidden_layers=2)
    assert config.layer_mixers == ["bayesian", "gated_deltanet"]
    assert BayesLayerConfig(num_labels=3).num_labels == 3  # a settable property of the base class still works


def test_a_config_json_with_layer_mixers_is_refused(tmp_path):
    import json

    from bayeslayer.models import BayesLayerConfig

    BayesLayerConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_mixers"] = ["bayesian", "bayesian"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="layer_mixers is derived"):
        BayesLayerConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("bad", [None, 3, ""])
def test_checkpoint_path_helpers_name_their_argument(bad):
    from bayeslayer.models.fla_import import hub_id, resolve_checkpoint_dir

    with pytest.raises(TypeError, match="path_or_repo_id"):
        hub_id(bad)
    with pytest.raises(TypeError, match="path_or_repo_id"):
        resolve_checkpoint_dir(bad, None)


# ----------------------------------------------------------------------------- sizes


def test_check_memory_refuses_what_cannot_fit(monkeypatch, tmp_path):
    from bayeslayer import checks
    from bayeslayer.experiments.common.options import check_memory, memory_size

    assert memory_size() > 2**20
    check_memory(1024, what="a small batch")
    with pytest.raises(UsageError, match=r"--T 9 needs at least 1000.0 TB of memory, more than this machine's"):
        check_memory(1e15, what="--T 9")
    limit = tmp_path / "memory.max"  # a container's limit below the machine's memory counts
    limit.write_text("1000000\n")
    monkeypatch.setattr(checks, "_CGROUP_LIMITS", (str(limit),))  # the one memory check lives there
    assert memory_size() == 1_000_000
    limit.write_text("max\n")  # no limit
    assert memory_size() > 1_000_000


def test_integer_arguments_are_bounded_to_int64():
    import argparse

    from bayeslayer.checks import INT_MAX
    from bayeslayer.experiments.common.options import int_arg, positive_int_arg

    assert positive_int_arg(str(INT_MAX)) == INT_MAX and int_arg("-5") == -5
    for text, conv in ((str(INT_MAX + 1), positive_int_arg), ("99999999999999999999", int_arg),
                       ("0", positive_int_arg)):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer in"):
            conv(text)
