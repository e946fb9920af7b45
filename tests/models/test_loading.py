"""Every loader of the package loads a model folder whole or not at all (bayeslayer.models.loading).

The loaders: ``BayesLayerForCausalLM.from_pretrained``, ``AutoModelForCausalLM.from_pretrained``,
``models.pretrained.load_model`` (``niah``, ``heldout``), ``training.distillation.load_teacher``,
``heldout``'s model handle and ``lm.load_run`` (``lm eval``, ``heldout`` on a run folder).  Each must refuse a
folder with a missing tensor, a config claiming an extra layer, tensors with no place, a config that disagrees
with the weights' shapes, a flipped byte (folders the package wrote carry a SHA-256 manifest), a wrong
``model_type``, NaN weights and an empty ``config.json`` — with a message naming the problem — where
transformers alone would load uninitialised memory with a log line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.models.loading import MANIFEST_KEY, verify_model_dir, write_model_manifest

from ..model_folders import (
    DAMAGES,
    apply_damage,
    edit_config,
    flip_byte,
    tiny_model,
    write_lm_run,
    write_remote_code_folder,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A save_pretrained folder and an lm run folder (final/ as `lm train` writes it) of one tiny model."""
    root = tmp_path_factory.mktemp("saved")
    model = tiny_model()
    model.save_pretrained(root / "model")
    write_lm_run(model, root / "run")
    return {"model": root / "model", "run": root / "run"}


def _heldout(kind: str):
    from bayeslayer.evaluation.heldout import HeldoutModel

    def load(path: Path):
        return HeldoutModel("m", path, kind, path / "final" if kind == "lm-run" else path, None, "", "", "").load()
    return load


def _niah(path: Path):
    from bayeslayer.models.pretrained import load_model

    return load_model(path)


def _teacher(path: Path):
    from bayeslayer.training.distillation import load_teacher

    return load_teacher(path)


def _run(path: Path):
    from bayeslayer.training.lm import load_run

    return load_run(path)[1]


# loader name -> (which saved folder, loader); a model folder's loaders get the folder, a run's the run
LOADERS = {
    "from_pretrained": ("model", BayesLayerForCausalLM.from_pretrained),
    "AutoModelForCausalLM": ("model", AutoModelForCausalLM.from_pretrained),
    "pretrained.load_model": ("model", _niah),
    "distill.load_teacher": ("model", _teacher),
    "heldout (model folder)": ("model", _heldout("hf")),
    "lm.load_run": ("run", _run),
    "heldout (run folder)": ("run", _heldout("lm-run")),
}


def _model_dir(root: Path, which: str) -> Path:
    return root / "final" if which == "run" else root


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_loads_an_intact_folder(saved, tmp_path, loader):
    which, load = LOADERS[loader]
    root = tmp_path / which
    shutil.copytree(saved[which], root)
    model = load(root)
    assert isinstance(model, BayesLayerForCausalLM)
    assert verify_model_dir(_model_dir(root, which))


# transformers' own AutoModelForCausalLM reads config.json before our class is chosen: a llama config builds
# transformers' Llama (its errors are its own), and an empty config.json is its "not a valid JSON file" error
# naming the file.  The project's AutoModel path (models.pretrained.load_model) refuses both in its own words.
NOT_OURS = {("AutoModelForCausalLM", "wrong model_type"), ("AutoModelForCausalLM", "empty config.json, manifest kept")}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_refuses_a_damaged_folder_naming_the_problem(saved, tmp_path, loader, damage):
    if (loader, damage) in NOT_OURS:
        pytest.skip("transformers' own loader decides before bayeslayer's class is involved")
    which, load = LOADERS[loader]
    root = tmp_path / which
    shutil.copytree(saved[which], root)
    directory = _model_dir(root, which)
    needles = apply_damage(directory, damage)
    with pytest.raises((ValueError, OSError)) as info:
        load(root)
    message = str(info.value)
    assert "\n" not in message.strip(), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert str(directory) in message or str(root) in message, message


def test_from_pretrained_keeps_the_loading_report_and_the_caller_can_opt_out_of_sizes(saved, tmp_path):
    model, info = BayesLayerForCausalLM.from_pretrained(saved["model"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    edit_config(directory, vocab_size=60)
    write_model_manifest(directory)
    with pytest.raises(ValueError, match="shape"):
        BayesLayerForCausalLM.from_pretrained(directory)


def test_sizes_the_caller_opts_out_of_are_freshly_initialised_not_left_as_uninitialised_memory(saved, tmp_path):
    """``ignore_mismatched_sizes=True``: the tensors whose shapes differ are initialised as a new model's are
    (a mixer's by its constructor), so the model is finite, and the report lists them."""
    import torch

    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    edit_config(directory, hidden_size=64)
    write_model_manifest(directory)
    model, info = BayesLayerForCausalLM.from_pretrained(directory, ignore_mismatched_sizes=True,
                                                        output_loading_info=True)
    assert len(info["mismatched_keys"]) == 29
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    fresh = BayesLayerForCausalLM(model.config).state_dict()
    loaded = model.state_dict()
    for name, *_ in info["mismatched_keys"]:  # each spread as a new model's (a constructor's own init)
        assert loaded[name].shape == fresh[name].shape
        torch.testing.assert_close(loaded[name].std(), fresh[name].std(), rtol=0.3, atol=1e-6, msg=name)


def _as_older_folder(directory: Path) -> None:
    """``directory`` as a folder of another library or an older version: no manifest, and no word of one."""
    import json

    (directory / "manifest.json").unlink(missing_ok=True)
    config = json.loads((directory / "config.json").read_text())
    del config[MANIFEST_KEY]
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("which", ["model", "run"])
def test_every_folder_the_package_writes_says_in_its_config_that_it_has_a_manifest(saved, which):
    import json

    directory = _model_dir(saved[which], which)
    assert json.loads((directory / "config.json").read_text())[MANIFEST_KEY] == "manifest.json"
    assert verify_model_dir(directory)
    assert not hasattr(BayesLayerConfig.from_pretrained(directory), MANIFEST_KEY)  # a fact of the folder only


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_pickle_weight_file_is_refused_before_torch_reads_it(saved, tmp_path, loader, monkeypatch):
    import torch

    which, load = LOADERS[loader]
    root = tmp_path / which
    shutil.copytree(saved[which], root)
    apply_damage(_model_dir(root, which), "pickle weights")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read the pickle"))
    with pytest.raises(ValueError, match="pytorch_model.bin.*pickle"):
        load(root)


def test_save_pretrained_signs_the_folder_and_a_folder_without_manifest_still_loads(saved, tmp_path):
    assert (saved["model"] / "manifest.json").is_file()
    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    _as_older_folder(directory)
    assert not verify_model_dir(directory)
    BayesLayerForCausalLM.from_pretrained(directory)
    (directory / "README.md").write_text("added later")
    write_model_manifest(directory)
    (directory / "tokenizer.json").write_text("{}")  # a file added after signing is allowed
    BayesLayerForCausalLM.from_pretrained(directory)


def test_the_package_writes_model_folders_for_generation_on_the_cache(saved, tmp_path):
    """``save_model_dir`` (``lm train``'s and the retrofit's checkpoints and final/) writes ``use_cache: true``
    even for a model whose config says false (one copied from an older folder), and leaves the model alone;
    ``save_pretrained`` of a default config says true as well."""
    import json

    from bayeslayer.models.loading import save_model_dir

    model = tiny_model(use_cache=False)
    save_model_dir(model, tmp_path / "dir")
    assert json.loads((tmp_path / "dir" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False
    assert BayesLayerForCausalLM.from_pretrained(tmp_path / "dir").generation_config.use_cache is True
    assert json.loads((saved["model"] / "config.json").read_text())["use_cache"] is True


def test_load_run_warns_when_final_has_no_manifest(saved, tmp_path):
    from bayeslayer.training.lm import load_run

    root = tmp_path / "run"
    shutil.copytree(saved["run"], root)
    (root / "final" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="manifest.json is missing"):  # the folder says it had one
        load_run(root)
    _as_older_folder(root / "final")
    with pytest.warns(RuntimeWarning, match="no manifest.json"):
        load_run(root)


def test_export_auto_map_re_signs_an_intact_folder_and_refuses_a_damaged_one(saved, tmp_path):
    from bayeslayer.evaluation.autoload import export_auto_map

    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    export_auto_map(directory)
    assert verify_model_dir(directory)
    BayesLayerForCausalLM.from_pretrained(directory)
    flip_byte(directory)
    with pytest.raises(ValueError, match="SHA-256"):
        export_auto_map(directory)


def test_remote_code_is_refused_without_a_prompt(tmp_path, monkeypatch):
    """A folder whose config maps an unknown model type to its own .py file: nothing runs, nobody is asked."""
    from bayeslayer.models.pretrained import load_model

    marker = tmp_path / "code-ran"
    directory = write_remote_code_folder(tmp_path / "evil", marker)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked on the terminal"))
    with pytest.raises(ValueError, match="asks to run Python code") as info:
        load_model(directory)
    assert "trust_remote_code" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_a_known_model_type_with_auto_map_runs_no_folder_code(saved, tmp_path, monkeypatch):
    """Our own export_auto_map folder loads through the installed code; its shim is not imported."""
    from bayeslayer.evaluation.autoload import SHIM_FILE, export_auto_map
    from bayeslayer.models.pretrained import load_model

    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    export_auto_map(directory)
    marker = tmp_path / "shim-ran"
    (directory / SHIM_FILE).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    write_model_manifest(directory)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked on the terminal"))
    assert isinstance(load_model(directory), BayesLayerForCausalLM)
    assert not marker.exists()


def test_a_gated_deltanet_folder_with_damaged_weights_is_named(tmp_path):
    from bayeslayer.models import load_gdn_checkpoint

    from .test_fla_import import fla_model

    directory = tmp_path / "gdn"
    fla_model().save_pretrained(directory)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:64])
    with pytest.raises(ValueError, match=f"{path} is damaged or not a safetensors file"):
        load_gdn_checkpoint(directory)


def test_the_config_alone_refuses_another_model_type(saved, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    assert BayesLayerConfig.from_pretrained(directory).num_hidden_layers == 2
    edit_config(directory, model_type="llama")
    with pytest.raises(ValueError, match="model_type 'llama', not 'bayeslayer'"):
        BayesLayerConfig.from_pretrained(directory)
