"""The bad-input suite: bad command lines and bad API calls as data, each run and classified.

A case is one line of a table: a command line (:class:`Cli`, run in this process through
``bayeslayer.cli.main``) or a Python call (:class:`Api`), with the text its error must hold.  Each
run ends in one of five outcomes:

* ``clear``: the CLI exits 2 with exactly one stderr line holding ``error:`` and the text (no
  traceback); the API raises ``ValueError`` or ``TypeError`` whose message holds the text;
* ``unclear``: the same exit (or exception type) but a message without the text, or more lines;
* ``silent``: exit 0, or the call returns: a bad input was accepted; also a clear refusal after
  which the case's own check (``after``) finds a trace of the input's effect (the file a planted
  link points at changed, a folder's code ran, a file written outside ``--out``);
* ``traceback``: any other exception, or exit code 1;
* ``hang``: still running after the case's timeout (a ``SIGALRM`` stops it), or a question asked on
  the terminal (``input()``), where a batch job would wait for ever.

A few cases are unusual but *valid* inputs that once ended in a traceback (a diverged but finite model, an
empty sequence in ``cu_seqlens``, a ``chunk_size`` past the sequence): such a case has an ``expect`` check
instead, and is ``clear`` when the command exits 0 (the call returns) and the check finds the right answer,
``silent`` when it finds a wrong one, ``unclear`` when a CLI refuses it, ``traceback`` on any exception.

Every case must be ``clear``.  The default test run covers the cases of this file that are not marked
``slow``; ``python -m tests.test_bad_inputs`` runs every case, these and the tables of
``tests/test_cli.py``, ``tests/ops/test_bad_input.py`` and ``tests/design/test_design_bad_input.py``
(run there by their own tests), and prints the counts table of docs/reliability.md, which
:func:`test_the_docs_table_is_what_the_suite_counts` compares with the docs.

Adding a case is one line in :data:`CLI_CASES` or :data:`API_CASES`.  ``{name}`` in a command line
is a path from :func:`make_places` (write JSON braces as ``{{`` and ``}}``).  The hostile folders
(planted links, a folder asking to run its own code, damaged model folders) are built by
``tests/model_folders.py``, shared with ``tests/test_cli_security.py`` and ``tests/models/test_loading.py``.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.model_folders import DAMAGES

OUTCOMES = ("clear", "unclear", "silent", "traceback", "hang")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


@dataclass(frozen=True)
class Cli:
    """``bayeslayer <argv>`` must exit 2 with one stderr line holding ``needle``."""

    category: str
    argv: str  # shell words; {name} is a path of make_places()
    needle: str
    slow: bool = False
    timeout: float = 300.0
    after: Callable[[dict], str | None] | None = None  # a trace of the input's effect, or None
    expect: Callable[[dict], str | None] | None = None  # a valid input: what is wrong with its output, or None

    @property
    def surface(self) -> str:
        return "CLI"

    @property
    def label(self) -> str:
        return self.argv


@dataclass(frozen=True)
class Api:
    """``call(places)`` must raise ``ValueError`` or ``TypeError`` whose message holds ``needle``
    (a plain text or a regular expression)."""

    category: str
    name: str
    call: Callable[[dict], object]
    needle: str
    slow: bool = False
    timeout: float = 120.0
    after: Callable[[dict], str | None] | None = None
    expect: Callable[[object], str | None] | None = None  # a valid input: what is wrong with the result, or None

    @property
    def surface(self) -> str:
        return "Python API"

    @property
    def label(self) -> str:
        return self.name


# ----------------------------------------------------------------------------- the prepared places

RESULT_NAMES = {"niah": "niah", "collision": "collision", "recall": "recall", "crowding": "crowding",
                "mqar_base": "mqar", "lm": "lm", "heldout": "heldout"}


def make_places(root: Path) -> dict[str, str]:
    """The files and folders the cases name, under ``root``."""
    from tests.experiments.corpus import write_word_corpus

    root.mkdir(parents=True, exist_ok=True)
    places = {}

    def folder(name: str) -> Path:
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        places[name] = str(path)
        return path

    a_file = root / "a_file"
    a_file.write_text("x")
    places.update(file=str(a_file), missing=str(root / "missing"), below_file=str(a_file / "sub"),
                  new=str(root / "new"), lm_run=str(root / "lm_run"))  # {new} must never be created; a run may be
    folder("empty")
    # --plot-only inputs: damaged, an empty object, the right "experiment" and nothing else, wrong types
    corrupt, shapeless, keyless, mistyped = (folder(name) for name in ("corrupt", "shapeless", "keyless", "mistyped"))
    for stem, experiment in RESULT_NAMES.items():
        (corrupt / f"{stem}.json").write_bytes(b"\x80{not json")
        (shapeless / f"{stem}.json").write_text("{}")
        (keyless / f"{stem}.json").write_text(f'{{"experiment": "{experiment}"}}')
        (mistyped / f"{stem}.json").write_text(f'{{"experiment": "{experiment}", "models": 3, "config": 3, '
                                               '"results": 3, "collision": 3}')
    # a model folder whose config.json is damaged, and a run whose final/lm_config.json is
    bad_model = folder("bad_model")
    (bad_model / "config.json").write_text('{"model_type": "bayeslayer", ')
    (bad_model / "tokenizer.json").write_text(_tokenizer_json())
    bad_run = folder("bad_run") / "final"
    bad_run.mkdir()
    (bad_run / "lm_config.json").write_bytes(b"\x80\x81")
    (bad_run / "config.json").write_text("{}")
    (bad_run / "model.safetensors").write_bytes(b"")
    from bayeslayer.models.loading import write_model_manifest

    write_model_manifest(bad_run)  # signed as it is: the damaged JSON, not the manifest, is what is refused
    # a model folder that loads as far as the size checks (a config.json and a tokenizer)
    model = folder("model")
    (model / "config.json").write_text('{"model_type": "bayeslayer", "hidden_size": 64}')
    (model / "tokenizer.json").write_text(_tokenizer_json())
    places["tokenizer"] = str(model / "tokenizer.json")
    places["corpus"] = str(write_word_corpus(root / "corpus", {"train": 4, "validation": 2, "test": 2}, sentences=4))
    places.update(make_hostile_places(root), root=str(root), t0=str(time.time() - 1))
    return places


def _fla_model():
    from tests.models.test_fla_import import fla_model

    return fla_model()


def _gdn_edit(**changes):
    return lambda d: _model_folders().edit_config(d, **changes)


def _gdn_weights(edit):
    return lambda d: _model_folders().edit_weights(d, edit)


# a flash-linear-attention Gated DeltaNet folder has no manifest of ours, so a flipped byte in it cannot be
# told from a trained weight: damage -> (what it does, the text the error must hold)
GDN_DAMAGES = {
    "missing tensor": (_gdn_weights(lambda w: w.pop("model.layers.1.mlp.down_proj.weight")),
                       "missing from the checkpoint: ['model.layers.1.mlp.down_proj.weight']"),
    "extra layer in config": (_gdn_edit(num_hidden_layers=3), "missing from the checkpoint: ['model.layers.2."),
    "config disagrees with weights": (_gdn_edit(vocab_size=60), "checkpoint (80, 32) vs model (60, 32)"),
    "wrong model_type": (_gdn_edit(model_type="llama"), "model_type 'gated_deltanet', got 'llama'"),
    "NaN lm_head": (_gdn_weights(lambda w: w["lm_head.weight"].fill_(float("nan"))), "NaN or Inf values"),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:64]),
                          "damaged or not a safetensors file"),
    "pickle weights": (lambda d: _model_folders().pickle_weights(d), r"pytorch_model\.bin.*pickle"),
}


def slug(text: str) -> str:
    """``text`` as a place name (``{dmg_model_flipped_byte}``)."""
    return re.sub(r"\W+", "_", text).strip("_")


def make_hostile_places(root: Path) -> dict[str, str]:
    """Planted links, a folder that asks to run its own code, and damaged copies of one tiny model, under
    ``root``: a model folder (``dmg_model_<damage>``), a run (``dmg_run_<damage>``) and a flash-linear-attention
    Gated DeltaNet folder (``dmg_gdn_<damage>``) for each damage of :data:`GDN_DAMAGES` and
    :data:`tests.model_folders.DAMAGES`."""
    import shutil

    from tests.model_folders import (
        apply_damage,
        link,
        tiny_model,
        write_lm_results,
        write_lm_run,
        write_remote_code_folder,
        write_target,
    )

    places = {}
    target = write_target(root / "elsewhere" / "precious.txt")
    places["target"] = str(target)
    # a lock file, a runs lock, a report file and a --json file, each a link to the target
    places["lock_run"] = str(link(root / "lock_run" / ".lock", target).parent)
    places["runs_lock"] = str(link(root / "runs_lock" / "runs" / ".lock", target).parents[1])
    places["linked_results"] = str(write_lm_results(root / "linked_results"))
    link(root / "linked_results" / "lm.md", target)
    places["budget_link"] = str(link(root / "budget" / "configs.json", target))
    places["lm_results"] = str(write_lm_results(root / "lm_results"))
    places["evil"] = str(write_remote_code_folder(root / "evil", root / "evil-code-ran"))
    places["evil_marker"] = str(root / "evil-code-ran")
    # one tiny model, saved as save_pretrained and as lm train write it, then copied and damaged
    model = tiny_model()
    model.save_pretrained(root / "tiny_model")
    # a file added after signing is allowed; heldout and distill need an end-of-text token
    (root / "tiny_model" / "tokenizer.json").write_text(_tokenizer_json("the cat sat on a mat </s>"))
    places["tiny_model"] = str(root / "tiny_model")
    places["tiny_run"] = str(write_lm_run(model, root / "tiny_run"))
    for damage in DAMAGES:
        model_dir, run = root / f"dmg_model_{slug(damage)}", root / f"dmg_run_{slug(damage)}"
        shutil.copytree(root / "tiny_model", model_dir)
        shutil.copytree(root / "tiny_run", run)
        apply_damage(model_dir, damage)
        apply_damage(run / "final", damage)
        places[model_dir.name], places[run.name] = str(model_dir), str(run)
    # a diverged but finite model, as a model folder and as a run whose corpus is the written one
    from tests.model_folders import diverge

    diverge(tiny_model()).save_pretrained(root / "div_model")
    (root / "div_model" / "tokenizer.json").write_text(_tokenizer_json("the cat sat on a mat </s>"))
    places["div_model"] = str(root / "div_model")
    places["div_run"] = str(write_lm_run(diverge(tiny_model(vocab_size=300)), root / "div_run",
                                         source=str(root / "corpus"), vocab_size=300))
    places["div"] = str(root / "div")  # the evaluations' output folders
    # a finished run on the written corpus, which `lm eval` must only read
    places["plain_run"] = str(write_lm_run(tiny_model(vocab_size=300), root / "plain_run",
                                           source=str(root / "corpus"), vocab_size=300))
    # output folders another writer holds (this process: two locks of one folder exclude each other in one
    # process too), one of them a distillation folder for `distill eval`
    from bayeslayer.training import OutputLock

    busy_distill = root / "busy_distill"
    shutil.copytree(root / "tiny_model", busy_distill / "phase_b" / "final")
    (busy_distill / "distill.json").write_text(f'{{"teacher_dir": "{root / "tiny_model"}", "stages": {{}}}}')
    for name in ("busy", "busy_distill"):
        _HELD.append(OutputLock(root / name).acquire())
        places[name] = str(root / name)
        places[f"{name}_files"] = " ".join(_tree(root / name))
    gdn = _fla_model()
    for damage, (apply, _) in GDN_DAMAGES.items():
        directory = root / f"dmg_gdn_{slug(damage)}"
        gdn.save_pretrained(directory)
        apply(directory)
        places[directory.name] = str(directory)
    return places


# the locks of the busy output folders, held while this process runs the cases
_HELD: list = []


def _tokenizer_json(words: str = "the cat sat on a mat") -> str:
    import tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words.split())}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tk.to_str()


# ----------------------------------------------------------------------------- the cases

LM = "lm train --preset tiny --source {corpus} --vocab-size 300"  # a run that would start at once
BIG = "99999999999999999999"  # > 2**63

NAMES = ["../../x", "/tmp/x", "sub/x", ""]  # --name values that would leave --out, or name no file


def _every(*texts: str, pattern: str = "") -> str:
    """A needle (regular expression) that holds when every one of ``texts``, and ``pattern``, is in the message."""
    return "".join(f"(?=.*{re.escape(t)})" for t in texts) + (f"(?=.*{pattern})" if pattern else "")


def _target_kept(places: dict, link_path: str) -> str | None:
    from tests.model_folders import TARGET_TEXT

    if Path(places["target"]).read_text() != TARGET_TEXT:
        return "the file the planted link points at was changed"
    if not (Path(places["root"]) / link_path).is_symlink():
        return f"{link_path} was replaced"
    return None


def _no_name_written(places: dict) -> str | None:
    root, since = Path(places["root"]), float(places["t0"])
    written = [path for path in (*root.rglob("x.*"), *root.parent.glob("x.*"), *Path("/tmp").glob("x.*"),
                                 *root.rglob(".json"), *root.rglob(".md"))
               if path.stat().st_mtime >= since]
    return f"written: {written}" if written else None


def _inf_ppl(record: str, *keys: str) -> Callable[[dict], str | None]:
    """A check of a valid run: the JSON ``record`` (a path with places) holds ``inf`` under each of ``keys``
    somewhere, read back as JSON, and every other perplexity is finite."""
    import json

    def found(obj, key):
        if isinstance(obj, dict):
            return [v for k, v in obj.items() if k == key] + [x for v in obj.values() for x in found(v, key)]
        return [x for v in obj for x in found(v, key)] if isinstance(obj, list) else []

    def check(places: dict) -> str | None:
        path = Path(record.format(**places))
        if not path.is_file():
            return f"{path} was not written"
        data = json.loads(path.read_text())
        for key in keys:
            if math.inf not in found(data, key):
                return f"no {key} of inf in {path}: {found(data, key)[:6]}"
        if any(isinstance(v, float) and math.isnan(v) for v in found(data, "ppl")):
            return f"a perplexity of NaN in {path}"
        return None
    return check


def _tree(folder: Path) -> list[str]:
    """Every path under ``folder``, relative to it, with each file's size."""
    return sorted(f"{p.relative_to(folder)}:{p.stat().st_size if p.is_file() else '/'}" for p in folder.rglob("*"))


def _busy_untouched(place: str) -> Callable[[dict], str | None]:
    """A check of a refusal: the busy folder ``place`` holds what it held (its lock, a distillation's files)."""
    def check(places: dict) -> str | None:
        now = _tree(Path(places[place]))
        return None if " ".join(now) == places[f"{place}_files"] else f"{places[place]} changed: {now}"
    return check


def _run_only_read(places: dict) -> str | None:
    """A check of ``lm eval``: the run folder holds only its ``final/`` (no evaluation, no lock file)."""
    run = Path(places["plain_run"])
    extra = [p.name for p in run.iterdir() if p.name != "final"]
    return f"written into the run folder {run}: {extra}" if extra else None


def _same(pair) -> str | None:
    got, want = pair
    return None if torch.allclose(got, want, rtol=1e-5, atol=1e-6) else "a different result"


def _evil_code_not_run(places: dict) -> str | None:
    return "the folder's code ran" if Path(places["evil_marker"]).exists() else None


# command lines that load a model (a run folder or a model folder); {place} is the damaged folder
MODEL_COMMANDS = (("run", "lm eval {place} --device cpu --out {{new}}"),
                  ("model", "niah --model {place} --haystack {{corpus}} --device cpu --out {{new}}"),
                  ("model", "heldout --model {place} --device cpu --out {{new}}"),
                  ("model", "distill train --teacher {place} --device cpu --out {{new}}"))
# the CLI reads config.json before it checks the manifest: an empty one is "damaged or not JSON" there
CLI_NEEDLES = {"empty config.json, manifest kept": r"config\.json (has 0 bytes|is damaged or not JSON)"}
DAMAGED_MODEL_CASES = [
    Cli("a damaged model folder", argv.format(place=f"{{dmg_{kind}_{slug(damage)}}}"),
        _every(f"dmg_{kind}_{slug(damage)}", *([] if damage in CLI_NEEDLES else DAMAGES[damage][2]),
               pattern=CLI_NEEDLES.get(damage, "")))
    for damage in DAMAGES
    for kind, argv in MODEL_COMMANDS
]

CLI_CASES = [
    # sizes that cannot fit, integers past int64, searches that would not end
    Cli("size or overflow", "demo --T 100000000000", "needs at least"),
    Cli("size or overflow", "demo --T 99999999999999999999", "argument --T: expected an integer in"),
    Cli("size or overflow", "recall --preset tiny --batch-size 1000000000 --out {new}", "needs at least"),
    Cli("size or overflow", "crowding --preset tiny --batch-size 1000000000 --out {new}", "needs at least"),
    Cli("size or overflow", "recall --preset tiny --steps 99999999999999999999 --out {new}", "--steps"),
    Cli("size or overflow", f"{LM} --head-dim 100000000 --out {{new}}", "needs at least", slow=True),
    Cli("size or overflow", f"{LM} --seed 99999999999999999999 --out {{new}}", "argument --seed"),
    Cli("size or overflow", f"{LM} --steps 99999999999999999999 --out {{new}}", "argument --steps"),
    Cli("size or overflow", "niah --model {model} --lengths 10000000000 --out {new}", "needs at least"),
    Cli("size or overflow", f"niah --model {{model}} --seed {BIG} --out {{new}}", "seed must be an integer <="),
    Cli("size or overflow", f"heldout --model {{model}} --lengths {BIG} --out {{new}}", "lengths must be an"),
    Cli("size or overflow", f"crowding --preset tiny --seeds {BIG} --out {{new}}", "argument --seeds"),
    *[Cli("size or overflow", f"{cmd} --seeds 1000000000000 --out {{new}}", _every("--seeds", "needs at least"))
      for cmd in ("crowding --preset tiny", "recall --preset tiny", "mqar base --preset tiny")],
    Cli("size or overflow", f"mqar base --preset tiny --epochs {BIG} --out {{new}}", "argument --epochs"),
    Cli("size or overflow", f"lm eval {{empty}} --seq-len {BIG} --out {{new}}", "argument --seq-len"),
    Cli("size or overflow", f"state-budget --budget {BIG}", "argument --budget"),
    Cli("size or overflow", "mqar base --preset tiny --lr inf --out {new}", "argument --lr: expected a finite number"),
    Cli("size or overflow", "state-budget --width 100000000000", "cannot hold"),
    Cli("size or overflow", "state-budget --width 99999999999999", "widths entry must be an integer <="),
    Cli("size or overflow", f"{LM} --mixer-kwargs '{{{{\"p0\": 1e300}}}}' --out {{new}}", "p0 must be at most",
        slow=True),
    # training that diverges: said so, with the step (the run folder is made: training had started)
    Cli("divergence", f"{LM} --lr 1e6 --steps 30 --no-progress --out {{lm_run}}", "training diverged", slow=True),
    # damaged JSON: the file is named
    *[Cli("damaged JSON file", f"{cmd} --plot-only --out {{corrupt}}", f"corrupt/{stem}.json is damaged")
      for cmd, stem in (("niah", "niah"), ("collision", "collision"), ("recall", "recall"), ("crowding", "crowding"),
                        ("mqar", "mqar_base"), ("lm eval", "lm"), ("heldout", "heldout"))],
    Cli("damaged JSON file", "niah --model {bad_model} --out {new}", "bad_model/config.json is damaged"),
    Cli("damaged JSON file", "lm eval {bad_run} --out {new}", "final/lm_config.json is damaged", slow=True),
    Cli("damaged JSON file", "heldout --model {bad_run} --out {new}", "final/lm_config.json is damaged", slow=True),
    # --plot-only on well-formed JSON of the wrong shape: the file (and the key) is named
    *[Cli("JSON of the wrong shape", f"{cmd} --plot-only --out {{{folder}}}", f"{folder}/{stem}.json")
      for folder in ("shapeless", "keyless", "mistyped")
      for cmd, stem in (("niah", "niah"), ("collision", "collision"), ("recall", "recall"), ("crowding", "crowding"),
                        ("mqar", "mqar_base"), ("lm eval", "lm"), ("heldout", "heldout"))],
    Cli("JSON of the wrong shape", "niah --plot-only --out {shapeless}", "no key 'models'"),
    # a file where a folder belongs
    Cli("a file for a folder", f"{LM} --cache-dir {{file}} --out {{new}}", "argument --cache-dir"),
    Cli("a file for a folder", "lm eval {empty} --cache-dir {file} --out {new}", "argument --cache-dir"),
    Cli("a file for a folder", "heldout --model {empty} --cache-dir {below_file}", "argument --cache-dir"),
    Cli("a file for a folder", "distill train --preset tiny --cache-dir {file}", "argument --cache-dir"),
    Cli("a file for a folder", "distill eval --out {empty} --cache-dir {file}", "argument --cache-dir"),
    # a planted symbolic link where a command writes: refused, the file it points at unchanged
    Cli("a planted link", "lm train --preset tiny --source {corpus} --device cpu --out {lock_run}",
        ".lock is a symbolic link", after=lambda p: _target_kept(p, "lock_run/.lock")),
    *[Cli("a planted link", f"{cmd} --preset tiny --out {{runs_lock}}", "runs/.lock is a symbolic link",
          after=lambda p: _target_kept(p, "runs_lock/runs/.lock")) for cmd in ("recall", "crowding")],
    Cli("a planted link", "lm eval --plot-only --out {linked_results}", "lm.md is a symbolic link",
        after=lambda p: _target_kept(p, "linked_results/lm.md")),
    Cli("a planted link", "state-budget --json {budget_link}", "symbolic link",
        after=lambda p: _target_kept(p, "budget/configs.json")),
    # --name that would leave --out: refused, no file written under that name anywhere
    *[Cli("a --name that leaves --out", f"{cmd} --name {shlex.quote(name)}", "--name", after=_no_name_written)
      for name in NAMES
      for cmd in ("lm eval {tiny_run} --out {new}", "lm eval --plot-only --out {lm_results}",
                  "heldout --model {tiny_run} --out {new}", "heldout --plot-only --out {empty}")],
    # a model folder that asks to run its own Python code: refused, nobody asked, the code not run
    Cli("a model folder with code", "niah --model {evil} --out {new}", "asks to run Python code",
        after=_evil_code_not_run),
    # damaged model folders: each damage named, by every command that loads a model
    *DAMAGED_MODEL_CASES,
    Cli("a split that does not exist", "niah --model {tiny_model} --haystack {corpus} --haystack-split nosuch "
        "--out {new}", "haystack split 'nosuch' is not a split"),
    # an output folder another writer holds: refused naming the folder, nothing written into it
    *[Cli("a busy output folder", f"{cmd} --out {{busy}}", "/busy is in use by another run (pid ",
          after=_busy_untouched("busy"))
      for cmd in ("collision", "collision --plot-only", "recall --preset tiny", "recall --plot-only",
                  "crowding --preset tiny", "crowding --plot-only", "mqar base --preset tiny", "mqar --plot-only",
                  "variance --preset tiny", "variance --plot-only",
                  "niah --model {tiny_model} --haystack {corpus}", "niah --plot-only",
                  "heldout --model {tiny_model} --source {corpus}", "heldout --plot-only",
                  "lm eval {tiny_run}", "lm eval --plot-only", f"{LM}")],
    Cli("a busy output folder", "distill eval --out {busy_distill} --skip-niah",
        "/busy_distill is in use by another run (pid ", after=_busy_untouched("busy_distill")),
    # lm eval only reads the runs: each run's evaluation is kept under --out
    Cli("nothing written outside --out", "lm eval {plain_run} --device cpu --seq-len 16 --cache-dir {div}/cache "
        "--out {div}/plain", "runs", expect=_run_only_read),
    # a diverged but finite model is evaluated: perplexities past exp's range are inf, in the JSON too
    Cli("a diverged but finite model", "lm eval {div_run} --device cpu --seq-len 16 --cache-dir {div}/cache "
        "--out {div}/lm", "ppl inf", expect=_inf_ppl("{div}/lm/lm.json", "ppl")),
    Cli("a diverged but finite model", "heldout --model {tiny_model} --model {div_model} --source {corpus} "
        "--lengths 16 --device cpu --out {div}/heldout", "ppl inf",
        expect=_inf_ppl("{div}/heldout/heldout.json", "ppl", "rel_change_pct")),
]


def _bl(**over):
    B, T, H, D, m = over.pop("shape", (2, 5, 2, 4, 3))
    kw = dict(q=torch.randn(B, T, H, D), k=torch.randn(B, T, H, D) / 2, v=torch.randn(B, T, H, m),
              r2=torch.full((B, T, H), 0.5), ell2=torch.full((B, T, H), 0.1))
    kw.update(over)
    return kw


def _step(**over):
    from bayeslayer.ops import initial_bl_state

    B, H, D, m = 2, 2, 4, 3
    kw = dict(q=torch.randn(B, H, D), k=torch.randn(B, H, D) / 2, v=torch.randn(B, H, m),
              r2=torch.full((B, H), 0.5), ell2=torch.full((B, H), 0.1), state=initial_bl_state(B, H, D, m))
    kw.update(over)
    return kw


def _ops():
    import bayeslayer.ops as ops

    return ops


def _flops():
    import bayeslayer.ops.flops as flops

    return flops


def _mixer(name="bayesian", **kw):
    from bayeslayer.layers import build_mixer

    return build_mixer(name, 32, num_heads=2, head_dim=8, layer_idx=0, **kw)


def _models():
    import bayeslayer.models as models

    return models


def _empty_first_sequence():
    """``bl_chunk`` of one 16-token sequence packed after an empty one, and of the sequence alone."""
    kw = _bl(shape=(1, 16, 2, 4, 3))
    o, _ = _ops().bl_chunk(**kw, cu_seqlens=torch.tensor([0, 0, 16]), return_variance=False)
    return o, _ops().bl_chunk(**kw)[0]


def _crowding_seeds(n: int):
    from dataclasses import replace

    from bayeslayer.experiments import crowding

    return crowding.CrowdingConfig(preset=replace(crowding.PRESETS["tiny"], seeds=n))


def _huge_chunk():
    kw = _bl()
    return _ops().bl_chunk(**kw, chunk_size=10**9)[0], _ops().bl_chunk(**kw, chunk_size=5)[0]
def _packed_mixer(name="bayesian", T=6, B=1, **kw):
    """A mixer called on ``[B, T, 32]`` with ``kw`` (cu_seqlens, attention_mask, state)."""
    return _mixer(name)(torch.randn(B, T, 32), **kw)


def _packed_model(T=6, cache_tokens=0, **kw):
    """The tiny language model called on ``[1, T]`` token ids with ``kw`` (position_ids, cu_seqlens, ...)."""
    model = _model_folders().tiny_model()
    if cache_tokens:
        kw["cache"] = model(input_ids=torch.zeros(1, cache_tokens, dtype=torch.long), use_cache=True).cache
    return model(input_ids=torch.zeros(1, T, dtype=torch.long), **kw)


def _offsets(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


PACKED_CASES = [
    Api("packed sequences", "mixer(cu_seqlens=..., attention_mask=...)",
        lambda p: _packed_mixer(cu_seqlens=_offsets(2, 4), attention_mask=torch.ones(1, 6)),
        "pass attention_mask or cu_seqlens, not both"),
    Api("packed sequences", "mixer(cu_seqlens ending before T)", lambda p: _packed_mixer(cu_seqlens=_offsets(2, 3)),
        "cu_seqlens must start at 0 and end at T=6"),
    Api("packed sequences", "mixer(cu_seqlens decreasing)",
        lambda p: _packed_mixer(cu_seqlens=torch.tensor([0, 4, 2, 6])), "cu_seqlens must be non-decreasing"),
    Api("packed sequences", "mixer(cu_seqlens float)", lambda p: _packed_mixer(cu_seqlens=_offsets(2, 4).float()),
        "cu_seqlens must have dtype int32 or int64"),
    Api("packed sequences", "mixer(cu_seqlens, batch 2)", lambda p: _packed_mixer(B=2, cu_seqlens=_offsets(2, 4)),
        "the batch size must be 1"),
    Api("packed sequences", "attention(cu_seqlens, a cache of 3 rows for 2 sequences)",
        lambda p: _packed_mixer("attention", cu_seqlens=_offsets(2, 4),
                                state=_mixer("attention")(torch.randn(3, 2, 32), use_cache=True).state),
        "state['k'] must be [B, S, H, D] with B=2"),
    Api("packed sequences", "model(position_ids that skip)",
        lambda p: _packed_model(position_ids=torch.tensor([[0, 1, 3, 4, 5, 6]])),
        "position_ids must count up by 1 within a document and restart at 0"),
    Api("packed sequences", "model(position_ids restarting, with padding)",
        lambda p: _packed_model(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
                                attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]])), "attention_mask marks padding"),
    Api("packed sequences", "model(position_ids and cu_seqlens that disagree)",
        lambda p: _packed_model(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), cu_seqlens=_offsets(2, 4)),
        "position_ids mark documents at [0, 3, 6] but cu_seqlens gives [0, 2, 6]"),
    Api("packed sequences", "model(position_ids of the wrong length)",
        lambda p: _packed_model(position_ids=torch.arange(5)[None]), "position_ids must be [B, T] = [1, 6]"),
    Api("packed sequences", "model(position_ids float)",
        lambda p: _packed_model(position_ids=torch.arange(6.0)[None]), "position_ids must be an integer"),
    Api("packed sequences", "model(packed documents after a cache)",
        lambda p: _packed_model(cu_seqlens=_offsets(2, 4), cache_tokens=3), "cannot continue a cache"),
    Api("packed sequences", "model(cu_seq_lens_q != cu_seq_lens_k)",
        lambda p: _packed_model(cu_seq_lens_q=_offsets(3, 3), cu_seq_lens_k=_offsets(2, 4)),
        "cu_seq_lens_q and cu_seq_lens_k must be the same"),
]


def _damaged_api(name: str, kind: str, load: Callable, damage: str, needle: str) -> Api:
    """``load`` of the damaged folder ``dmg_<kind>_<damage>`` of make_places."""
    place = f"dmg_{kind}_{slug(damage)}"
    return Api("a damaged model folder", f"{name} ({damage})", lambda p: load(p[place]), needle)


def _parallel():
    from bayeslayer.training import parallel

    return parallel


def _tiny_lm():
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    return BayesLayerForCausalLM(BayesLayerConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_heads=1,
                                                  head_dim=4, bos_token_id=None, eos_token_id=None))


def _train_windows(**options):
    import numpy as np

    from bayeslayer.training.loop import TrainConfig

    lm = _training_lm()
    return lm.train_on_windows(lm.NextTokenTrainee(_tiny_lm()), np.zeros((2, 4), dtype=np.int64),
                               TrainConfig(steps=1, batch_size=1), progress=False, **options)


API_CASES = [
    Api("state or shape", "bl_step(state=(M,))", lambda p: _ops().bl_step(**_step(state=(torch.zeros(2, 2, 4, 3),))),
        "must be a tuple (M, P) of 2 tensors, got a tuple of 1"),
    Api("state or shape", "bl_chunk(initial_state=(M, P, x))",
        lambda p: _ops().bl_chunk(**_bl(initial_state=(1, 2, 3))), "got a tuple of 3"),
    Api("state or shape", "bl_step(state=M)", lambda p: _ops().bl_step(**_step(state=torch.zeros(2, 2, 4, 3))),
        "must be a tuple (M, P)"),
    Api("size or overflow", "build_mixer(p0=1e300)", lambda p: _mixer(p0=1e300), "p0 must be at most"),
    Api("size or overflow", "build_mixer(head_dim=2**70)",
        lambda p: __import__("bayeslayer.layers", fromlist=["x"]).build_mixer("bayesian", 32, num_heads=2,
                                                                               head_dim=2**70, layer_idx=0),
        "head_dim must be an integer <="),
    Api("size or overflow", "DemoConfig(T=10**20)", lambda p: _demo().DemoConfig(T=10**20), "T must be an integer <="),
    Api("size or overflow", "demo.run(T=10**11)", lambda p: _demo().run(_demo().DemoConfig(T=10**11)),
        "needs at least"),
    Api("size or overflow", "solve_state_budget(width=10**11)",
        lambda p: _state_budget().solve_state_budget(8192, 10**11, "bayesian"), "cannot hold"),
    Api("size or overflow", "solve_state_budget(width=10**14)",
        lambda p: _state_budget().solve_state_budget(8192, 10**14, "bayesian"), "width must be an integer <="),
    Api("state or shape", "bl_chunk(every tensor on meta)",
        lambda p: _ops().bl_chunk(**{k: v.to("meta") for k, v in _bl().items()}), _every("q", "meta")),
    Api("size or overflow", "BayesLayerForCausalLM(vocab_size=10**12)",
        lambda p: _models().BayesLayerForCausalLM(_models().BayesLayerConfig(vocab_size=10**12, hidden_size=32,
                                                                             num_heads=2, head_dim=16)),
        _every("vocab_size", "needs at least")),
    Api("size or overflow", "CrowdingConfig(preset.seeds=10**12)", lambda p: _crowding_seeds(10**12),
        _every("seeds", "needs at least")),
    # valid inputs that once ended in a traceback: each must run and give the right answer
    Api("a valid edge input", "bl_chunk(cu_seqlens=[0, 0, 16], return_variance=False)",
        lambda p: _empty_first_sequence(), "runs", expect=_same),
    Api("a valid edge input", "bl_chunk(chunk_size=10**9)", lambda p: _huge_chunk(), "runs", expect=_same),
    Api("a diverged but finite model", "ppl_by_group(CE 1e37)",
        lambda p: __import__("bayeslayer.data.arhit", fromlist=["x"]).ppl_by_group(
            torch.full((2, 3), 1e37), {"all": torch.ones(2, 3, dtype=torch.bool).numpy()}), "runs",
        expect=lambda r: None if r["all"]["ppl"] == math.inf else f"ppl {r['all']['ppl']}"),
    Api("size or overflow", "mixer.flops(batch_size=2**70)", lambda p: _mixer().flops(2**70, 8),
        "batch_size must be an integer <="),
    Api("FLOP count arguments", "chunk_flops(dynamics='rotation')",
        lambda p: _flops().chunk_flops("bayes", "rotation", batch_size=1, seq_len=8, num_heads=1, key_dim=8,
                                       value_dim=8), "dynamics='rotation' has no FLOP count"),
    Api("FLOP count arguments", "mixer.flops(seq_len=0)", lambda p: _mixer("gated_deltanet").flops(1, 0),
        "seq_len must be an integer >= 1"),
    Api("FLOP count arguments", "chunk_flops(write='lowrank') without rank",
        lambda p: _flops().chunk_flops("lowrank", "scalar", batch_size=1, seq_len=8, num_heads=1, key_dim=8,
                                       value_dim=8), "needs rank"),
    Api("damaged JSON file", "plotting.load_json(damaged)",
        lambda p: _plotting().load_json(Path(p["corrupt"]) / "niah.json"), "corrupt/niah.json is damaged"),
    Api("damaged JSON file", "load_run(final/lm_config.json damaged)",
        lambda p: __import__("bayeslayer.training.lm", fromlist=["x"]).load_run(p["bad_run"]),
        "lm_config.json is damaged", slow=True),
    Api("JSON of the wrong shape", "niah.redraw({})", lambda p: _niah().redraw(p["shapeless"]), "no key 'models'"),
    Api("JSON of the wrong shape", "niah.redraw(models: 3)", lambda p: _niah().redraw(p["mistyped"]),
        "mistyped/niah.json does not have the shape"),
    # an experiment's docs table (table(record) beside plot) handed something other than its record
    Api("JSON of the wrong shape", "recall.table('recall.json')", lambda p: _experiment("recall").table("recall.json"),
        "record must be a results record"),
    Api("JSON of the wrong shape", "mqar.table(record, xs=(99,))",
        lambda p: _experiment("mqar").table({"models": {"a": {"label": "a", "summary": {"x": [0]}, "runs": [{}]}}},
                                            "stacked", xs=(99,), x_labels=("99",)), "xs: the record's sweep has no"),
    Api("JSON of the wrong shape", "lm.table(record, paper=('RWKV',))",
        lambda p: _experiment("lm").table({"models": {}, "paper_table2": {}}, paper=("RWKV",)),
        "paper: the record's paper_table2 has no ['RWKV']"),
    Api("a --name that leaves --out", "lm.write_report(name='../x')",
        lambda p: _lm().write_report(_model_folders().lm_record(), Path(p["root"]) / "o", "../x"), "plain file name",
        after=_no_name_written),
    Api("a --name that leaves --out", "HeldoutConfig(name='/tmp/x')",
        lambda p: _heldout().HeldoutConfig(models=[], name="/tmp/x"), "plain file name"),
    Api("a model folder with code", "load_model(auto_map + .py)", lambda p: _pretrained().load_model(p["evil"]),
        _every("asks to run Python code", "trust_remote_code"), after=_evil_code_not_run),
    Api("a split that does not exist", "load_essays(split='nosuch')",
        lambda p: __import__("bayeslayer.data.niah", fromlist=["x"]).load_essays(p["corpus"], "nosuch"),
        "haystack split 'nosuch' is not a split"),
    # one variance score per token from a model's per-layer variances
    Api("state or shape", "token_variance((v[B, T, H],))",
        lambda p: _variance().token_variance((torch.ones(2, 3, 4),)), "must be a float tensor [B, T, H, G]"),
    Api("state or shape", "token_variance(v) (one tensor, not a tuple)",
        lambda p: _variance().token_variance(torch.ones(2, 3, 4, 1)), "tuple of per-layer tensors"),
    Api("state or shape", "token_variance((None, None))", lambda p: _variance().token_variance((None, None)),
        "no layer with a variance"),
    Api("state or shape", "token_variance(layers=5)",
        lambda p: _variance().token_variance((torch.ones(2, 3, 4, 1),), layers=5), "indices of the 1 layers"),
    Api("state or shape", "token_variance(reduction='median')",
        lambda p: _variance().token_variance((torch.ones(2, 3, 4, 1),), reduction="median"),
        "reduction must be one of"),
    # the lm-eval task folder the package writes, and lm-eval's task manager with it
    Api("a file for a folder", "default_task_dir(cache_dir=a file)",
        lambda p: __import__("bayeslayer.evaluation", fromlist=["x"]).default_task_dir(p["file"]),
        "a_file is a file, not a folder"),
    Api("a file for a folder", "default_task_dir(cache_dir=3)",
        lambda p: __import__("bayeslayer.evaluation", fromlist=["x"]).default_task_dir(3),
        "cache_dir must be a folder path"),
    Api("a file for a folder", "lm_eval_adapter.task_manager(include_path=3)",
        lambda p: __import__("bayeslayer.evaluation.lm_eval_adapter", fromlist=["x"]).task_manager(3),
        "include_path must be a folder path"),
    *[_damaged_api(name, kind, load, damage, _every(*DAMAGES[damage][2], f"dmg_{kind}_{slug(damage)}"))
      for damage in DAMAGES
      for name, kind, load in (
          ("BayesLayerForCausalLM.from_pretrained", "model",
           lambda path: __import__("bayeslayer.models", fromlist=["x"]).BayesLayerForCausalLM.from_pretrained(path)),
          ("lm.load_run", "run", lambda path: _training_lm().load_run(path)),
          ("models.pretrained.load_model", "model", lambda path: _pretrained().load_model(path)))],
    *[_damaged_api("load_gdn_checkpoint", "gdn", lambda path: __import__("bayeslayer.models", fromlist=["x"])
                   .load_gdn_checkpoint(path), damage, needle)
      for damage, (_, needle) in GDN_DAMAGES.items()],
    Api("sharding", "train_on_windows(shard='zero3')", lambda p: _train_windows(shard="zero3"),
        "shard must be one of ('none', 'fsdp')"),
    Api("sharding", "shard_model(mesh=None)", lambda p: _parallel().shard_model(_tiny_lm(), None),
        "mesh must be a 1-D DeviceMesh"),
    Api("sharding", "shard_trainee(Linear)", lambda p: _parallel().shard_trainee(torch.nn.Linear(2, 2), None),
        "holds no model with decoder blocks"),
    Api("sharding", "mixed_precision(torch.int32)", lambda p: _parallel().mixed_precision(torch.int32),
        "dtype must be a floating-point torch.dtype"),
    Api("sharding", "titan.model_spec(flavor='7B')",
        lambda p: __import__("bayeslayer.training.titan", fromlist=["x"]).model_spec("7B"),
        "flavor must be one of ['debugmodel']"),
    Api("sharding", "titan.model_spec(hidden_size=0)",
        lambda p: __import__("bayeslayer.training.titan", fromlist=["x"]).model_spec(hidden_size=0),
        "hidden_size"),
    Api("sharding", "load_sharded(param_groups='x')",
        lambda p: __import__("bayeslayer.training.sharded_state", fromlist=["x"]).load_sharded(
            p["root"], _tiny_lm(), torch.optim.AdamW(_tiny_lm().parameters()), "x"),
        "param_groups must be the list"),
    *PACKED_CASES,
]


def _lm():
    from bayeslayer.experiments import lm

    return lm


def _variance():
    from bayeslayer.evaluation import variance

    return variance


def _training_lm():
    from bayeslayer.training import lm

    return lm


def _heldout():
    from bayeslayer.experiments import heldout

    return heldout


def _model_folders():
    from tests import model_folders

    return model_folders


def _demo():
    from bayeslayer.experiments import demo

    return demo


def _state_budget():
    from bayeslayer.models import state_budget

    return state_budget


def _plotting():
    from bayeslayer.experiments.common import plotting

    return plotting


def _niah():
    from bayeslayer.experiments import niah

    return niah


def _experiment(name: str):
    import importlib

    return importlib.import_module(f"bayeslayer.experiments.{name}")


def _pretrained():
    from bayeslayer.models import pretrained

    return pretrained


def imported_cases() -> list[Cli | Api]:
    """The bad-input tables of the older test files, as cases of this suite (run there by their own tests)."""
    from tests import test_cli
    from tests.design import test_design_bad_input as design
    from tests.ops import test_bad_input as ops_cases

    cases: list[Cli | Api] = [Cli("common mistakes (tests/test_cli.py)", shlex.join(argv), needle)
                              for _, argv, needle in test_cli.CASES]
    for fn in ops_cases.SEQUENCE_OPS:
        for name, over, _, pattern in (ops_cases.SHAPE_CASES + ops_cases.VALUE_CASES + ops_cases.GROUP_CASES
                                       + ops_cases.DTYPE_CASES):
            cases.append(Api("ops arguments (tests/ops/test_bad_input.py)", f"{fn.__name__} {name}",
                             lambda p, fn=fn, over=over: fn(**ops_cases.good(**over)), pattern))
    for name, over, _, pattern in ops_cases.STEP_CASES:
        cases.append(Api("ops arguments (tests/ops/test_bad_input.py)", f"bl_step {name}",
                         lambda p, over=over: ops_cases.bl_step(**ops_cases.step_args(**over)), pattern))
    for method in ("recurrent", "chunk"):
        for name, model, kwargs, _, pattern in design.CASES:
            cases.append(Api("design arguments (tests/design/test_design_bad_input.py)", f"{method} {name}",
                             lambda p, model=model, kwargs=kwargs, method=method:
                             getattr(model, method)(*design.qkv(), **kwargs), pattern))
    return cases


def all_cases() -> list[Cli | Api]:
    return CLI_CASES + API_CASES + imported_cases()


# ----------------------------------------------------------------------------- running and classifying


class _Hang(BaseException):
    """Raised by the alarm; a BaseException, so no ``except Exception`` in the code under test swallows it."""


@contextlib.contextmanager
def _deadline(seconds: float):
    def ring(signum, frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _holds(text: str, needle: str) -> bool:
    if needle in text:
        return True
    try:
        return re.search(needle, text) is not None
    except re.error:
        return False


class _Prompt(BaseException):
    """Raised by ``input()`` during a case: a question on the terminal, where a batch job would wait."""


def _ask(*args, **kwargs):
    raise _Prompt()


def run_case(case: Cli | Api, places: dict[str, str]) -> tuple[str, str]:
    """``(outcome, what was seen)`` of one case."""
    import builtins

    asked, builtins.input = builtins.input, _ask
    try:
        outcome, seen = _run_cli(case, places) if isinstance(case, Cli) else _run_api(case, places)
    finally:
        builtins.input = asked
    if outcome == "clear" and case.after is not None:
        trace = case.after(places)
        if trace:
            return "silent", f"refused, but {trace}: {seen}"
    return outcome, seen


def _run_cli(case: Cli, places: dict[str, str]) -> tuple[str, str]:
    from bayeslayer.cli import main

    argv = [word.format(**places) for word in shlex.split(case.argv)]
    out, err = io.StringIO(), io.StringIO()
    try:
        with _deadline(case.timeout), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except _Hang:
        return "hang", f"still running after {case.timeout:g} s"
    except _Prompt:
        return "hang", "asked a question on the terminal"
    except BaseException:  # noqa: BLE001 - anything that escapes main is a traceback for the user
        return "traceback", traceback.format_exc(limit=-3)
    stderr = err.getvalue()
    lines = stderr.strip().splitlines()
    if case.expect is not None and rc in (0, 2) and "Traceback" not in stderr:
        if rc == 2:
            return "unclear", f"a valid input refused: {stderr}"
        wrong = case.expect(places)
        return ("silent", f"exit 0, but {wrong}") if wrong else ("clear", "exit 0, output checked")
    if rc == 0:
        return "silent", f"exit 0; stdout {out.getvalue()[-300:]!r}"
    if rc != 2 or "Traceback" in stderr:
        return "traceback", f"exit {rc}: {stderr[-1500:]}"
    if len(lines) == 1 and "error:" in lines[0] and _holds(lines[0], case.needle.format(**places)):
        return "clear", lines[0]
    return "unclear", stderr


def _run_api(case: Api, places: dict[str, str]) -> tuple[str, str]:
    if case.expect is not None:
        return _run_valid_api(case, places)
    try:
        with _deadline(case.timeout):
            case.call(places)
    except _Hang:
        return "hang", f"still running after {case.timeout:g} s"
    except _Prompt:
        return "hang", "asked a question on the terminal"
    except (ValueError, TypeError) as err:
        text = f"{type(err).__name__}: {err}"
        return ("clear" if _holds(str(err), case.needle) else "unclear"), text
    except BaseException:  # noqa: BLE001
        return "traceback", traceback.format_exc(limit=-3)
    return "silent", "returned without an error"


def _run_valid_api(case: Api, places: dict[str, str]) -> tuple[str, str]:
    try:
        with _deadline(case.timeout):
            result = case.call(places)
    except _Hang:
        return "hang", f"still running after {case.timeout:g} s"
    except _Prompt:
        return "hang", "asked a question on the terminal"
    except BaseException:  # noqa: BLE001 - a valid input must not raise
        return "traceback", traceback.format_exc(limit=-3)
    wrong = case.expect(result)
    return ("silent", f"returned, but {wrong}") if wrong else ("clear", "returned, result checked")


# ----------------------------------------------------------------------------- the counts table


def count_table(outcomes: list[tuple[Cli | Api, str]]) -> str:
    """The Markdown table of docs/reliability.md: per surface and category, the cases and their outcomes."""
    rows: dict[tuple[str, str], Counter] = {}
    for case, outcome in outcomes:
        rows.setdefault((case.surface, case.category), Counter())[outcome] += 1
    header = "| surface | category | bad calls | " + " | ".join(
        "clear (one line, exit 2)" if o == "clear" else o for o in OUTCOMES) + " |"
    lines = [header, "|" + "---|" * (3 + len(OUTCOMES))]
    for surface in ("CLI", "Python API"):
        keys = [k for k in rows if k[0] == surface]
        for key in keys:
            c = rows[key]
            lines.append(f"| {surface} | {key[1]} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES)
                         + " |")
        total = sum((rows[k] for k in keys), Counter())
        lines.append(f"| **{surface}** | **all** | **{sum(total.values())}** | "
                     + " | ".join(f"**{total[o]}**" for o in OUTCOMES) + " |")
    return "\n".join(lines)


def _docs_table() -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("| surface | category | bad calls |")
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else len(text)].strip()


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    return make_places(tmp_path_factory.mktemp("bad_inputs"))


def _param(case):
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=f"{case.surface}-{case.label}"[:100], marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CLI_CASES + API_CASES])
def test_every_bad_input_is_clear(case, places):
    if isinstance(case, Cli) and case.argv.startswith("heldout --model {dmg_"):
        from bayeslayer.data.text.sources import python_docs_dir

        if python_docs_dir() is None:  # heldout checks its default corpus before it loads the model
            pytest.skip("heldout's default corpus (Debian's python3-doc) is not installed")
    outcome, seen = run_case(case, places)
    assert outcome == "clear", f"{outcome}: {seen}"
    if isinstance(case, Cli):
        assert not Path(places["new"]).exists(), "a bad command created its output folder"


def test_the_classifier_tells_each_outcome(places, monkeypatch):
    """The suite can fail: a traceback, a silent success, an unclear message and a hang are each told."""
    from bayeslayer import cli

    assert run_case(Api("t", "returns", lambda p: None, "x"), places)[0] == "silent"
    assert run_case(Api("t", "runtime error", lambda p: torch.empty(2).amax(dim=5), "x"), places)[0] == "traceback"
    assert run_case(Api("t", "other message", lambda p: int("x"), "needle"), places)[0] == "unclear"
    assert run_case(Api("t", "loops", lambda p: [0 for _ in iter(int, 1)], "x", timeout=0.2), places)[0] == "hang"
    assert run_case(Api("t", "asks", lambda p: input("trust? "), "x"), places)[0] == "hang"
    assert run_case(Api("t", "clear, then a trace", lambda p: int("x"), "invalid literal", after=lambda p: "a trace"),
                    places)[0] == "silent"
    assert run_case(Api("t", "clear, no trace", lambda p: int("x"), "invalid literal", after=lambda p: None),
                    places)[0] == "clear"
    assert run_case(Cli("t", "demo --T 0", "--T"), places)[0] == "clear"
    assert run_case(Cli("t", "demo --T 0", "no such text"), places)[0] == "unclear"
    assert run_case(Cli("t", "demo --T 8", "x"), places)[0] == "silent"
    monkeypatch.setattr(cli, "build_parser", lambda: (_ for _ in ()).throw(KeyError("bug")))
    assert run_case(Cli("t", "demo", "x"), places)[0] == "traceback"


def test_out_of_memory_is_one_line_whatever_the_command(monkeypatch, capsys):
    """The CPU allocator's error (a RuntimeError, not torch.OutOfMemoryError) ends in one line, exit 2."""
    from bayeslayer.cli import main
    from bayeslayer.experiments import demo

    def allocate(config):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 51200000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(demo, "run", allocate)
    assert main(["demo", "--T", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bayeslayer demo: error: out of memory: DefaultCPUAllocator"), err
    monkeypatch.setattr(demo, "run", lambda config: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError keeps its traceback
        main(["demo", "--T", "8"])


@pytest.mark.slow
def test_mqar_scores_a_diverged_lr_nan_and_goes_on(tmp_path, capsys):
    """``mqar --lr 1e8 1e-3``: the first lr diverges (its weights overflow a layer); it is scored NaN with
    the reason, and the sweep finishes on the second (it used to stop on "alpha contains NaN")."""
    import json

    from bayeslayer.cli import main

    argv = ["mqar", "base", "--preset", "tiny", "--mixers", "bayesian", "--lr", "1e8", "1e-3", "--no-progress",
            "--out", str(tmp_path)]
    assert main(argv) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "mqar_base.json").read_text())
    grids = [run["lr_grid"] for run in record["models"]["bayesian"]["runs"]]
    assert grids and all("training diverged" in g[0]["diverged"] and g[1]["lr"] == 1e-3 for g in grids)


def test_the_docs_table_is_what_the_suite_counts():
    """docs/reliability.md's table is :func:`count_table` with every case clear, which is what the tests of
    every case (here, and the imported tables in their own files) assert; ``python -m tests.test_bad_inputs``
    measures it."""
    assert _docs_table() == count_table([(case, "clear") for case in all_cases()])


def test_cases_are_well_formed():
    for case in CLI_CASES + API_CASES:
        assert case.needle and case.category
        if isinstance(case, Cli):
            assert shlex.split(case.argv)[0] in {"demo", "collision", "recall", "crowding", "lm", "state-budget",
                                                  "mqar", "niah", "heldout", "distill", "variance"}, case.argv
    assert math.isfinite(sum(c.timeout for c in all_cases()))


def main(argv: list[str] | None = None) -> int:
    """Run every case (slow ones and imported tables included), print the failures and the counts table."""
    argv = sys.argv[1:] if argv is None else argv
    fast = "--fast" in argv
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        places = make_places(Path(tmp))
        for case in all_cases():
            if fast and case.slow:
                continue
            outcome, seen = run_case(case, places)
            results.append((case, outcome))
            if outcome != "clear":
                print(f"[{outcome}] {case.surface} {case.label}\n    {' '.join(seen.split())[:600]}", file=sys.stderr)
            if Path(places["new"]).exists():
                print(f"[created --out] {case.label}", file=sys.stderr)
                import shutil

                shutil.rmtree(places["new"])
    print(count_table(results))
    return 0 if all(o == "clear" for _, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
