"""Every loader of the package loads a model folder whole or not at all (bayeslayer.models.loading).

The loaders: ``BayesLayerForCausalLM.from_pretrained``, ``AutoModelForCausalLM.from_pretrained``,
``niah.load_model`` (``niah``, ``heldout``), ``distill.load_teacher``, ``heldout``'s model handle and
``lm.load_run`` (``lm eval``, ``heldout`` on a run folder).  Each must refuse a folder with a missing
tensor, a config claiming an extra layer, tensors with no place, a config that disagrees with the
weights' shapes, a flipped byte (folders the package wrote carry a SHA-256 manifest), a wrong
``model_type``, NaN weights and an empty ``config.json`` — with a message naming the problem — where
transformers alone would load uninitialised memory with a log line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.models.loading import verify_model_dir, write_model_manifest

CONFIG = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16)
LM_CONFIG = dict(preset="test", mixer="bayesian", hidden_size=32, num_layers=2, num_heads=2, head_dim=16,
                 source="python-docs", vocab_size=50, seq_len=16, steps=4, batch_size=2, micro_batch_size=2,
                 warmup_steps=1, eval_every=0, checkpoint_every=2)


def _model(**overrides) -> BayesLayerForCausalLM:
    torch.manual_seed(0)
    return BayesLayerForCausalLM(BayesLayerConfig(**{**CONFIG, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A save_pretrained folder and an lm run folder (final/ as `lm train` writes it) of one tiny model."""
    from bayeslayer.experiments.lm import LMConfig, save_model_dir

    root = tmp_path_factory.mktemp("saved")
    model = _model()
    model.save_pretrained(root / "model")
    final = root / "run" / "final"
    final.mkdir(parents=True)
    save_model_dir(model, final)
    (final / "lm_config.json").write_text(json.dumps(LMConfig(**LM_CONFIG).to_json()))
    write_model_manifest(final)
    return {"model": root / "model", "run": root / "run"}


def _heldout(kind: str):
    from bayeslayer.experiments.heldout import HeldoutModel

    def load(path: Path):
        return HeldoutModel("m", path, kind, path / "final" if kind == "lm-run" else path, None, "", "", "").load()
    return load


def _niah(path: Path):
    from bayeslayer.experiments.niah import load_model

    return load_model(path)


def _teacher(path: Path):
    from bayeslayer.experiments.distill import load_teacher

    return load_teacher(path)


def _run(path: Path):
    from bayeslayer.experiments.lm import load_run

    return load_run(path)[1]


# loader name -> (which saved folder, loader); a model folder's loaders get the folder, a run's the run
LOADERS = {
    "from_pretrained": ("model", BayesLayerForCausalLM.from_pretrained),
    "AutoModelForCausalLM": ("model", AutoModelForCausalLM.from_pretrained),
    "niah.load_model": ("model", _niah),
    "distill.load_teacher": ("model", _teacher),
    "heldout (model folder)": ("model", _heldout("hf")),
    "lm.load_run": ("run", _run),
    "heldout (run folder)": ("run", _heldout("lm-run")),
}


def _model_dir(root: Path, which: str) -> Path:
    return root / "final" if which == "run" else root


def _edit_weights(directory: Path, edit) -> None:
    weights = load_file(str(directory / "model.safetensors"))
    edit(weights)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _flip_byte(directory: Path) -> None:
    data = bytearray((directory / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (directory / "model.safetensors").write_bytes(bytes(data))


# damage -> (what it does to the model folder, re-sign the manifest afterwards, text the error must hold).
# Re-signing makes the folder consistent, as a folder from elsewhere (no manifest) would be, so that the
# strict checks behind the manifest are what refuses it.
DAMAGES = {
    "missing tensor": (lambda d: _edit_weights(d, lambda w: w.pop("model.layers.1.mlp.down_proj.weight")), True,
                       ["missing from the weights", "model.layers.1.mlp.down_proj.weight"]),
    "extra layer in config": (lambda d: _edit_config(d, num_hidden_layers=3), True,
                              ["missing from the weights", "model.layers.2."]),
    "fewer layers in config": (lambda d: _edit_config(d, num_hidden_layers=1), True,
                               ["no place in the model", "model.layers.1."]),
    "config disagrees with weights": (lambda d: _edit_config(d, vocab_size=60), True,
                                      ["model.embeddings.weight", "(50, 32)", "(60, 32)"]),
    "flipped byte": (_flip_byte, False, ["model.safetensors fails its SHA-256 check"]),
    "wrong model_type": (lambda d: _edit_config(d, model_type="llama"), True, ["llama"]),
    "NaN lm_head": (lambda d: _edit_weights(d, lambda w: w["lm_head.weight"].fill_(float("nan"))), True,
                    ["NaN or Inf", "lm_head.weight"]),
    "empty config.json": (lambda d: (d / "config.json").write_text(""), True, ["config.json"]),
    "empty config.json, manifest kept": (lambda d: (d / "config.json").write_text(""), False,
                                         ["config.json has 0 bytes"]),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:40]),
                          True, ["model.safetensors", "damaged or not a safetensors file"]),
}


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
# naming the file.  The project's AutoModel path (niah.load_model) refuses both in its own words.
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
    apply, resign, needles = DAMAGES[damage]
    apply(directory)
    if resign:
        write_model_manifest(directory)
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
    _edit_config(directory, vocab_size=60)
    write_model_manifest(directory)
    with pytest.raises(ValueError, match="shape"):
        BayesLayerForCausalLM.from_pretrained(directory)


def test_save_pretrained_signs_the_folder_and_a_folder_without_manifest_still_loads(saved, tmp_path):
    assert (saved["model"] / "manifest.json").is_file()
    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    (directory / "manifest.json").unlink()  # a folder of another library or an older version
    assert not verify_model_dir(directory)
    BayesLayerForCausalLM.from_pretrained(directory)
    (directory / "README.md").write_text("added later")
    write_model_manifest(directory)
    (directory / "tokenizer.json").write_text("{}")  # a file added after signing is allowed
    BayesLayerForCausalLM.from_pretrained(directory)


def test_load_run_warns_when_final_has_no_manifest(saved, tmp_path):
    from bayeslayer.experiments.lm import load_run

    root = tmp_path / "run"
    shutil.copytree(saved["run"], root)
    (root / "final" / "manifest.json").unlink()
    with pytest.warns(RuntimeWarning, match="no manifest.json"):
        load_run(root)


def test_export_auto_map_re_signs_an_intact_folder_and_refuses_a_damaged_one(saved, tmp_path):
    from bayeslayer.evaluation.autoload import export_auto_map

    directory = tmp_path / "m"
    shutil.copytree(saved["model"], directory)
    export_auto_map(directory)
    assert verify_model_dir(directory)
    BayesLayerForCausalLM.from_pretrained(directory)
    _flip_byte(directory)
    with pytest.raises(ValueError, match="SHA-256"):
        export_auto_map(directory)


def test_remote_code_is_refused_without_a_prompt(tmp_path, monkeypatch):
    """A folder whose config maps an unknown model type to its own .py file: nothing runs, nobody is asked."""
    from bayeslayer.experiments.niah import load_model

    marker = tmp_path / "code-ran"
    directory = tmp_path / "evil"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "evil_remote_model", "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                         "AutoModelForCausalLM": "evil.EvilModel"}}))
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked on the terminal"))
    with pytest.raises(ValueError, match="asks to run Python code") as info:
        load_model(directory)
    assert "trust_remote_code" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_a_known_model_type_with_auto_map_runs_no_folder_code(saved, tmp_path, monkeypatch):
    """Our own export_auto_map folder loads through the installed code; its shim is not imported."""
    from bayeslayer.evaluation.autoload import SHIM_FILE, export_auto_map
    from bayeslayer.experiments.niah import load_model

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

    from .test_checkpoint import fla_model

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
    _edit_config(directory, model_type="llama")
    with pytest.raises(ValueError, match="model_type 'llama', not 'bayeslayer'"):
        BayesLayerConfig.from_pretrained(directory)
