"""Every code block of README.md and docs/*.md is run by a test or says why not, so the docs cannot rot silently.

A fenced ``python`` or shell (``bash``, ``sh``, ``shell``, ``console``) block carries a marker on the line right
before its opening fence:

- ``<!-- snippet: run -->``: this file runs it.  The run blocks of one document share one namespace, in the
  document's order (a block may use what an earlier one defined), in a temporary working folder;
  ``<!-- snippet: run; given a, b -->`` first sets ``a`` and ``b`` from :data:`GIVEN` (inputs the block leaves
  to the reader, e.g. ``q, k, v``), small and on the CPU.
- ``<!-- snippet: run by tests/PATH.py -->`` or ``<!-- snippet: run by tests/PATH.py::test_name -->``: that test
  runs it (the file and the function must exist).
- ``<!-- recipe: NAME -->``: the block a test reads by that name (``tests/test_contributing.py``'s
  :func:`~tests.test_contributing.recipe`); some file under ``tests/`` must name it.
- ``<!-- snippet: KIND: reason -->`` with a KIND of :data:`KINDS`: not run, and the reason says why.

Shell blocks are not run, but every ``bayeslayer`` command in them (also as ``python -m bayeslayer.cli`` and
under ``torchrun``) must parse with the command line's own parser, every ``python -m bayeslayer...`` module must
exist and every script of the repository they name must be there.  Blocks without a language (diagrams,
formulas, file listings) are text.  The last tests plant each kind of rot in a temporary tree and check that
the guard finds it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
             "console": "shell"}
KINDS = {
    "illustrative": "shows a call or a pattern, with inputs (a model folder, a checkpoint, a corpus) it leaves to "
                    "the reader",
    "gpu": "needs a CUDA device",
    "long": "a run of minutes to hours (training, a benchmark, a test suite)",
    "network": "downloads (a package, a data set, a checkpoint)",
    "processes": "needs several processes (torchrun) or a process group",
}

# Inputs that run blocks leave to the reader, per document: ``name: code`` run in the block's namespace (torch
# imported) just before a block that says ``given name``.
GIVEN = {
    "README.md": {
        "q": "q = torch.randn(2, 37, 2, 8)",
        "k": "k = torch.nn.functional.normalize(torch.randn(2, 37, 2, 8), dim=-1)",
        "v": "v = torch.randn(2, 37, 2, 8)",
        "r2": "r2 = 0.1 + torch.rand(2, 37, 2)",
        "ell2": "ell2 = 0.01 * torch.rand(2, 37, 2)",
        "alpha": "alpha = 0.9 + 0.1 * torch.rand(2, 37, 2)",
        "beta": "beta = torch.rand(2, 37, 2)",
    },
    "docs/models.md": {
        "input_ids": "input_ids = torch.randint(0, 32000, (2, 24))",
        "prompt_ids": "prompt_ids = torch.randint(1, 32000, (2, 12))",
        "mask": "mask = torch.ones(2, 12, dtype=torch.long)",
        "ids": "ids = torch.randint(0, 32000, (1, 101))",
        "i": "i = 1",
        "layer": "layer = 0",
    },
}


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the root, e.g. "docs/models.md"
    line: int  # of the opening fence
    language: str  # "python" or "shell"
    code: str
    marker: str | None  # the marker's text after "snippet: " or "recipe: " (the latter kept as "recipe: NAME")

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(root: Path) -> list[str]:
    docs = ["README.md"] if (root / "README.md").is_file() else []
    return docs + [f"docs/{p.name}" for p in sorted((root / "docs").glob("*.md"))]


def code_blocks(root: Path, doc: str) -> list[Block]:
    """The python and shell blocks of ``doc``, each with the marker on the line before it (or None)."""
    lines = (root / doc).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j])), None)
        assert end is not None, f"{doc}:{i + 1}: a code block that never closes"
        language = LANGUAGES.get(fence.group(1).lower())
        if language:
            marker = re.fullmatch(r"\s*<!-- (snippet: .*?|recipe: \S+) -->\s*", lines[i - 1]) if i else None
            text = marker.group(1) if marker else None
            if text and text.startswith("snippet: "):
                text = text[len("snippet: "):]
            found.append(Block(doc, i + 1, language, "\n".join(lines[i + 1:end]) + "\n", text))
        i = end + 1
    return found


def all_blocks(root: Path) -> list[Block]:
    return [b for doc in documents(root) for b in code_blocks(root, doc)]


def given_names(block: Block) -> list[str]:
    """The names a ``run; given a, b`` marker asks for ([] for a plain ``run``)."""
    m = re.fullmatch(r"run(?:; given ([\w, ]+))?", block.marker or "")
    return [n.strip() for n in m.group(1).split(",")] if m and m.group(1) else []


def marker_problems(root: Path, block: Block) -> list[str]:
    marker, where = block.marker, block.where
    if marker is None:
        return [f"{where}: a {block.language} block with no marker: run it (<!-- snippet: run -->), name the test "
                f"that runs it (<!-- snippet: run by tests/... -->) or say why not (<!-- snippet: KIND: reason -->, "
                f"KIND one of {sorted(KINDS)})"]
    if marker.startswith("recipe: "):
        name = marker[len("recipe: "):]
        pattern = re.compile(rf"[\"']{re.escape(name)}[\"']|recipe: {re.escape(name)}\b")
        if not any(pattern.search(f.read_text(encoding="utf-8")) for f in sorted((root / "tests").rglob("*.py"))
                   if f.name != Path(__file__).name):
            return [f"{where}: no test under tests/ runs the recipe {name!r}"]
        return []
    if re.fullmatch(r"run(?:; given [\w, ]+)?", marker):
        if block.language != "python":
            return [f"{where}: only python blocks can be run here; mark the {block.language} block with a reason"]
        missing = [n for n in given_names(block) if n not in GIVEN.get(block.doc, {})]
        return [f"{where}: {n!r} is not given for {block.doc} (GIVEN in {Path(__file__).name})" for n in missing]
    by = re.fullmatch(r"run by (tests/[\w/]+\.py)(?:::(\w+))?", marker)
    if by:
        path, name = root / by.group(1), by.group(2)
        if not path.is_file():
            return [f"{where}: {by.group(1)} does not exist"]
        if name and not re.search(rf"^\s*def {name}\(", path.read_text(encoding="utf-8"), re.M):
            return [f"{where}: {by.group(1)} has no test {name}"]
        return []
    kind = re.fullmatch(r"(\w+): (\S.*)", marker)
    if kind and kind.group(1) in KINDS:
        return []
    return [f"{where}: unknown marker {marker!r}: 'run', 'run; given NAMES', 'run by tests/FILE.py[::test]' or "
            f"'KIND: reason' with KIND one of {sorted(KINDS)}"]


# -- shell blocks: the commands parse ---------------------------------------------------------------


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block (continuation lines joined, comments dropped, split at ; && || |)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        current = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def cli_arguments(command: list[str]) -> list[str] | None:
    """The arguments given to the ``bayeslayer`` command line, or None when ``command`` does not run it.  A device
    the machine lacks is refused by the parser, so ``--device cuda`` is parsed as ``--device cpu``."""
    words = list(command)
    while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value in front of the program
        words.pop(0)
    if words and (words[0] == "bayeslayer" or words[0].endswith("/bayeslayer")):
        args = words[1:]
    elif any(a == "-m" and b == "bayeslayer.cli" for a, b in zip(words, words[1:])):
        args = words[words.index("bayeslayer.cli") + 1:]
    else:
        return None
    return ["cpu" if previous == "--device" else re.sub(r"^--device=.*", "--device=cpu", a)
            for previous, a in zip(["", *args], args)]


def shell_problems(root: Path, block: Block, parser) -> list[str]:
    problems = []
    for command in shell_commands(block.code):
        if any("$" in token for token in command) or re.search(r"<[^<>]+>", " ".join(command)):
            continue  # a shell variable or a <placeholder> stands for arguments; nothing to parse
        args = cli_arguments(command)
        if args is not None:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    parser.parse_args(args)
            except SystemExit as stop:
                if stop.code not in (0, None):
                    problems.append(f"{block.where}: `bayeslayer {shlex.join(args)}` does not parse: "
                                    f"{err.getvalue().strip()}")
        for i, token in enumerate(command):
            if token == "-m" and i + 1 < len(command) and command[i + 1].startswith("bayeslayer"):
                module = command[i + 1]
                if importlib.util.find_spec(module.rsplit(".", 1)[0] if "." in module else module) is None or \
                        importlib.util.find_spec(module) is None:
                    problems.append(f"{block.where}: no module {module}")
            if re.fullmatch(r"(benchmarks|tests|tools|bayeslayer|\.ci)/[\w./-]+\.(py|sh)", token) and \
                    not (root / token).is_file():
                problems.append(f"{block.where}: no file {token}")
    return problems


def problems(root: Path) -> list[str]:
    """Every block of ``root``'s README.md and docs/*.md that is neither run nor marked with a reason, or whose
    marker names something that is not there, or whose shell commands do not parse."""
    from bayeslayer.cli import build_parser

    parser = build_parser()
    found = []
    for block in all_blocks(root):
        found += marker_problems(root, block)
        if block.language == "shell":
            found += shell_problems(root, block, parser)
    return found


# -- running the run blocks -------------------------------------------------------------------------


def run_document(root: Path, doc: str) -> dict:
    """Run ``doc``'s ``run`` blocks in order in one namespace (the caller picks the working folder); a failure
    names the block.  Returns the namespace."""
    import torch

    namespace = {"__name__": "bayeslayer_doc_" + re.sub(r"\W", "_", doc)}
    for block in code_blocks(root, doc):
        if block.marker is None or not re.fullmatch(r"run(?:; given [\w, ]+)?", block.marker):
            continue
        for name in given_names(block):
            exec(GIVEN[doc][name], {"torch": torch}, namespace)
        try:
            exec(compile(block.code, f"<{block.where}>", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{block.where}: the block failed: {type(error).__name__}: {error}") from error
    return namespace


def run_blocks(root: Path, doc: str) -> list[Block]:
    return [b for b in code_blocks(root, doc) if b.marker and re.fullmatch(r"run(?:; given [\w, ]+)?", b.marker)]


RUN_DOCS = [doc for doc in documents(ROOT) if run_blocks(ROOT, doc)]


def test_every_block_is_run_or_says_why_not():
    found = problems(ROOT)
    assert not found, "\n".join(found)


def test_the_docs_have_blocks_of_every_marker():
    """The guard has something to guard: blocks run here, by other tests, as recipes, and not run."""
    markers = [b.marker for b in all_blocks(ROOT)]
    assert len(markers) >= 70
    assert sum(m.startswith("run") and not m.startswith("run by") for m in markers) >= 8
    assert sum(m.startswith("run by") for m in markers) >= 3
    assert sum(m.startswith("recipe: ") for m in markers) >= 7
    assert {m.split(":")[0] for m in markers} >= set(KINDS)


@pytest.mark.parametrize("doc", RUN_DOCS)
def test_run_blocks(doc, tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)  # what the blocks write (out/...) lands here
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(0)
    namespace = run_document(ROOT, doc)
    if doc == "README.md":  # the op returns the final state it is asked for, to be passed back as initial_state
        assert namespace["state"] is not None


def test_illustrative_blocks_and_their_reasons():
    """Lists the blocks not run and why (shown with ``pytest -s -n 0``); every reason is a sentence, not a word."""
    skipped = [b for b in all_blocks(ROOT) if b.marker and b.marker.split(":")[0] in KINDS]
    for b in skipped:
        print(f"{b.where}: {b.marker}")
    assert all(len(b.marker.split(":", 1)[1].split()) >= 3 for b in skipped), [
        b.where for b in skipped if len(b.marker.split(":", 1)[1].split()) < 3]


# -- the guard finds what it must --------------------------------------------------------------------


def plant(tmp_path: Path, doc: str, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_x.py").write_text('def test_y():\n    recipe("demo")\n')
    (tmp_path / doc).write_text(text, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("text, needle", [
    ("Intro.\n\n```python\nx = 1\n```\n", "a python block with no marker"),
    ("Run:\n\n```bash\nbayeslayer collision --out x\n```\n", "a shell block with no marker"),
    ("<!-- snippet: maybe later -->\n```python\nx = 1\n```\n", "unknown marker"),
    ("<!-- snippet: slow: takes long -->\n```python\nx = 1\n```\n", "unknown marker"),
    ("<!-- snippet: run -->\n```bash\nls\n```\n", "only python blocks can be run"),
    ("<!-- snippet: run; given zz -->\n```python\nx = zz\n```\n", "'zz' is not given"),
    ("<!-- snippet: run by tests/test_none.py -->\n```python\nx = 1\n```\n", "tests/test_none.py does not exist"),
    ("<!-- snippet: run by tests/test_x.py::test_z -->\n```python\nx = 1\n```\n", "has no test test_z"),
    ("<!-- recipe: other -->\n```python\nx = 1\n```\n", "no test under tests/ runs the recipe 'other'"),
    ("<!-- snippet: long: a long run of it -->\n```bash\nbayeslayer collision --no-such-option 3\n```\n",
     "does not parse"),
    ("<!-- snippet: long: a long run of it -->\n```bash\ntorchrun --nproc-per-node 2 -m bayeslayer.cli nosuch\n```\n",
     "does not parse"),
    ("<!-- snippet: long: a long run of it -->\n```bash\npython benchmarks/no_such.py --quick\n```\n",
     "no file benchmarks/no_such.py"),
    ("<!-- snippet: long: a long run of it -->\n```sh\npython -m bayeslayer.no_such run\n```\n",
     "no module bayeslayer.no_such"),
])
def test_the_guard_finds_planted_rot(tmp_path, text, needle):
    root = plant(tmp_path, "docs/x.md", text)
    found = problems(root)
    assert len(found) == 1 and found[0].startswith("docs/x.md:") and needle in found[0], found


def test_the_guard_passes_marked_blocks(tmp_path):
    text = ("<!-- snippet: run; given q -->\n```python\nx = q + 1\n```\n\n"
            "<!-- recipe: demo -->\n```python\nx = 1\n```\n\n"
            "<!-- snippet: run by tests/test_x.py::test_y -->\n```python\nx = 1\n```\n\n"
            "<!-- snippet: gpu: needs a CUDA device -->\n```bash\nbayeslayer collision --out results/c  # note\n"
            "torchrun --nproc-per-node 2 -m bayeslayer.cli lm train --preset tiny \\\n    --shard fsdp\n```\n\n"
            "```\nM_t = A M_{t-1}\n```\n")
    root = plant(tmp_path, "README.md", text)
    (root / "docs").mkdir(exist_ok=True)
    assert problems(root) == []


def test_a_failing_run_block_fails_the_run_and_names_itself(tmp_path, monkeypatch):
    root = plant(tmp_path, "docs/x.md", "<!-- snippet: run -->\n```python\nx = 2\n```\n\n"
                                        "<!-- snippet: run -->\n```python\ny = x / 0\n```\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match=r"docs/x.md:7: the block failed: ZeroDivisionError"):
        run_document(root, "docs/x.md")
    ok = plant(tmp_path, "docs/x.md", "<!-- snippet: run -->\n```python\nx = 2\n```\n\n"
                                      "<!-- snippet: run -->\n```python\ny = x * 3\n```\n")
    assert run_document(ok, "docs/x.md")["y"] == 6
