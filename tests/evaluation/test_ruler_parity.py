"""RULER parity: the eight NIAH tasks of the *installed* lm-eval (``lm_eval.tasks.ruler``) and
``bayeslayer niah`` build the same prompt text around the same context.

lm-eval's own task functions (``niah_utils.niah_single_1`` …) run offline: the essay haystack is our
three essays instead of the downloaded Paul Graham essays, the sample count is cut from 500 to 3,
nltk's sentence splitter runs untrained (its ``punkt_tab`` data is a download) and ``wonderwords``'
word lists are replaced by ours (building its 6 million adjective-noun keys takes most
of a minute).  Everything else — the template, the singular/plural rewrite, the needle format, how
needles and haystack are joined, the answer prefix (``gen_prefix``), the task definitions (haystack,
key/value types, needle counts) — is lm-eval's code as installed.  One checker of the context's
structure is applied to lm-eval's prompts and to ours.
"""

from __future__ import annotations

import importlib
import os
import random
import re
import sys
import types

import pytest

from bayeslayer.data import niah
from bayeslayer.data import niah as data_niah
from bayeslayer.evaluation import hf_tokenizer

from .conftest import ESSAYS

LENGTH = 512
VALUE = {"numbers": r"\d{7}", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
         "words": r"[a-z]+-[a-z]+"}


@pytest.fixture(scope="module")
def ruler(tokenizer, tmp_path_factory):
    """lm-eval's RULER NIAH modules, importable offline (see the module docstring), and a tokenizer dir."""
    from nltk.tokenize import PunktSentenceTokenizer

    words = types.ModuleType("wonderwords")
    words.RandomWord = type("RandomWord", (), {"_categories": {  # 6,400 keys: our own word lists
        "nouns": list(data_niah._NOUNS), "adjectives": list(data_niah._ADJECTIVES), "verbs": ["run"]}})
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "wonderwords", words)
    mp.setenv("LOCAL_RANK", "1")  # prepare_niah downloads nltk's punkt_tab on import on rank 0 only
    for name in ("lm_eval.tasks.ruler.prepare_niah", "lm_eval.tasks.ruler.niah_utils"):
        sys.modules.pop(name, None)
    prepare = importlib.import_module("lm_eval.tasks.ruler.prepare_niah")
    utils = importlib.import_module("lm_eval.tasks.ruler.niah_utils")
    mp.undo()
    mp = pytest.MonkeyPatch()
    mp.setattr(prepare, "cached_sent_tokenize", PunktSentenceTokenizer().tokenize)
    original_haystack, original_samples = utils.get_haystack, utils.generate_samples

    def haystack(type_haystack):
        if type_haystack == "essay":  # lm-eval's own normalisation of the essays: words
            return re.sub(r"\s+", " ", " ".join(ESSAYS)).split(" ")
        return original_haystack(type_haystack=type_haystack)

    def three_samples(*args, **kwargs):
        return original_samples(*args, **{**kwargs, "num_samples": 3})

    mp.setattr(utils, "get_haystack", haystack)
    mp.setattr(utils, "generate_samples", three_samples)
    tok_dir = tmp_path_factory.mktemp("ruler_tokenizer")
    hf_tokenizer(tokenizer).save_pretrained(tok_dir)
    yield types.SimpleNamespace(prepare=prepare, utils=utils, tokenizer_dir=str(tok_dir))
    mp.undo()
    for name in ("lm_eval.tasks.ruler.prepare_niah", "lm_eval.tasks.ruler.niah_utils"):
        sys.modules.pop(name, None)  # the stand-ins above must not leak into a real RULER run


def _queries(answer_prefix: str) -> list[str]:
    query = re.fullmatch(r"The special magic \w+ for (.+) mentioned in the provided text (?:is|are)",
                         answer_prefix).group(1)
    return re.split(r", and |, ", query)


def check_context(task: str, context: str, queries: list[str], answers: list[str], *, cut_tail: bool) -> None:
    """The structure RULER gives a context: needles in our NEEDLE format with the task's key and value
    types, the queried keys' values being the answers, the task's count of keys; noise and key-value
    haystacks one unit per line, essays and needles joined by one space (a leading space only before
    a needle that opens the context).  ``cut_tail``: one haystack line may be cut short (ours: the last
    haystack unit is cut to the token)."""
    spec = niah.TASKS[task]
    needle_re = re.escape(niah.NEEDLE).replace(r"\{vtype\}", spec.value_type)
    needle_re = needle_re.replace(r"\{key\}", f"({VALUE[spec.key_type]})").replace(r"\{value\}",
                                                                                  f"({VALUE[spec.value_type]})")
    needles = re.findall(needle_re, context)
    values_of: dict[str, list[str]] = {}
    for key, value in needles:
        values_of.setdefault(key, []).append(value)
    assert sorted(v for q in queries for v in values_of[q]) == sorted(answers)
    assert len(answers) == spec.num_values * spec.num_queries and len(queries) == spec.num_queries
    assert all(len(values_of[q]) == spec.num_values for q in queries)
    sep = niah.SEPARATORS[spec.haystack]
    if spec.haystack == "essay":
        assert len(values_of) == spec.num_keys
        assert "\n" not in context
        rest = context
        for key, value in needles:
            needle = niah.NEEDLE.format(vtype=spec.value_type, key=key, value=value)
            at = rest.index(needle)
            assert at == 0 or rest[at - 1] == " ", "a needle must follow a space"
            assert rest[at + len(needle):][:1] in ("", " "), "a needle must end a piece"
            rest = rest.replace(needle, "", 1)
        if context.startswith(" "):
            assert re.match(needle_re, context[1:]), "only a needle opening the context follows a space"
        return
    cut = 0  # haystack lines cut short: none in RULER's prompts, the last haystack unit in ours
    for line in context.split(sep):
        if re.fullmatch(needle_re, line) or line == niah.NOISE_PARAGRAPH and spec.haystack == "noise":
            continue
        cut += 1
        assert cut_tail and cut == 1, f"not a {spec.haystack} haystack line: {line!r}"
        whole = niah.NOISE_PARAGRAPH if spec.haystack == "noise" else niah.NEEDLE.format(
            vtype=spec.value_type, key="", value="")[:10]  # a key-value line cut short
        assert line and whole.startswith(line[: len(whole)]), line
    if spec.haystack == "kv":
        assert len(values_of) >= 2  # the queried needle among others


@pytest.mark.parametrize("task", list(niah.TASKS))
def test_lm_eval_prompts_are_ours_for_the_same_context(ruler, task):
    random.seed(0)  # lm-eval's generator draws from the global random module
    rows = getattr(ruler.utils, task)(max_seq_lengths=[LENGTH], tokenizer=ruler.tokenizer_dir)["test"]
    assert len(rows) == 3
    for row in rows:
        queries = _queries(row["gen_prefix"])
        instruction, question, answer_prefix = niah.prompt_template(task, queries)
        assert row["gen_prefix"] == answer_prefix
        assert row["input"].startswith(instruction + "\n") and row["input"].endswith("\n" + question)
        context = row["input"][len(instruction) + 1: -len(question) - 1]
        check_context(task, context, queries, list(row["outputs"]), cut_tail=False)
        # lm-eval's request: the text, the task's target_delimiter " ", then the gen_prefix
        assert niah.ruler_prompt(task, context, queries) == row["input"] + " " + row["gen_prefix"]


@pytest.mark.parametrize("task", list(niah.TASKS))
def test_our_prompts_have_rulers_structure(tokenizer, task):
    generator = niah.NiahGenerator(tokenizer, ESSAYS, seed=0)
    for depth, index in ((0.0, 0), (40.0, 1), (100.0, 2)):
        s = generator.sample(task, LENGTH, depth, index, max_new_tokens=16)
        text = generator.tokenizer.decode(s.input_ids)
        instruction, question, answer_prefix = niah.prompt_template(task, s.queries)
        assert text.startswith(instruction + "\n") and text.endswith(f"\n{question} {answer_prefix}")
        context = text[len(instruction) + 1: -len(question) - len(answer_prefix) - 2]
        check_context(task, context, s.queries, s.answers, cut_tail=True)
        assert niah.ruler_prompt(task, context, s.queries) == text


def test_the_task_table_matches_lm_evals(ruler):
    """Our TASKS rows against the arguments lm-eval's task functions pass to generate_samples."""
    calls = {}

    def record(*args, **kwargs):
        calls[current] = kwargs
        raise StopIteration

    mp = pytest.MonkeyPatch()
    mp.setattr(ruler.utils, "generate_samples", record)
    mp.setattr(ruler.utils, "get_haystack", lambda type_haystack: type_haystack)
    try:
        for current in niah.TASKS:
            with pytest.raises((StopIteration, RuntimeError)):
                getattr(ruler.utils, current)(max_seq_lengths=[LENGTH], tokenizer=ruler.tokenizer_dir)
    finally:
        mp.undo()
    haystacks = {"repeat": "noise", "essay": "essay", "needle": "kv"}
    for name, spec in niah.TASKS.items():
        kw = calls[name]
        assert haystacks[kw["type_haystack"]] == spec.haystack, name
        assert (kw["type_needle_k"], kw["type_needle_v"]) == (spec.key_type, spec.value_type), name
        num_q = kw.get("num_needle_q", 1)
        assert (max(kw.get("num_needle_k", 1), num_q), kw.get("num_needle_v", 1), num_q) == \
            (spec.num_keys, spec.num_values, spec.num_queries), name
        assert kw["template"] == ruler.utils.TEMPLATE


def test_needle_and_template_are_lm_evals(ruler):
    assert niah.NEEDLE.replace("{vtype}", "{type_needle_v}") == ruler.prepare.NEEDLE
    assert ruler.prepare.get_haystack.__wrapped__(type_haystack="repeat") == niah.NOISE_PARAGRAPH
    words = niah.prompt_template("niah_multiquery", ["a-b", "c-d", "e-f", "g-h"])
    assert ruler.utils.TEMPLATE.format(type_needle_v="numbers", context="X", query="a-b, c-d, e-f, and g-h") == \
        f"{words[0]}\nX\n{words[1]}"
    assert os.environ.get("LOCAL_RANK") != "1"  # the import-time switch did not leak
