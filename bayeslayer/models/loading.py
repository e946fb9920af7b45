"""Strict, verified loading of model folders: what every loader of the package checks.

A model folder loads whole or not at all.  Each of the package's loaders
(:meth:`BayesLayerPreTrainedModel.from_pretrained <bayeslayer.models.BayesLayerPreTrainedModel.from_pretrained>`,
``bayeslayer.training.lm.load_run``, ``bayeslayer.models.pretrained.load_model`` (``niah``, ``heldout``,
the distillation teacher), :func:`~bayeslayer.models.load_gdn_checkpoint`) refuses, with one message that
names the folder and the problem:

* a damaged folder the package wrote: ``manifest.json`` (the SHA-256 and size of every file, the format
  of the training checkpoints, :func:`bayeslayer.files.write_manifest`) does not match
  — one flipped byte in ``model.safetensors`` is enough;
* a folder the package wrote whose ``manifest.json`` is gone: its ``config.json`` says one was written
  (:data:`MANIFEST_KEY`), so deleting the manifest does not switch the check off;
* weights stored as a pickle (``pytorch_model.bin``, ``*.pt``): unpickling can run code, so only
  safetensors weights are read, and a pickle is refused before anything opens it;
* a ``config.json`` that is missing, empty or not JSON, or of another ``model_type``, or whose sizes
  (``vocab_size``, ``hidden_size``, ...) need more memory than the machine has (refused before allocating);
* weights that do not fill the model: a tensor the model needs and the file lacks (a config that
  claims more layers than the weights hold), a tensor the model has no place for, a shape that differs —
  checked before the values, so a config that disagrees with the weights is reported as shapes;
* weights with NaN or Inf values;
* a folder whose ``config.json`` asks to run Python code from the folder (``auto_map``) for a model
  type this installation does not know — unless the caller passed ``trust_remote_code=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..errors import SizeError
from ..files import (
    MANIFEST,
    atomic_write_text,
    read_json,
    read_safetensors,
    verify_checkpoint,
    write_manifest,
    write_safetensors,
)

#: how many names an error message lists before "and N more"
_SHOWN = 6
#: the key of ``config.json`` that says the folder has a ``manifest.json`` (every model folder the package writes)
MANIFEST_KEY = "bayeslayer_manifest"


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    head = ", ".join(items[:_SHOWN])
    return head + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def local_model_dir(path_or_id) -> Path | None:
    """``path_or_id`` as a local folder, or ``None`` (a hub id, an object, a missing path)."""
    if isinstance(path_or_id, (str, os.PathLike)) and str(path_or_id):
        path = Path(path_or_id).expanduser()
        if path.is_dir():
            return path
    return None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers logs errors only, and shows no progress bar, inside the block (its load report is
    a table of warnings, which the strict checks here turn into one error)."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _config_object(directory: Path) -> dict | None:
    """``directory/config.json`` as a dict, or None when it is missing or not a JSON object (reported elsewhere)."""
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def write_model_manifest(directory: str | os.PathLike) -> Path:
    """Write ``directory/manifest.json`` over every regular, non-hidden file of a saved model folder, after
    recording in its ``config.json`` (when that is a JSON object) that the folder has one (:data:`MANIFEST_KEY`)."""
    directory = Path(directory)
    raw = _config_object(directory)
    if raw is not None and raw.get(MANIFEST_KEY) != MANIFEST:
        atomic_write_text(directory / "config.json", json.dumps({**raw, MANIFEST_KEY: MANIFEST}, indent=2,
                                                                  sort_keys=True) + "\n")
    names = [p.name for p in directory.iterdir()
             if p.name != MANIFEST and not p.name.startswith(".") and p.is_file() and not p.is_symlink()]
    return write_manifest(directory, names)


#: the endings of weight files in pickle format (``torch.save``, ``pytorch_model.bin`` and its shards' index)
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".bin.index.json")


def refuse_pickle_weights(directory: str | os.PathLike) -> None:
    """Raise ``ValueError`` when ``directory`` holds its weights as a pickle and no safetensors file.

    Unpickling can run code (``torch.load(weights_only=True)`` narrows, but is still an unpickler), so
    the package reads safetensors weights only; the pickle is never opened.
    """
    directory = Path(directory)
    if not directory.is_dir() or any(directory.glob("*.safetensors")):
        return
    pickles = [p.name for p in directory.iterdir() if p.is_file() and p.name.endswith(PICKLE_WEIGHTS)]
    if pickles:
        raise ValueError(f"{directory} holds its weights in {_names(pickles)}, a pickle, which can run code when it "
                         "is read; bayeslayer reads safetensors weights only: convert them where you trust the file "
                         "(torch.load, then safetensors.torch.save_file to model.safetensors)")


def verify_model_dir(directory: str | os.PathLike) -> bool:
    """Check ``directory``'s ``manifest.json`` when it has one; ``True`` when it did.

    A folder without a manifest (a hub snapshot, a folder of another library or an older version)
    is not checked, unless its ``config.json`` says the package wrote one (:data:`MANIFEST_KEY`): then the
    missing manifest is a ``ValueError`` naming the folder.  One with a manifest that does not match raises
    ``ValueError`` naming the file.  Files the manifest does not list are allowed (a tokenizer or a README
    added later).  Weights stored as a pickle are refused first (:func:`refuse_pickle_weights`).
    """
    directory = Path(directory)
    refuse_pickle_weights(directory)
    if not (directory / MANIFEST).exists():
        if (_config_object(directory) or {}).get(MANIFEST_KEY):
            raise ValueError(f"{directory / MANIFEST} is missing, but {directory / 'config.json'} says bayeslayer "
                             f"wrote one ({MANIFEST_KEY}): the folder is incomplete or was changed, and its files "
                             "cannot be verified; restore it, or save the model again")
        return False
    verify_checkpoint(directory, allow_unlisted=True)
    return True


@contextlib.contextmanager
def naming_config(directory) -> Iterator[None]:
    """Inside the block, a :class:`~bayeslayer.errors.SizeError` (a config field past the machine's memory)
    names ``directory``'s ``config.json``."""
    try:
        yield
    except SizeError as exc:
        raise SizeError(f"{Path(directory) / 'config.json'}: {exc}") from None


def initialise_as_new(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Give ``model``'s tensors ``names`` the values a newly built model of its config has.

    transformers leaves a tensor it could not load (``ignore_mismatched_sizes=True``) to the model's
    ``_init_weights``, which does not reach the token mixers (each initialises itself in its constructor):
    without this, those tensors would hold uninitialised memory.
    """
    names = list(names)
    if not names:
        return
    fresh = type(model)(model.config).state_dict()
    own = model.state_dict()
    with torch.no_grad():
        for name in names:
            own[name].copy_(fresh[name].to(dtype=own[name].dtype, device=own[name].device))


def read_model_config(directory: str | os.PathLike, *, model_type: str | None = None) -> dict:
    """The parsed ``config.json`` of a model folder; missing, damaged or of another ``model_type`` is an error."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in the model folder {directory}")
    raw = read_json(path, what="model config")
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path} is not a JSON object (got {type(raw).__name__}); the folder is damaged")
    if model_type is not None and raw.get("model_type") != model_type:
        raise ValueError(f"model config {path} has model_type {raw.get('model_type')!r}, not {model_type!r}: the "
                         "folder holds another kind of model")
    return raw


def check_remote_code(directory: str | os.PathLike, raw: dict, *, trust_remote_code: bool = False) -> None:
    """Refuse a config that needs Python code from the model folder, unless ``trust_remote_code``.

    ``auto_map`` for a ``model_type`` this installation knows (ours once ``bayeslayer.models`` is
    imported, or one of transformers') is served by the installed code, so nothing from the
    folder runs and it is allowed.
    """
    if trust_remote_code or not raw.get("auto_map"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") in CONFIG_MAPPING:
        return
    raise ValueError(f"{Path(directory) / 'config.json'} asks to run Python code from {directory} (auto_map: "
                     f"{_names(str(v) for v in raw['auto_map'].values())}) for model type "
                     f"{raw.get('model_type')!r}, which this installation does not know; bayeslayer runs no code "
                     "from model folders unless you opt in (trust_remote_code=True, --trust-remote-code) for a "
                     "folder you checked")


def check_loading_info(directory, info: dict) -> None:
    """Raise ``ValueError`` when transformers' ``output_loading_info`` reports any hole in the weights."""
    parts = []
    missing = set(info.get("missing_keys") or ())
    if missing:
        parts.append(f"{len(missing)} tensor(s) the model needs are missing from the weights ({_names(missing)}; "
                     "a config that claims more layers than the weights hold, or a damaged file)")
    unexpected = set(info.get("unexpected_keys") or ())
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the weights have no place in the model ({_names(unexpected)})")
    mismatched = info.get("mismatched_keys") or ()
    if mismatched:
        shown = [f"{k[0]}: weights {tuple(k[1])} vs model {tuple(k[2])}" if isinstance(k, tuple) and len(k) == 3
                 else str(k) for k in mismatched]
        parts.append(f"{len(shown)} shape(s) differ between config and weights ({_names(shown)})")
    errors = info.get("error_msgs") or ()
    if errors:
        parts.append(" ".join(" ".join(str(e).split()) for e in errors)[:500])
    if parts:
        raise ValueError(f"cannot load the model in {directory}: " + "; ".join(parts))


def check_state_dict(directory, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                     optional: Iterable[str] = ()) -> None:
    """Compare a weights file's tensors with a model's ``state_dict``: every hole is one ``ValueError``.

    ``optional``: names the weights may lack (a tied head stored once).
    """
    optional = set(optional)
    info = {
        "missing_keys": set(expected) - set(weights) - optional,
        "unexpected_keys": set(weights) - set(expected),
        "mismatched_keys": [(k, tuple(weights[k].shape), tuple(expected[k].shape))
                            for k in sorted(set(weights) & set(expected)) if weights[k].shape != expected[k].shape],
    }
    check_loading_info(directory, info)


def check_finite(model: torch.nn.Module, directory) -> None:
    """Raise ``ValueError`` naming the tensors of ``model`` that hold NaN or Inf."""
    bad = []
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen or not tensor.is_floating_point():
            continue
        seen.add(id(tensor))
        if not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    if bad:
        raise ValueError(f"the model in {directory} has NaN or Inf values in {len(bad)} tensor(s) ({_names(bad)}); "
                         "the weights are damaged or come from a diverged run")


def safetensors_error(directory, exc: BaseException) -> ValueError:
    """A ``ValueError`` naming the weight files of ``directory`` for safetensors' own error (which names none)."""
    directory = Path(directory)
    files = sorted(p.name for p in directory.glob("*.safetensors")) or ["model.safetensors"]
    return ValueError(f"{', '.join(str(directory / f) for f in files)}: damaged or not a safetensors file "
                      f"({' '.join(str(exc).split())[:300]})")


#: The files of a model folder whose bytes are its weights (what :func:`model_files_digest` hashes).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def find_model(path: str | os.PathLike, *, name: str | None = None) -> tuple[str, Path]:
    """``(kind, model_dir)`` of a folder that holds a causal LM, found from its files without loading it.

    ``kind``: ``"lm-run"`` (an ``lm train`` run folder; the model is its ``final/``), ``"gated_deltanet"`` (a
    flash-linear-attention checkpoint) or ``"hf"`` (any other ``AutoModelForCausalLM`` folder, ours
    included).  ``name`` is how errors call the folder (default: its path).
    """
    path = Path(path)
    name = str(path) if name is None else name
    if not path.is_dir():
        raise ValueError(f"{name} is not a directory")
    if (path / "final" / "lm_config.json").is_file():
        return "lm-run", path / "final"
    if (path / "config.json").is_file():
        model_type = read_json(path / "config.json", what="model config").get("model_type")
        return ("gated_deltanet" if model_type == "gated_deltanet" else "hf"), path
    raise ValueError(f"{name} has neither config.json (a model directory) nor "
                     "final/lm_config.json (a finished `lm train` run directory)")


def model_files_digest(model_dir: str | os.PathLike) -> str:
    """SHA-256 over ``config.json`` and every weight file (:data:`WEIGHT_SUFFIXES`; names and bytes, sorted by
    name): equal digests, equal models.  A folder without a weight file raises ``ValueError``."""
    model_dir = Path(model_dir)
    files = [model_dir / "config.json"] + sorted(p for p in model_dir.iterdir()
                                                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if len(files) == 1:
        raise ValueError(f"models: {model_dir} has config.json but no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


__all__ = [
    "MANIFEST_KEY", "PICKLE_WEIGHTS", "WEIGHT_SUFFIXES", "check_finite", "check_loading_info", "check_remote_code",
    "check_state_dict", "find_model", "initialise_as_new", "local_model_dir", "model_files_digest", "naming_config",
    "quiet_transformers", "read_model_config", "refuse_pickle_weights", "safetensors_error", "verify_model_dir",
    "write_model_manifest",
]


def save_model_dir(model, directory: Path) -> None:
    """An HF model directory: ``config.json`` and ``model.safetensors`` (a tied head stored once).

    The saved config has ``use_cache: true`` whatever ``model.config`` says (a model copied from an older
    folder may say false): ``generate()``, ``pipeline`` and lm-eval read it, and without it every new token
    re-runs the whole prefix.  ``model`` itself is left as it is.  A failed write (a full disk) is an
    ``OSError`` naming the file."""
    import copy

    config = copy.deepcopy(model.config)
    config.use_cache = True
    config.save_pretrained(directory)
    write_safetensors(directory / "model.safetensors", model=model, metadata={"format": "pt"})

def load_model_weights(model, directory: Path) -> None:
    """Load ``model.safetensors`` of an HF model directory into ``model`` (strict, tied head allowed).

    A damaged file, a missing or extra tensor, or a shape that differs from ``model``'s (a config
    that disagrees with the weights) is one ``ValueError`` naming the file and the tensors."""
    path = Path(directory) / "model.safetensors"
    weights = read_safetensors(path)
    tied: set[str] = set()
    if model.config.tie_word_embeddings:  # safetensors stores a shared tensor under one of its names
        pairs = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(pairs) | set(pairs.values()) if isinstance(pairs, dict) else set(pairs)
    check_state_dict(path, weights, model.state_dict(), optional=tied)
    model.load_state_dict(weights, strict=False)
