"""RULER needle-in-a-haystack evaluation (SPEC §4.6): generators, greedy decoding, scoring, plots.

RULER's NIAH family has eight variants.  A *needle* is the sentence
``"One of the special magic {numbers} for {key} is: {value}."``; the prompt asks for
the value(s) of the queried key(s) and ends with an answer prefix, so the model's
continuation should start with the answer::

    Some special magic numbers are hidden within the following text. Make sure to memorize
    it. I will quiz you about the numbers afterwards.
    <haystack ... One of the special magic numbers for calm-river is: 4721093. ... haystack>
    What are all the special magic numbers for calm-river mentioned in the provided text?
    The special magic numbers for calm-river mentioned in the provided text are

(one expected value: "A special magic number is hidden ...", "What is ...", "... is").

========================  ===========================  ======  =======  ===========================
task                      haystack                     key     value    needles
========================  ===========================  ======  =======  ===========================
niah_single_1             noise paragraph per line     word    number   1
niah_single_2             essay (real prose)           word    number   1
niah_single_3             essay                        word    UUID     1
niah_multikey_1           essay                        word    number   1 queried + 3 distractors
niah_multikey_2           key-value list (needles)     word    number   1 queried; haystack = needles
niah_multikey_3           key-value list (needles)     UUID    UUID     1 queried; haystack = needles
niah_multivalue           essay                        word    number   4 values for one key
niah_multiquery           essay                        word    number   4 keys, all queried
========================  ===========================  ======  =======  ===========================

The text is RULER's as lm-eval writes it (:func:`prompt_template`, :func:`ruler_prompt`): for the
same context both build the same prompt (``tests/evaluation/test_ruler_parity.py`` checks it against
the installed lm-eval); units are joined as RULER joins them (:data:`SEPARATORS`).

Length and depth are exact.  The prompt is assembled from token ids: the
instruction, the context units (haystack sentences or lines, needles) and the
question are each encoded with the model's tokenizer and concatenated, so the
prompt has exactly ``length − max_new_tokens`` tokens (RULER counts the answer
budget in the context length): the haystack is filled unit by unit and its last
unit is cut to the token.  The answer-bearing needles (one block) are inserted at
the unit boundary nearest to ``depth`` percent of the other context tokens;
the realised depth is measured by locating the needle's token ids in the prompt
and stored with each sample.  Distractor needles go to random boundaries.

Scoring is RULER's ``string_match_all``: a sample scores the fraction of its
expected values found (case-insensitive substring) in the decoded continuation,
reported in percent.  The summary is the average over six tasks,
:data:`SUMMARY_TASKS` (see there for why these six).

Results are data: ``niah.json`` holds every cell's per-sample scores;
``--plot-only`` redraws the length plot, the markdown tables and the
depth × length difference heatmaps from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from .cli_checks import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_in_dir,
    check_out_dir,
    check_tokenizer,
    device_arg,
    plot_only_json,
    positive_int_arg,
    resolve_device,
)
from .plotting import save_figure, save_json

# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class NiahTask:
    """One RULER NIAH variant.

    haystack: ``"noise"`` (one fixed paragraph repeated), ``"essay"`` (real prose, split in
        sentences) or ``"kv"`` (lines that are needles of other random keys).
    key_type, value_type: ``"words"`` (adjective-noun), ``"numbers"`` (7 digits) or ``"uuids"``.
    num_keys: keys with needles in the context; num_values: values per key;
    num_queries: keys asked for (the first ``num_queries`` keys; the rest are distractors).
    """

    name: str
    haystack: str
    key_type: str
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


TASKS: dict[str, NiahTask] = {t.name: t for t in (
    NiahTask("niah_single_1", "noise", "words", "numbers"),
    NiahTask("niah_single_2", "essay", "words", "numbers"),
    NiahTask("niah_single_3", "essay", "words", "uuids"),
    NiahTask("niah_multikey_1", "essay", "words", "numbers", num_keys=4),
    NiahTask("niah_multikey_2", "kv", "words", "numbers"),
    NiahTask("niah_multikey_3", "kv", "uuids", "uuids"),
    NiahTask("niah_multivalue", "essay", "words", "numbers", num_values=4),
    NiahTask("niah_multiquery", "essay", "words", "numbers", num_keys=4, num_queries=4),
)}

#: The six tasks of the summary average.  The paper names niah_single_1, niah_single_2,
#: niah_multivalue and niah_multiquery among its six and excludes CWE; of the other four
#: NIAH variants we keep the two that share the essay haystack (niah_single_3,
#: niah_multikey_1) and drop niah_multikey_2/3, whose haystack is made of needles (a
#: key-value-list lookup rather than a needle in prose; small models score near zero
#: there, which would dilute the average).  ``--summary-tasks`` changes the choice.
SUMMARY_TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multivalue", "niah_multiquery",
)

#: RULER generates up to 128 tokens for every NIAH task.
DEFAULT_MAX_NEW_TOKENS = 128
PAPER_LENGTHS = (2048, 4096, 8192, 16384)
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))
#: Heatmap cells with fewer samples (per task) than this are hatched.
MIN_CELL_SAMPLES = 30

NOISE_PARAGRAPH = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {vtype} for {key} is: {value}."
#: What joins the context's units (haystack units and needles), as RULER joins them: the noise
#: paragraph and key-value needles one per line, essay sentences and needles with a space.
SEPARATORS = {"noise": "\n", "kv": "\n", "essay": " "}
# An essay "sentence" longer than this many words is cut into pieces, which bounds
# how far the needle can land from the requested depth.
MAX_UNIT_WORDS = 40

_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "brief", "bright", "calm", "clever", "cold",
    "crisp", "curious", "damp", "dark", "eager", "early", "faint", "fancy", "fierce", "fresh",
    "gentle", "giant", "glossy", "golden", "grand", "hidden", "hollow", "humble", "icy", "jolly",
    "keen", "lively", "lonely", "loud", "lucky", "mellow", "misty", "modest", "narrow", "noble",
    "odd", "pale", "plain", "polite", "proud", "quiet", "rapid", "rare", "rough", "royal",
    "rusty", "sandy", "sharp", "shiny", "silent", "silver", "sleepy", "slow", "smooth", "soft",
    "solid", "sour", "steep", "stormy", "sunny", "swift", "tall", "tame", "tender", "tiny",
    "velvet", "vivid", "warm", "wild", "windy", "wise", "witty", "young", "zesty", "dusty",
)
_NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "blanket", "bottle", "bridge",
    "brook", "button", "cabin", "candle", "canyon", "castle", "cedar", "chair", "cliff", "cloud",
    "comet", "compass", "coral", "cottage", "crystal", "desert", "dragon", "drum", "eagle", "engine",
    "falcon", "feather", "forest", "fountain", "garden", "glacier", "harbor", "helmet", "island",
    "jacket", "jungle", "kettle", "ladder", "lantern", "lemon", "magnet", "meadow", "mirror",
    "mountain", "needle", "oasis", "orchard", "palace", "pebble", "pencil", "pepper", "piano",
    "pillow", "planet", "pocket", "puzzle", "rabbit", "river", "rocket", "saddle", "shadow",
    "shelter", "spider", "statue", "summit", "sweater", "thunder", "tiger", "tower", "tunnel",
    "valley", "violin", "wagon", "window", "wizard",
)
WORDS: tuple[str, ...] = tuple(f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS)


def prompt_template(task: str, queries: Sequence[str]) -> tuple[str, str, str]:
    """RULER's ``(instruction, question, answer_prefix)`` of ``task`` asking for ``queries``.

    The prompt is ``instruction + "\n" + context + "\n" + question + " " + answer_prefix``
    (:func:`ruler_prompt`): lm-eval's RULER template (``ruler/niah_utils.py``) holds the
    instruction, context and question, its ``gen_prefix`` the answer prefix, joined by the
    task's ``target_delimiter`` " ".  One expected value (one key asked, one value per key)
    makes everything singular ("A special magic number is", "What is the", "... is").
    """
    spec = _check_task(task)
    if isinstance(queries, str) or not queries or not all(isinstance(q, str) and q for q in queries):
        raise ValueError(f"queries must be a non-empty list of non-empty str, got {queries!r}")
    if len(queries) != spec.num_queries:
        raise ValueError(f"{task} asks for {spec.num_queries} key(s), got {len(queries)} queries")
    single = spec.num_queries * spec.num_values == 1
    vname = spec.value_type[:-1] if single else spec.value_type  # "number" / "numbers"
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    instruction = (f"{'A' if single else 'Some'} special magic {vname} {'is' if single else 'are'} hidden within "
                   f"the following text. Make sure to memorize it. I will quiz you about the {vname} afterwards.")
    question = f"{'What is the' if single else 'What are all the'} special magic {vname} for {query} " \
               "mentioned in the provided text?"
    answer_prefix = f"The special magic {vname} for {query} mentioned in the provided text {'is' if single else 'are'}"
    return instruction, question, answer_prefix


def ruler_prompt(task: str, context: str, queries: Sequence[str]) -> str:
    """The whole prompt text of ``task`` around ``context`` (see :func:`prompt_template`)."""
    if not isinstance(context, str):
        raise TypeError(f"context must be a str, got {type(context).__name__}")
    instruction, question, answer_prefix = prompt_template(task, queries)
    return f"{instruction}\n{context}\n{question} {answer_prefix}"

# ----------------------------------------------------------------------------- tokenizer


class _Tokenizer:
    """The three things the generator needs from a ``tokenizers.Tokenizer``: ids of a text
    (no special tokens), the special ids the post-processor puts before a sequence (a BOS),
    and decoding."""

    def __init__(self, tokenizer: Any) -> None:
        from ..data.text import load_tokenizer

        self.backend = load_tokenizer(tokenizer)
        self._anchor_ids: dict[str, list[int]] = {}
        # What the post-processor puts before a text (a BOS for Llama-style tokenizers, nothing
        # for GPT-2-style ones); anything it appends (an EOS) is not wanted in a prompt.
        plain = self.encode("a")
        special = list(self.backend.encode("a", add_special_tokens=True).ids)
        at = next((i for i in range(len(special)) if special[i:i + len(plain)] == plain), 0)
        self.leading_special = special[:at]

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_piece(self, text: str) -> list[int]:
        """Ids of ``text`` as it tokenizes *after* other text, not at the start of a string.

        SentencePiece-style tokenizers prepend a word marker to every string they encode, so
        encoding a piece on its own would add a space (``"▁▁The"``, ``"▁\n"``).  Encoding
        ``"." + text`` and dropping the ids of ``"."`` gives the in-context ids; when the
        anchor does not stay a separate prefix (it merged with the text), plain encoding is used.
        """
        for anchor in (".", "a"):
            prefix = self._anchor_ids.setdefault(anchor, self.encode(anchor))
            ids = self.encode(anchor + text)
            if ids[: len(prefix)] == prefix:
                return ids[len(prefix):]
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def eos_id(self) -> int | None:
        from ..data.text import EOS_CANDIDATES

        for name in EOS_CANDIDATES:
            token_id = self.backend.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None


# ----------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class NiahSample:
    """One prompt.

    input_ids: exactly ``length − max_new_tokens`` token ids.
    answers: the expected values (scored by substring containment).
    queries: the keys asked for.
    depth: requested depth in percent; depth_realized: where the first answer needle
        starts, in percent of the context tokens that are not the answer block.
    needle_start: token index of the first answer needle in ``input_ids``.
    context_span: ``(start, end)`` token indices of the context in ``input_ids``.
    """

    task: str
    length: int
    depth: float
    index: int
    input_ids: list[int]
    answers: list[str]
    queries: list[str]
    max_new_tokens: int
    depth_realized: float
    needle_start: int
    context_span: tuple[int, int]


def _essay_units(texts: Sequence[str]) -> list[str]:
    """Sentences of the essays (whitespace normalised), long ones cut every MAX_UNIT_WORDS words."""
    units: list[str] = []
    for text in texts:
        text = re.sub(r"\s+", " ", text).strip()
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            words = sentence.split(" ")
            for i in range(0, len(words), MAX_UNIT_WORDS):
                piece = " ".join(words[i:i + MAX_UNIT_WORDS]).strip()
                if piece:
                    units.append(piece)
    return units


def _essay_texts(essays: Any) -> list[str]:
    from ..data.text import TextCorpus

    if isinstance(essays, TextCorpus):
        split = "test" if "test" in essays.splits else sorted(essays.splits)[0]
        tokens = essays.tokens(split)
        # Documents are separated by the end-of-text id; decode a generous prefix (16k-token
        # contexts need ~16k tokens of prose; more gives the random start offsets room).
        ids = [int(t) for t in tokens[: 1 << 20]]
        text = essays.tokenizer.decode(ids, skip_special_tokens=True)
        return [text]
    if isinstance(essays, str) or not isinstance(essays, Sequence):
        raise TypeError(
            f"essays must be a sequence of str or a TextCorpus, got {type(essays).__name__}"
        )
    bad = [type(e).__name__ for e in essays if not isinstance(e, str)]
    if bad:
        raise TypeError(f"essays must all be str, got {sorted(set(bad))}")
    return list(essays)


class NiahGenerator:
    """Makes RULER NIAH prompts of an exact token length with the needle at a chosen depth.

    Args:
        tokenizer: the evaluated model's tokenizer (a ``tokenizers.Tokenizer``, a
            ``tokenizer.json`` path, a directory holding one, or a transformers fast tokenizer).
        essays: real prose for the essay haystack: a list of documents or a
            :class:`~bayeslayer.data.text.TextCorpus` (its test split is decoded).
            Only the essay tasks need it.
        seed: every sample is a function of ``(seed, task, length, depth, index)`` alone.
    """

    def __init__(self, tokenizer: Any, essays: Any = None, *, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.tokenizer = _Tokenizer(tokenizer)
        self.seed = seed
        self.essay_units = _essay_units(_essay_texts(essays)) if essays is not None else []
        self._unit_cache: dict[str, list[int]] = {}

    def _ids(self, text: str, *, cache: bool = True) -> list[int]:
        """In-context ids of a piece that follows other text (see ``_Tokenizer.encode_piece``).

        Essay and noise sentences recur across samples and are cached; random needle lines are not.
        """
        ids = self._unit_cache.get(text)
        if ids is None:
            ids = self.tokenizer.encode_piece(text)
            if cache:
                self._unit_cache[text] = ids
        return ids

    def sample(
        self, task: str, length: int, depth: float, index: int = 0, *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> NiahSample:
        """The ``index``-th sample of ``task`` at ``length`` tokens (prompt + answer budget)
        with the answer needle(s) at ``depth`` percent of the context."""
        spec = _check_task(task)
        length = _check_int("length", length, minimum=16)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, minimum=1)
        depth = _check_depth(depth)
        index = _check_int("index", index, minimum=0)
        if spec.haystack == "essay" and not self.essay_units:
            raise ValueError(f"{task} needs an essay haystack: pass essays= (a list of documents or a TextCorpus)")
        prompt_len = length - max_new_tokens
        rng = random.Random(f"niah:{self.seed}:{task}:{length}:{depth!r}:{index}")

        vtype = spec.value_type
        keys = _distinct(rng, spec.key_type, spec.num_keys)
        values = [[_random_value(rng, vtype) for _ in range(spec.num_values)] for _ in keys]
        queries = keys[: spec.num_queries]
        answers = [v for key_values in values[: spec.num_queries] for v in key_values]
        sep = SEPARATORS[spec.haystack]

        def needle_ids(key: str, value: str) -> list[int]:
            return self._ids(sep + NEEDLE.format(vtype=vtype, key=key, value=value), cache=False)

        answer_block = [needle_ids(k, v) for k, vs in zip(queries, values[: spec.num_queries], strict=True)
                        for v in vs]
        rng.shuffle(answer_block)
        distractors = [needle_ids(k, v) for k, vs in zip(keys[spec.num_queries:], values[spec.num_queries:],
                                                        strict=True) for v in vs]
        instruction, question, answer_prefix = prompt_template(task, queries)
        # Every context unit carries its separator in front; with "\n" (lines) the first one is the
        # newline after the instruction, with " " (essay) the instruction brings its own newline.
        head = instruction + ("\n" if sep == " " else "")
        tail = f"\n{question} {answer_prefix}"
        head_ids = self.tokenizer.leading_special + self.tokenizer.encode(head)  # the string's start
        tail_ids = self._ids(tail, cache=False)
        block_len = sum(map(len, answer_block))
        budget = prompt_len - len(head_ids) - len(tail_ids) - block_len - sum(map(len, distractors))
        if budget < 1:
            raise ValueError(
                f"length={length} is too short for {task}: the instruction, question and needles take "
                f"{prompt_len - budget} tokens and max_new_tokens={max_new_tokens}; use a longer length"
            )

        # Haystack units, filled to exactly `budget` tokens (the last unit cut to the token).
        units: list[list[int]] = []
        hay: list[bool] = []  # haystack unit (True) or distractor needle (False)
        stream = self._haystack_texts(spec, rng, set(keys))
        last_full: list[int] = []
        filled = 0
        for text in stream:
            last_full = self._ids(sep + text, cache=spec.haystack != "kv")
            units.append(last_full[: budget - filled])
            hay.append(True)
            filled += len(units[-1])
            if filled == budget:
                break

        # Distractor needles at random unit boundaries, then the answer block at the boundary
        # nearest to `depth` percent of everything else in the context.
        for ids in distractors:
            j = rng.randint(0, len(units))
            units.insert(j, ids)
            hay.insert(j, False)
        starts = [0]
        for ids in units:
            starts.append(starts[-1] + len(ids))
        target = depth / 100.0 * starts[-1]
        at = min(range(len(starts)), key=lambda j: (abs(starts[j] - target), j))
        if sep == " " and at > 0 and hay[0]:
            # RULER joins essay sentences with " ", so a context that opens with a sentence has no
            # space before it (one that opens with a needle keeps RULER's leading space).
            at = self._open_without_separator(units, hay, sep, stream, last_full, at)
            starts = [0]
            for ids in units:
                starts.append(starts[-1] + len(ids))
        context = [t for ids in units[:at] for t in ids] + [t for ids in answer_block for t in ids] \
            + [t for ids in units[at:] for t in ids]
        input_ids = head_ids + context + tail_ids
        if len(input_ids) != prompt_len:  # the assembly above is exact; this guards against edits
            raise AssertionError(f"built {len(input_ids)} tokens, wanted {prompt_len}")
        context_span = (len(head_ids), len(head_ids) + len(context))

        # Verify by locating the needle: first occurrence of the first answer needle's ids.
        needle_start = _find(input_ids, answer_block[0], context_span[0])
        if needle_start < 0:
            raise AssertionError("the answer needle is not in the prompt")
        block_start = context_span[0] + starts[at]
        if not block_start <= needle_start < block_start + block_len:
            raise AssertionError(f"answer needle found at {needle_start}, placed at {block_start}")
        # Depth of the answer block: the share of the other context tokens that precede it.
        others = starts[-1]
        depth_realized = 100.0 * (block_start - context_span[0]) / others
        return NiahSample(task, length, depth, index, input_ids, answers, queries, max_new_tokens,
                          depth_realized, needle_start, context_span)

    def _open_without_separator(self, units: list[list[int]], hay: list[bool], sep: str, stream,
                                last_full: list[int], at: int) -> int:
        """Re-encode ``units[0]`` (a haystack unit) without its leading ``sep`` and keep the total
        length: the last haystack units give up the tokens gained, or the last one takes the tokens
        lost from its uncut ids (``last_full``) and, past its end, from further units of ``stream``.
        Returns the answer block's unit index ``at`` after units were dropped or added."""
        text = self.tokenizer.decode(units[0])
        if not text.startswith(sep):  # a tokenizer whose pieces do not decode with the separator
            return at
        first = self.tokenizer.encode_piece(text[len(sep):])
        need = len(units[0]) - len(first)  # tokens the haystack's tail must gain (< 0: give up)
        units[0] = first
        last = max(j for j, h in enumerate(hay) if h)
        if last == 0:
            last_full = self.tokenizer.encode_piece(self.tokenizer.decode(last_full)[len(sep):])
        while need < 0:  # give up tokens from the end, dropping units that run out
            if len(units[last]) > -need:
                units[last] = units[last][:need]
                return at
            if last == 0:
                raise ValueError("the haystack is too short to adjust; use a longer length")
            need += len(units.pop(last))
            hay.pop(last)
            at -= last < at
            last = max(j for j, h in enumerate(hay) if h)
        if need == 0:
            return at
        grow = min(need, len(last_full) - len(units[last]))
        units[last] = last_full[: len(units[last]) + grow]
        need -= grow
        while need > 0:
            ids = self._ids(sep + next(stream), cache=True)[:need]
            last += 1
            units.insert(last, ids)
            hay.insert(last, True)
            need -= len(ids)
            at += last <= at
        return at

    def _haystack_texts(self, spec: NiahTask, rng: random.Random, used_keys: set[str]):
        """An endless stream of haystack unit texts for ``spec`` (no leading separator)."""
        if spec.haystack == "noise":
            # The paragraph repeated, one paragraph per line (RULER's "repeat" haystack).
            while True:
                yield NOISE_PARAGRAPH
        elif spec.haystack == "essay":
            start = rng.randrange(len(self.essay_units))
            i = start
            while True:
                yield self.essay_units[i]
                i = (i + 1) % len(self.essay_units)
        else:  # key-value list: needles of other keys, never one of the sample's keys
            while True:
                key = _random_value(rng, spec.key_type)
                if key in used_keys:
                    continue
                yield NEEDLE.format(vtype=spec.value_type, key=key, value=_random_value(rng, spec.value_type))


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return rng.choice(WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _distinct(rng: random.Random, kind: str, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        value = _random_value(rng, kind)
        if value not in out:
            out.append(value)
    return out


def _find(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    n = len(needle)
    first = needle[0]
    for i in range(start, len(haystack) - n + 1):
        if haystack[i] == first and list(haystack[i:i + n]) == list(needle):
            return i
    return -1


# ----------------------------------------------------------------------------- checks


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_depth(depth: Any) -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"depth must be a number of percent, got {type(depth).__name__}")
    if not math.isfinite(depth) or not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    return float(depth)


def _check_task(task: Any) -> NiahTask:
    if task not in TASKS:
        raise ValueError(f"unknown NIAH task {task!r}; known: {sorted(TASKS)}")
    return TASKS[task]


# ----------------------------------------------------------------------------- scoring


def score_prediction(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the fraction of ``answers`` that occur in
    ``prediction`` (case-insensitive substring), in [0, 1]."""
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if isinstance(answers, str) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError(f"answers must be a non-empty list of non-empty str, got {answers!r}")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def score_predictions(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean per-sample score in percent (RULER reports 0..100)."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need as many predictions as answer lists (>0), got {len(predictions)} and {len(answers)}")
    return 100.0 * sum(score_prediction(p, a) for p, a in zip(predictions, answers, strict=True)) / len(predictions)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answers(model: torch.nn.Module, samples: Sequence[NiahSample], tokenizer: Any,
                     *, batch_size: int = 1) -> list[str]:
    """Greedy continuations (``model.generate(do_sample=False)``, the recurrent cache) of
    ``samples``, decoded up to the first end-of-text token.  Samples of one batch must have
    the same length (a cell's samples do), so no padding is needed."""
    tok = tokenizer if isinstance(tokenizer, _Tokenizer) else _Tokenizer(tokenizer)
    batch_size = _check_int("batch_size", batch_size, minimum=1)
    eos = tok.eos_id()
    device = next(model.parameters()).device
    out: list[str] = []
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        lengths = {len(s.input_ids) for s in batch}
        new_tokens = {s.max_new_tokens for s in batch}
        if len(lengths) != 1 or len(new_tokens) != 1:
            raise ValueError(f"a batch needs samples of one length and max_new_tokens, got {lengths}, {new_tokens}")
        ids = torch.tensor([s.input_ids for s in batch], dtype=torch.long, device=device)
        kwargs = {"eos_token_id": eos, "pad_token_id": eos} if eos is not None else {"pad_token_id": 0}
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens.pop(),
                             do_sample=False, **kwargs)
        for row in gen[:, ids.shape[1]:].tolist():
            if eos is not None and eos in row:
                row = row[: row.index(eos)]
            out.append(tok.decode(row))
    return out


def evaluate(
    model: torch.nn.Module,
    generator: NiahGenerator,
    *,
    tasks: Sequence[str] = tuple(TASKS),
    lengths: Sequence[int] = PAPER_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples_per_cell: int = 30,
    max_new_tokens: int | dict[str, int] = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 1,
    progress: Callable[[str], None] | None = None,
    predictions: list[dict] | None = None,
) -> list[dict]:
    """Score ``model`` on every task × length × depth cell.

    Returns one record per cell: ``{"task", "length", "depth", "n", "score", "scores",
    "depth_realized"}`` with ``score`` the mean of the per-sample ``scores`` (percent).
    Each decoded prediction is appended to ``predictions`` when a list is given.
    """
    for t in tasks:
        _check_task(t)
    samples_per_cell = _check_int("samples_per_cell", samples_per_cell, minimum=1)
    model.eval()
    cells = []
    for task in tasks:
        budget = max_new_tokens[task] if isinstance(max_new_tokens, dict) else max_new_tokens
        for length in lengths:
            for depth in depths:
                samples = [generator.sample(task, length, depth, i, max_new_tokens=budget)
                           for i in range(samples_per_cell)]
                answers = generate_answers(model, samples, generator.tokenizer, batch_size=batch_size)
                scores = [100.0 * score_prediction(p, s.answers) for p, s in zip(answers, samples, strict=True)]
                cells.append({
                    "task": task, "length": int(length), "depth": float(depth), "n": len(scores),
                    "score": sum(scores) / len(scores), "scores": scores,
                    "depth_realized": [round(s.depth_realized, 3) for s in samples],
                })
                if predictions is not None:
                    predictions.extend({"task": task, "length": length, "depth": depth, "index": s.index,
                                        "answers": s.answers, "prediction": p}
                                       for s, p in zip(samples, answers, strict=True))
                if progress is not None:
                    progress(f"{task} length={length} depth={depth:g}: {cells[-1]['score']:.1f}")
    return cells


def summarize(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """Per task × length means (over depths and samples, every cell weighted equally) and the
    summary: the mean over ``summary_tasks`` per length (tasks missing from ``cells`` are
    left out of the average and listed under ``"missing"``)."""
    by_task: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        by_task.setdefault(c["task"], {}).setdefault(str(c["length"]), []).append(c["score"])
    task_length = {t: {L: sum(v) / len(v) for L, v in d.items()} for t, d in by_task.items()}
    present = [t for t in summary_tasks if t in task_length]
    lengths = sorted({L for d in task_length.values() for L in d}, key=int)
    summary = {}
    for L in lengths:
        vals = [task_length[t][L] for t in present if L in task_length[t]]
        if vals:
            summary[L] = sum(vals) / len(vals)
    return {"task_length": task_length, "summary": summary, "summary_tasks": present,
            "missing": [t for t in summary_tasks if t not in task_length]}


def depth_length_grid(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """``{(depth, length): (mean over summary tasks, fewest samples of any summary task)}``."""
    acc: dict[tuple[float, int], list[tuple[float, int]]] = {}
    for c in cells:
        if c["task"] in summary_tasks:
            acc.setdefault((float(c["depth"]), int(c["length"])), []).append((c["score"], c["n"]))
    return {k: (sum(s for s, _ in v) / len(v), min(n for _, n in v)) for k, v in acc.items()}


# ----------------------------------------------------------------------------- tables and plots


def _length_label(length: int | str) -> str:
    length = int(length)
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def markdown_summary(results: dict) -> str:
    """Table 6 layout: one row per model, the six-task average per length."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for L in m["summary"]}, key=int)
    lines = ["| model | " + " | ".join(_length_label(L) for L in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{m['summary'][L]:.2f}" if L in m["summary"] else "–" for L in lengths) + " |")
    return "\n".join(lines)


def markdown_tasks(results: dict) -> str:
    """Per task × length score of every model."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for t in m["task_length"].values() for L in t}, key=int)
    lines = ["| model | task | " + " | ".join(_length_label(L) for L in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for label, m in models.items():
        for task, row in m["task_length"].items():
            lines.append(f"| {label} | {task} | " + " | ".join(
                f"{row[L]:.2f}" if L in row else "–" for L in lengths) + " |")
    return "\n".join(lines)


def heatmap_difference(path: str | os.PathLike, results: dict, model_a: str, model_b: str,
                       *, min_samples: int = MIN_CELL_SAMPLES) -> Path:
    """Depth × length heatmap of ``model_a − model_b`` (six-task average, percentage points).
    Cells where either model has fewer than ``min_samples`` samples per task are hatched
    and labelled ``n<min_samples``."""
    models = results["models"]
    for name in (model_a, model_b):
        if name not in models:
            raise ValueError(f"no model {name!r} in the results; have {sorted(models)}")
    tasks = results["config"]["summary_tasks"]
    grid_a = depth_length_grid(models[model_a]["cells"], tasks)
    grid_b = depth_length_grid(models[model_b]["cells"], tasks)
    keys = sorted(set(grid_a) & set(grid_b))
    if not keys:
        raise ValueError(f"{model_a} and {model_b} share no depth × length cell of the summary tasks")
    depths = sorted({d for d, _ in keys})
    lengths = sorted({L for _, L in keys})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    diff = np.full((len(depths), len(lengths)), np.nan)
    few = np.zeros_like(diff, dtype=bool)
    for (d, L) in keys:
        i, j = depths.index(d), lengths.index(L)
        diff[i, j] = grid_a[(d, L)][0] - grid_b[(d, L)][0]
        few[i, j] = min(grid_a[(d, L)][1], grid_b[(d, L)][1]) < min_samples
    vmax = max(1.0, float(np.nanmax(np.abs(diff))))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.38 * len(depths)))
    try:
        im = ax.imshow(diff, cmap="RdBu", vmin=-vmax, vmax=vmax, aspect="auto", origin="upper")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if np.isnan(diff[i, j]):
                    continue
                text = f"{diff[i, j]:+.1f}" + (f"\nn<{min_samples}" if few[i, j] else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
                if few[i, j]:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                               edgecolor="0.4", linewidth=0))
        ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{model_a} − {model_b} (NIAH six-task avg, points)", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def length_bars(path: str | os.PathLike, results: dict) -> Path:
    """Table 6 as a figure: per context length, one bar per model (six-task average, %)."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for L in m["summary"]}, key=int)
    if not lengths:
        raise ValueError("no summary numbers to plot: did any summary task run?")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(lengths), 3.6))
    try:
        for k, (label, m) in enumerate(models.items()):
            xs = [j + (k - (len(models) - 1) / 2) * width for j, L in enumerate(lengths) if L in m["summary"]]
            ys = [m["summary"][L] for L in lengths if L in m["summary"]]
            bars = ax.bar(xs, ys, width * 0.95, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("NIAH six-task average (%)")
        ax.set_ylim(0, 100)
        ax.set_title("RULER NIAH: " + ", ".join(t.removeprefix("niah_") for t in results["config"]["summary_tasks"]),
                     fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def draw(results: dict, out_dir: str | os.PathLike, diffs: Sequence[tuple[str, str]] | None = None) -> list[Path]:
    """All figures from a results dict: the per-length bars and one heatmap per pair in ``diffs``
    (default: the first model minus each other model)."""
    out_dir = Path(out_dir)
    models = list(results["models"])
    paths = [length_bars(out_dir / "niah_length.png", results)]
    if diffs is None:
        diffs = [(models[0], other) for other in models[1:]]
    for a, b in diffs:
        paths.append(heatmap_difference(out_dir / f"niah_diff_{_safe(a)}_minus_{_safe(b)}.png", results, a, b))
    return paths


# ----------------------------------------------------------------------------- models and CLI


def load_model(path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A causal LM from a directory: a flash-linear-attention Gated DeltaNet checkpoint
    (``model_type: gated_deltanet``, read by :func:`~bayeslayer.models.load_gdn_checkpoint`)
    or any ``AutoModelForCausalLM`` (``bayeslayer`` models are registered on import)."""
    from transformers import AutoModelForCausalLM

    from ..models import load_gdn_checkpoint

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    if json.loads(config_file.read_text()).get("model_type") == "gated_deltanet":
        return load_gdn_checkpoint(path, dtype=dtype, device=device)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model would bury the evaluation's own lines
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def _parse_model(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep:
        label, path = Path(text).name or text, text
    if not label or not path:
        raise argparse.ArgumentTypeError(f"--model takes DIR or LABEL=DIR, got {text!r}")
    return label, path


def _parse_list(kind: type, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from err


def _load_essays(source: str, split: str) -> list[str]:
    from ..data.text import corpus_files

    files = corpus_files(source)
    docs = files.splits.get(split) or []
    texts = [d.read() for d in docs]
    if sum(len(t) for t in texts) < 200_000:  # a small split: use every document
        texts = [d.read() for s in files.splits.values() for d in s]
    if not any(t.strip() for t in texts):
        raise ValueError(f"haystack source {source!r} has no text")
    return texts


def check_args(args: argparse.Namespace) -> None:
    """Every check of ``bayeslayer niah``'s arguments that can fail, before any model is loaded.

    A mistake in the second model, its tokenizer or a ``--diff`` label would otherwise surface
    only after the first model's evaluation.
    """
    check_out_dir(args.out)
    if not args.model:
        raise UsageError("give at least one --model [LABEL=]DIR (or --plot-only to redraw from --out)")
    labels = [label for label, _ in args.model]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--model labels must be distinct, got {labels}")
    for t in list(args.tasks) + list(args.summary_tasks):
        if t not in TASKS:
            raise UsageError(f"unknown task {t!r}; known: {', '.join(TASKS)}")
    if not args.tasks:
        raise UsageError("--tasks names no task")
    if not args.depths:
        raise UsageError("--depths names no depth")
    for d in args.depths:
        if not (math.isfinite(d) and 0 <= d <= 100):
            raise UsageError(f"--depths are percentages in [0, 100], got {d:g}")
    if not args.lengths or any(L < 16 for L in args.lengths):
        raise UsageError(f"--lengths must be integers >= 16, got {args.lengths}")
    for a, b in args.diff or []:
        for label in (a, b):
            if label not in labels:
                raise UsageError(f"--diff {a},{b}: {label!r} is not a --model label ({', '.join(labels)})")
    if args.tokenizer:
        check_tokenizer(args.tokenizer)
    for label, path in args.model:
        directory = check_in_dir(path, option=f"--model {label}=", what="model folder")
        if not (directory / "config.json").is_file():
            raise UsageError(f"--model {label}={path}: no config.json in that folder (not a model directory)")
        if not args.tokenizer:
            check_tokenizer(path, option=f"--model {label}=")


def run(args: argparse.Namespace) -> dict:
    """``bayeslayer niah``: evaluate every ``--model``, write ``niah.json``, tables and plots; return the results.

    With ``--plot-only``, redraw the tables and plots in ``--out`` from ``<out>/niah.json``.
    """
    out = check_out_dir(args.out)
    if args.plot_only:
        results = plot_only_json(out, "niah")
        _report(results, out, args.diff)
        return results
    check_args(args)
    tasks = args.tasks
    needs_essay = any(TASKS[t].haystack == "essay" for t in tasks)
    essays = _load_essays(args.haystack, args.haystack_split) if needs_essay else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    results: dict = {"config": {
        "tasks": list(tasks), "lengths": args.lengths, "depths": args.depths,
        "samples_per_cell": args.samples_per_cell, "max_new_tokens": args.max_new_tokens,
        "seed": args.seed, "summary_tasks": list(args.summary_tasks), "haystack": str(args.haystack),
        "scoring": "RULER string_match_all: per sample, % of expected values contained in the output",
        "length_counts": "prompt tokens + max_new_tokens",
    }, "models": {}}
    for label, path in args.model:
        tokenizer = args.tokenizer or path
        generator = NiahGenerator(tokenizer, essays, seed=args.seed)
        model = load_model(path, device=str(resolve_device(args.device)), dtype=dtype)
        predictions: list[dict] = []
        cells = evaluate(model, generator, tasks=tasks, lengths=args.lengths, depths=args.depths,
                         samples_per_cell=args.samples_per_cell, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, predictions=predictions,
                         progress=None if args.quiet else lambda m, _l=label: print(f"[{_l}] {m}", flush=True))
        results["models"][label] = {"path": str(path), "cells": cells, **summarize(cells, args.summary_tasks)}
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"predictions_{_safe(label)}.jsonl", "w") as f:
            for p in predictions:
                f.write(json.dumps(p) + "\n")
        save_json(results, out / "niah.json")  # after every model: partial results survive
        del model
    _report(results, out, args.diff)
    return results


def _report(results: dict, out: Path, diff: list[tuple[str, str]] | None) -> None:
    tables = "## NIAH six-task average\n\n" + markdown_summary(results) + "\n\n## Per task\n\n" \
        + markdown_tasks(results) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "niah.md").write_text(tables)
    print(tables)
    for p in draw(results, out, diff):
        print(f"wrote {p}")


def _parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(",")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"--diff takes A,B (two model labels), got {text!r}")
    return a, b


def add_parser(sub) -> None:
    p = sub.add_parser("niah", help="RULER needle-in-a-haystack evaluation (SPEC §4.6)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", type=_parse_model, default=[], metavar="[LABEL=]DIR",
                   help="a model directory (HF format or an fla Gated DeltaNet checkpoint); repeat for several")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or a directory holding one (default: each model's directory)")
    p.add_argument("--lengths", type=lambda s: _parse_list(int, s), default=list(PAPER_LENGTHS),
                   help="context lengths in tokens, prompt + answer budget (default 2048,4096,8192,16384)")
    p.add_argument("--depths", type=lambda s: _parse_list(float, s), default=list(DEFAULT_DEPTHS),
                   help="needle depths in percent (default 0,10,...,100)")
    p.add_argument("--tasks", type=lambda s: _parse_list(str, s), default=list(TASKS),
                   help="comma-separated tasks (default: all eight)")
    p.add_argument("--summary-tasks", type=lambda s: _parse_list(str, s), default=list(SUMMARY_TASKS),
                   help="the tasks averaged in the summary (default: " + ",".join(SUMMARY_TASKS) + ")")
    p.add_argument("--samples-per-cell", type=positive_int_arg, default=30, help="samples per task × length × depth")
    p.add_argument("--max-new-tokens", type=positive_int_arg, default=DEFAULT_MAX_NEW_TOKENS,
                   help="greedy tokens generated per sample (RULER: 128)")
    p.add_argument("--haystack", default="python-docs",
                   help="essay source: 'python-docs', 'hf:<name>[:<config>]' or a text/HTML path")
    p.add_argument("--haystack-split", default="test", help="split of the haystack source to draw essays from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive_int_arg, default=1,
                   help="samples decoded together (one cell at a time)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    p.add_argument("--diff", action="append", type=_parse_pair, default=None, metavar="A,B",
                   help="draw the heatmap of A − B (default: the first model minus each other)")
    p.add_argument("--out", default="results/niah", help="output directory")
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    p.set_defaults(func=run)


__all__ = [
    "DEFAULT_DEPTHS", "MIN_CELL_SAMPLES", "PAPER_LENGTHS", "SUMMARY_TASKS", "TASKS", "NiahGenerator",
    "NiahSample", "NiahTask", "SEPARATORS", "depth_length_grid", "draw", "evaluate", "generate_answers",
    "heatmap_difference", "length_bars", "load_model", "markdown_summary", "markdown_tasks", "prompt_template",
    "ruler_prompt", "score_prediction", "score_predictions", "summarize",
]
