"""Builders of hostile folders, shared by the security tests, the loader tests and the bad-input suite.

A tiny model saved as ``save_pretrained`` writes it and as ``lm train`` writes a run; a file that a
planted symbolic link points at; a model folder that asks to run its own Python code; and the
damages a model folder can suffer (:data:`DAMAGES`), each with the text the loaders' errors must hold.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

TARGET_TEXT = "precious contents\n"

# a tiny model: two layers, so that one layer more or fewer in the config is a real disagreement
TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16)


def write_target(path: Path) -> Path:
    """The file a planted link points at; :data:`TARGET_TEXT` must still be its contents afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TARGET_TEXT)
    return path


def link(path: Path, target: Path) -> Path:
    """A symbolic link at ``path`` (its folder made) to ``target``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return path


def lm_record() -> dict:
    """An ``lm eval`` results record of one model, as ``--plot-only`` reads it."""
    from bayeslayer.experiments.lm import GROUPS, summarize_runs

    groups = {g: {"ppl": 10.0 + i, "mean_ce": 2.0, "n_tokens": 100} for i, g in enumerate(GROUPS)}
    return summarize_runs([{"run_dir": "r", "label": "m", "mixer": "bayesian", "seed": 0, "preset": "test",
                            "split": "test", "seq_len": 16, "windows": 2, "precision": "fp32", "source": "s",
                            "groups": groups, "weights_sha256": "0"}])


def write_lm_results(out: Path) -> Path:
    """An ``lm eval`` output folder holding :func:`lm_record`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm.json").write_text(json.dumps(lm_record()))
    return out


def tiny_model(**overrides):
    """A :class:`BayesLayerForCausalLM` of :data:`TINY` (overridden), seeded, in eval mode."""
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    return BayesLayerForCausalLM(BayesLayerConfig(**{**TINY, **overrides})).eval()


def write_lm_run(model, run: Path, **settings) -> Path:
    """``run/final/`` as ``lm train`` writes it for ``model`` (weights, config, lm_config.json, manifest);
    ``settings`` override the run's :class:`~bayeslayer.training.lm_config.LMConfig` (its corpus)."""
    from bayeslayer.models.loading import save_model_dir, write_model_manifest
    from bayeslayer.training.lm_config import LMConfig

    c = model.config
    final = run / "final"
    final.mkdir(parents=True)
    save_model_dir(model, final)
    config = LMConfig(preset="test", mixer="bayesian", hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                      num_heads=c.num_heads, head_dim=c.head_dim, source="python-docs", vocab_size=c.vocab_size,
                      seq_len=16, steps=4, batch_size=2, micro_batch_size=2, warmup_steps=1, eval_every=0,
                      checkpoint_every=2)
    config = replace(config, **settings)
    (final / "lm_config.json").write_text(json.dumps(config.to_json()))
    write_model_manifest(final)
    return run


def write_remote_code_folder(directory: Path, marker: Path) -> Path:
    """A model folder whose config maps an unknown model type to its own ``.py`` file; running that file
    creates ``marker``."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "evil_remote_model", "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                         "AutoModelForCausalLM": "evil.EvilModel"}}))
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return directory


def edit_weights(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    edit(weights)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def flip_byte(directory: Path) -> None:
    """One flipped bit near the end of ``model.safetensors`` (in a weight, not in its header)."""
    data = bytearray((directory / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (directory / "model.safetensors").write_bytes(bytes(data))


def diverge(model):
    """``model`` with 64 values of ``lm_head`` times 2¹²⁸: still finite (a diverged run, not a damaged file),
    but its cross-entropies are ~1e37, far past what ``exp`` can take."""
    with torch.no_grad():
        head = model.lm_head.weight.view(-1)
        head[:64] *= 2.0 ** 64
        head[:64] *= 2.0 ** 64  # in two steps: 2**128 itself is past float32's largest number
    assert bool(torch.isfinite(model.lm_head.weight).all())
    return model


def scale_then_drop_manifest(directory: Path) -> None:
    """The weights of :func:`diverge`, then ``manifest.json`` deleted: the folder's ``config.json`` still says
    a manifest was written."""
    def scale(weights):
        head = weights["lm_head.weight"].view(-1)
        head[:64] *= 2.0 ** 64
        head[:64] *= 2.0 ** 64
    edit_weights(directory, scale)
    (directory / "manifest.json").unlink()


def pickle_weights(directory: Path) -> None:
    """``model.safetensors`` replaced by a pickle ``pytorch_model.bin`` of the same tensors."""
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model.safetensors"))
    torch.save(weights, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


# damage -> (what it does to a model folder of TINY, re-sign the manifest afterwards, texts the error must
# hold).  Re-signing makes the folder consistent, as a folder from elsewhere (no manifest) would be, so that
# the strict checks behind the manifest are what refuses it.
DAMAGES = {
    "missing tensor": (lambda d: edit_weights(d, lambda w: w.pop("model.layers.1.mlp.down_proj.weight")), True,
                       ["missing from the weights", "model.layers.1.mlp.down_proj.weight"]),
    "extra layer in config": (lambda d: edit_config(d, num_hidden_layers=3), True,
                              ["missing from the weights", "model.layers.2."]),
    "fewer layers in config": (lambda d: edit_config(d, num_hidden_layers=1), True,
                               ["no place in the model", "model.layers.1."]),
    "config disagrees with weights": (lambda d: edit_config(d, vocab_size=60), True,
                                      ["model.embeddings.weight", "(50, 32)", "(60, 32)"]),
    "flipped byte": (flip_byte, False, ["model.safetensors fails its SHA-256 check"]),
    "wrong model_type": (lambda d: edit_config(d, model_type="llama"), True, ["llama"]),
    "NaN lm_head": (lambda d: edit_weights(d, lambda w: w["lm_head.weight"].fill_(float("nan"))), True,
                    ["NaN or Inf", "lm_head.weight"]),
    "empty config.json": (lambda d: (d / "config.json").write_text(""), True, ["config.json"]),
    "empty config.json, manifest kept": (lambda d: (d / "config.json").write_text(""), False,
                                         ["config.json has 0 bytes"]),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:40]),
                          True, ["model.safetensors", "damaged or not a safetensors file"]),
    # a deleted manifest does not switch the verification off: config.json says one was written
    "manifest deleted, weights scaled": (scale_then_drop_manifest, False, ["manifest.json", "is missing"]),
    # a pickle is refused before anything reads it (re-signed: a consistent folder, as one from elsewhere)
    "pickle weights": (pickle_weights, True, ["pytorch_model.bin", "pickle"]),
    # every mixer tensor differs in shape: reported as shapes, not as the uninitialised memory left in their place
    "hidden size in config differs": (lambda d: edit_config(d, hidden_size=64), True,
                                      ["shape(s) differ", "lm_head.weight", "(50, 32)", "(50, 64)"]),
    # a size no memory holds: refused naming the field and the file, before anything is allocated
    "vocab_size past memory": (lambda d: edit_config(d, vocab_size=10**12), True,
                               ["vocab_size", "needs at least", "config.json"]),
}


def apply_damage(directory: Path, name: str) -> list[str]:
    """Apply :data:`DAMAGES` ``[name]`` to the model folder ``directory``; the texts its error must hold."""
    from bayeslayer.models.loading import write_model_manifest

    apply, resign, needles = DAMAGES[name]
    apply(directory)
    if resign:
        write_model_manifest(directory)
    return needles
