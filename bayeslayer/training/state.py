"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

:func:`save_state` splits a nested object (optimizer and scheduler ``state_dict``, step, losses,
RNG states) into ``<name>.json`` and ``<name>.safetensors``; :func:`load_state` puts it back
exactly.  Neither file can run code when read: safetensors holds raw tensor bytes behind a JSON
header, and the JSON is decoded by the rules below, never by ``pickle``.

JSON encoding of what JSON lacks (every other value is itself):

* a ``torch.Tensor`` → ``{"__tensor__": key}``, its bytes in the safetensors file under ``key``;
* a ``tuple`` → ``{"__tuple__": [...]}`` (``random.getstate()`` must come back as tuples);
* a ``numpy.ndarray`` → ``{"__ndarray__": [...], "dtype": str}`` (NumPy's RNG key, 624 words);
* a ``dict`` with a key that is not a ``str`` or starts with ``__`` → ``{"__items__": [[k, v], ...]}``
  (an optimizer's ``state`` is keyed by parameter index).

Floats are written with ``repr`` precision (``json`` round-trips them exactly; ``NaN``/``Infinity``
as Python's ``json`` spells them), so a resumed run continues bit for bit.

Also here: the RNG states of a process (:func:`rng_state`, :func:`set_rng_state`), :func:`seed_everything`
(Python, NumPy and torch from one seed) and :func:`weights_digest` (a model's weights as one SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import read_safetensors, write_safetensors

_MARKERS = ("__tensor__", "__tuple__", "__ndarray__", "__items__")


def encode_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-able structure and the flat ``{key: tensor}`` it refers to."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            # safetensors refuses two entries on one storage and views of a larger one: store copies
            span = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if span in seen or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.contiguous().clone()
            seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            key = str(len(tensors))
            tensors[key] = t
            return {"__tensor__": key}
        if isinstance(x, np.ndarray):
            return {"__ndarray__": x.tolist(), "dtype": x.dtype.str}
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v) for k, v in x.items()}
            return {"__items__": [[enc(k), enc(v)] for k, v in x.items()]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot store a {type(x).__name__} in a checkpoint (tensors, numbers, strings, "
                        "lists, tuples, dicts and NumPy arrays only)")

    return enc(obj), tensors


def decode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Invert :func:`encode_state`; an unknown tensor key raises ``KeyError`` naming it."""
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if key not in tensors:
                raise KeyError(f"the state refers to tensor {key!r}, which its safetensors file lacks")
            return tensors[key]
        if "__tuple__" in obj:
            return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        if "__items__" in obj:
            return {decode_state(k, tensors): decode_state(v, tensors) for k, v in obj["__items__"]}
        return {k: decode_state(v, tensors) for k, v in obj.items()}
    return obj


def save_state(directory: str | Path, name: str, obj: Any) -> list[Path]:
    """Write ``obj`` as ``directory/<name>.json`` and ``directory/<name>.safetensors``; returns both paths.

    Plain writes, meant for a checkpoint's temporary directory: :meth:`CheckpointStore.save
    <bayeslayer.training.checkpoint.CheckpointStore.save>` fsyncs them and makes the directory
    appear atomically.
    """
    directory = Path(directory)
    encoded, tensors = encode_state(obj)
    weights = directory / f"{name}.safetensors"
    write_safetensors(weights, tensors, metadata={"format": "pt"})
    meta = directory / f"{name}.json"
    meta.write_text(json.dumps({"format": "bayeslayer-state-1", "state": encoded}) + "\n", encoding="utf-8")
    return [meta, weights]


def load_state(directory: str | Path, name: str) -> Any:
    """Read what :func:`save_state` wrote; a damaged file raises ``ValueError`` naming it."""
    directory = Path(directory)
    meta, weights = directory / f"{name}.json", directory / f"{name}.safetensors"
    try:
        doc = json.loads(meta.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != "bayeslayer-state-1":
            raise ValueError("not a bayeslayer state file")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{meta} is damaged or not a training state ({exc})") from exc
    tensors = read_safetensors(weights)
    try:
        return decode_state(doc["state"], tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{meta} does not match {weights.name} ({exc})") from exc


def rng_state(device: torch.device | str | None = None) -> dict:
    """This process's RNG states: Python, NumPy (legacy global), torch CPU and, on CUDA, the device's."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Restore what :func:`rng_state` returned (also after a round trip through :func:`save_state`)."""
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch"])
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (call before building a model)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer in ``state_dict`` order: equal digests = equal weights."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
