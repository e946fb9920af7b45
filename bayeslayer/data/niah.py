"""RULER needle-in-a-haystack prompts (docs/theory.md §8.6): the tasks, RULER's text and the generator.

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

The evaluation (greedy decoding, scoring) is :mod:`bayeslayer.evaluation.niah`; tables, plots and
``bayeslayer niah``: :mod:`bayeslayer.experiments.niah`.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..checks import INT_MAX, check_int

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

#: RULER generates up to 128 tokens for every NIAH task.
DEFAULT_MAX_NEW_TOKENS = 128

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
    spec = check_task(task)
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


class NiahTokenizer:
    """The three things the generator needs from a ``tokenizers.Tokenizer``: ids of a text
    (no special tokens), the special ids the post-processor puts before a sequence (a BOS),
    and decoding."""

    def __init__(self, tokenizer: Any) -> None:
        from .text import load_tokenizer

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
        from .text import EOS_CANDIDATES

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
    from .text import TextCorpus

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
        check_int("seed", seed, minimum=-INT_MAX)  # any integer: Python's random takes negative seeds too
        self.tokenizer = NiahTokenizer(tokenizer)
        self.seed = seed
        self.essay_units = _essay_units(_essay_texts(essays)) if essays is not None else []
        self._unit_cache: dict[str, list[int]] = {}

    def _ids(self, text: str, *, cache: bool = True) -> list[int]:
        """In-context ids of a piece that follows other text (see :meth:`NiahTokenizer.encode_piece`).

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
        spec = check_task(task)
        length = check_int("length", length, minimum=16)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        depth = _check_depth(depth)
        index = check_int("index", index, minimum=0)
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




def _check_depth(depth: Any) -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"depth must be a number of percent, got {type(depth).__name__}")
    if not math.isfinite(depth) or not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    return float(depth)


def check_task(task: Any) -> NiahTask:
    """The :class:`NiahTask` named ``task``; ``ValueError`` naming the known tasks otherwise."""
    if task not in TASKS:
        raise ValueError(f"unknown NIAH task {task!r}; known: {sorted(TASKS)}")
    return TASKS[task]


def load_essays(source: str, split: str = "test") -> list[str]:
    """The documents of ``split`` of a corpus ``source`` (:func:`bayeslayer.data.text.corpus_files`), as essay
    haystack text; a split of under 200,000 characters is topped up with every split's documents."""
    from .text import corpus_files

    files = corpus_files(source)
    if split not in files.splits:
        raise ValueError(f"haystack split {split!r} is not a split of {source!r}; its splits are "
                         f"{', '.join(sorted(files.splits)) or 'none'}")
    docs = files.splits[split]
    texts = [d.read() for d in docs]
    if sum(len(t) for t in texts) < 200_000:  # a small split: use every document
        texts = [d.read() for s in files.splits.values() for d in s]
    if not any(t.strip() for t in texts):
        raise ValueError(f"haystack source {source!r} has no text")
    return texts


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "NEEDLE", "NOISE_PARAGRAPH", "SEPARATORS", "TASKS", "WORDS", "NiahGenerator",
    "NiahSample", "NiahTask", "NiahTokenizer", "check_task", "load_essays", "prompt_template", "ruler_prompt",
]
