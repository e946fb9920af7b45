"""``bayeslayer niah``: exact length and located depth of every prompt variant, determinism, an end-to-end run
on tiny random models (JSON, tables, plots, --plot-only), the heatmap, bad arguments.  Scoring and decoding:
tests/evaluation/test_niah.py."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from bayeslayer.cli import main as cli_main
from bayeslayer.data import niah as data_niah
from bayeslayer.errors import UsageError
from bayeslayer.evaluation import niah as niah_eval
from bayeslayer.experiments import niah
from bayeslayer.experiments.common import niah_run
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM, replace_layers
from bayeslayer.models.pretrained import load_model
from tests.evaluation import niah_setup
from tests.evaluation.niah_setup import TEMPLATE

from .corpus import ESSAYS

# the shared module-scoped fixtures
tokenizer, generator = niah_setup.tokenizer, niah_setup.generator


# ----------------------------------------------------------------------------- generators


def _max_unit_tokens(gen, task, sample):
    """The longest context unit (haystack sentence, needle line) the sample can contain, in tokens."""
    spec = data_niah.TASKS[task]
    enc = gen.tokenizer.encode
    needle = max(len(enc(" " + data_niah.NEEDLE.format(vtype=spec.value_type, key=k, value=a)))
                 for k in sample.queries for a in sample.answers)
    if spec.haystack == "essay":
        return max(needle, max(len(enc(" " + u)) for u in gen.essay_units))
    if spec.haystack == "noise":
        return max(needle, len(enc("\n" + data_niah.NOISE_PARAGRAPH)))
    return 2 * needle  # key-value lines: needles of other random keys


@pytest.mark.parametrize("task", list(data_niah.TASKS))
def test_every_variant_has_the_exact_length_and_the_needle_at_the_depth(generator, task):
    gen = generator
    for length in (640, 1024):
        for depth in (0, 10, 30, 50, 70, 90, 100):
            s = gen.sample(task, length, depth, index=depth, max_new_tokens=16)
            assert len(s.input_ids) == length - 16
            text = gen.tokenizer.decode(s.input_ids)
            spec = data_niah.TASKS[task]
            assert len(s.answers) == spec.num_values * spec.num_queries
            for key in s.queries:
                assert text.count(key) >= 2, (key, text[-300:])  # in its needle and in the question
            for value in s.answers:
                assert value in text
            # locate every answer needle by its own token ids: they form one contiguous block
            sep = data_niah.SEPARATORS[spec.haystack]
            found = []
            for key in s.queries:
                for value in s.answers:
                    needle = data_niah.NEEDLE.format(vtype=spec.value_type, key=key, value=value)
                    ids = gen.tokenizer.encode(sep + needle)
                    at = data_niah._find(s.input_ids, ids)
                    if at >= 0:
                        found.append((at, len(ids)))
            found.sort()
            assert len(found) == len(s.answers)
            for (a, n), (b, _) in zip(found, found[1:]):
                assert a + n == b, "answer needles are not contiguous"
            start, end = s.context_span
            assert start <= found[0][0] and found[-1][0] + found[-1][1] <= end
            assert found[0][0] == s.needle_start
            others = (end - start) - sum(n for _, n in found)
            located = 100.0 * (found[0][0] - start) / others
            tolerance = 100.0 * _max_unit_tokens(gen, task, s) / others
            assert abs(located - depth) <= tolerance, (task, length, depth, located, tolerance)
            assert abs(s.depth_realized - depth) <= tolerance
            assert s.depth_realized == pytest.approx(located)
            if depth == 0:
                assert found[0][0] == start
            if depth == 100 and spec.num_keys == spec.num_queries:
                assert s.depth_realized == pytest.approx(100.0)


def test_samples_are_deterministic_and_vary_with_index(tokenizer, generator):
    again = data_niah.NiahGenerator(tokenizer, ESSAYS, seed=0)
    a = generator.sample("niah_multiquery", 512, 40, 3, max_new_tokens=8)
    assert again.sample("niah_multiquery", 512, 40, 3, max_new_tokens=8) == a
    assert generator.sample("niah_multiquery", 512, 40, 4, max_new_tokens=8).answers != a.answers
    other_seed = data_niah.NiahGenerator(tokenizer, ESSAYS, seed=1).sample("niah_multiquery", 512, 40, 3,
                                                                      max_new_tokens=8)
    assert other_seed.answers != a.answers


def test_prompt_reads_like_ruler(generator):
    s = generator.sample("niah_single_2", 512, 50, 0, max_new_tokens=8)
    text = generator.tokenizer.decode(s.input_ids)
    assert text.startswith("A special magic number is hidden within the following text.")
    assert text.endswith(f"The special magic number for {s.queries[0]} mentioned in the provided text is")
    m = generator.sample("niah_multivalue", 512, 50, 0, max_new_tokens=8)
    assert generator.tokenizer.decode(m.input_ids).endswith("mentioned in the provided text are")


def test_text_corpus_haystack(tmp_path, tokenizer):
    from bayeslayer.data.text import load_text_corpus

    for split, text in (("train", ESSAYS[0]), ("validation", ESSAYS[1]), ("test", ESSAYS[2])):
        (tmp_path / f"{split}.txt").write_text(text)
    corpus = load_text_corpus(tmp_path, tokenizer=tokenizer, eos_token="<|endoftext|>", cache_dir=tmp_path / "c")
    gen = data_niah.NiahGenerator(tokenizer, corpus, seed=0)
    assert gen.essay_units and "freezes" in " ".join(gen.essay_units)
    assert len(gen.sample("niah_single_2", 400, 50, max_new_tokens=8).input_ids) == 392


# ----------------------------------------------------------------------------- end to end


def _tiny_model_dir(path, tokenizer, bayesian: bool, seed: int):
    torch.manual_seed(seed)
    config = BayesLayerConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                              num_heads=2, head_dim=16, mixer="gated_deltanet")
    model = BayesLayerForCausalLM(config)
    if bayesian:
        replace_layers(model, [1])
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def _run(argv):
    parser = argparse.ArgumentParser()
    niah.add_parser(parser.add_subparsers())
    args = parser.parse_args(["niah", *argv])
    return args.func(args)


def test_end_to_end_niah_run_writes_json_tables_and_plots(tmp_path, tokenizer, capsys):
    bl = _tiny_model_dir(tmp_path / "bl", tokenizer, True, 0)
    gdn = _tiny_model_dir(tmp_path / "gdn", tokenizer, False, 1)
    essays = tmp_path / "essays"
    essays.mkdir()
    for i, text in enumerate(ESSAYS):
        (essays / f"essay{i}.txt").write_text(text)
    out = tmp_path / "out"
    argv = ["--model", f"BL={bl}", "--model", f"GDN-zero={gdn}", "--lengths", "512",
            "--depths", "0,100", "--samples-per-cell", "2", "--max-new-tokens", "4", "--batch-size", "2",
            "--haystack", str(essays), "--out", str(out), "--quiet", "--device", "cpu"]
    assert cli_main(["niah", *argv]) == 0  # through the command line: exit code 0, not the results dict
    data = json.loads((out / "niah.json").read_text())
    assert list(data["models"]) == ["BL", "GDN-zero"]
    for m in data["models"].values():
        assert len(m["cells"]) == 8 * 2
        assert all(c["n"] == 2 and len(c["scores"]) == 2 and 0 <= c["score"] <= 100 for c in m["cells"])
        assert set(m["summary"]) == {"512"}
        assert m["summary_tasks"] == list(niah_eval.SUMMARY_TASKS)
    lines = (out / "predictions_BL.jsonl").read_text().splitlines()
    assert len(lines) == 8 * 2 * 2 and "prediction" in json.loads(lines[0])
    assert (out / "niah_length.png").stat().st_size > 1000
    heat = out / "niah_diff_BL_minus_GDN-zero.png"
    assert heat.stat().st_size > 1000
    md = (out / "niah.md").read_text()
    assert "| BL |" in md and "| GDN-zero |" in md and "niah_multikey_3" in md
    printed = capsys.readouterr().out
    assert "| model | 512 |" in printed
    # redraw from the JSON alone
    heat.unlink()
    assert cli_main(["niah", "--plot-only", "--out", str(out), "--diff", "GDN-zero,BL"]) == 0
    assert (out / "niah_diff_GDN-zero_minus_BL.png").stat().st_size > 1000


def test_heatmap_marks_cells_with_few_samples(tmp_path):
    def cells(score, n):
        return [{"task": t, "length": L, "depth": d, "n": n, "score": score}
                for t in niah_eval.SUMMARY_TASKS for L in (2048, 4096) for d in (0.0, 50.0)]

    results = {"config": {"summary_tasks": list(niah_eval.SUMMARY_TASKS)},
               "models": {"BL": {"cells": cells(60.0, 30)}, "GDN-FT": {"cells": cells(50.0, 12)}}}
    grid = niah_eval.depth_length_grid(results["models"]["GDN-FT"]["cells"])
    assert grid[(0.0, 2048)] == (50.0, 12)
    path = niah_run.heatmap_difference(tmp_path / "h.png", results, "BL", "GDN-FT")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no model 'GDN'"):
        niah_run.heatmap_difference(tmp_path / "x.png", results, "BL", "GDN")


# ----------------------------------------------------------------------------- bad arguments


def test_bad_generator_arguments(tokenizer, generator):
    with pytest.raises(ValueError, match="unknown NIAH task"):
        generator.sample("niah_cwe", 512, 50)
    with pytest.raises(ValueError, match=r"depth must be a percentage in \[0, 100\], got 101"):
        generator.sample("niah_single_1", 512, 101)
    with pytest.raises(TypeError, match="length must be an int"):
        generator.sample("niah_single_1", 512.0, 50)
    with pytest.raises(ValueError, match="too short for niah_multiquery"):
        generator.sample("niah_multiquery", 120, 50, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generator.sample("niah_single_1", 512, 50, max_new_tokens=0)
    no_essay = data_niah.NiahGenerator(tokenizer, None)
    assert len(no_essay.sample("niah_single_1", 300, 50, max_new_tokens=8).input_ids) == 292
    with pytest.raises(ValueError, match="needs an essay haystack"):
        no_essay.sample("niah_single_2", 300, 50)
    with pytest.raises(TypeError, match="essays must all be str"):
        data_niah.NiahGenerator(tokenizer, ["text", 3])
    with pytest.raises(TypeError, match="sequence of str"):
        data_niah.NiahGenerator(tokenizer, "one long string")
    with pytest.raises(TypeError, match="tokenizer"):
        data_niah.NiahGenerator(42, ESSAYS)


def test_bad_cli_arguments(tmp_path):
    with pytest.raises(UsageError, match="at least one --model"):
        _run(["--out", str(tmp_path)])
    with pytest.raises(UsageError, match="unknown task 'niah_cwe'"):
        _run(["--model", str(tmp_path), "--tasks", "niah_cwe", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="distinct"):
        _run(["--model", f"A={tmp_path}", "--model", f"A={tmp_path}", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="depths"):
        _run(["--model", str(tmp_path), "--depths", "0,120", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="--lengths"):
        _run(["--model", str(tmp_path), "--lengths", "8", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="which does not exist"):
        _run(["--plot-only", "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_bos_of_a_llama_style_tokenizer_leads_the_prompt_and_no_eos_is_appended(tokenizer):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tk = Tokenizer.from_str(tokenizer.to_str())
    tk.add_special_tokens(["<s>", "</s>"])
    bos, eos = tk.token_to_id("<s>"), tk.token_to_id("</s>")
    tk.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    gen = data_niah.NiahGenerator(tk, ESSAYS, seed=0)
    s = gen.sample("niah_single_2", 400, 50, max_new_tokens=8)
    assert len(s.input_ids) == 392
    assert s.input_ids[0] == bos and s.input_ids.count(bos) == 1 and eos not in s.input_ids


def test_the_cli_knows_niah(tmp_path):
    from bayeslayer.cli import build_parser

    args = build_parser().parse_args(["niah", "--model", f"BL={tmp_path}", "--lengths", "2048,4096", "--diff", "A,B"])
    assert niah.config_from_args(args) == niah.NiahConfig(models=(("BL", str(tmp_path)),), lengths=(2048, 4096),
                                                          diff=(("A", "B"),))


def test_niah_run_is_called_with_a_config(tmp_path, tokenizer, capsys):
    """`niah.run(NiahConfig(...))` directly, as `distill eval` calls it: a tiny model, one task, one cell."""
    model = _tiny_model_dir(tmp_path / "m", tokenizer, False, 0)
    config = niah.NiahConfig(models=[("M", model)], out=str(tmp_path / "out"), lengths=[300], depths=[50.0],
                             tasks=["niah_single_1"], samples_per_cell=2, max_new_tokens=3, device="cpu", quiet=True)
    results = niah.run(config)
    saved = json.loads((tmp_path / "out" / "niah.json").read_text())
    assert saved.pop("provenance")["seeds"] == [config.seed]
    assert saved == json.loads(json.dumps(results))
    [cell] = results["models"]["M"]["cells"]
    assert (cell["task"], cell["length"], cell["depth"], cell["n"]) == ("niah_single_1", 300, 50.0, 2)
    assert results["config"]["lengths"] == [300] and results["config"]["tasks"] == ["niah_single_1"]
    redrawn = niah.redraw(tmp_path / "out")
    assert redrawn.pop("provenance")["backfilled"] is False
    assert redrawn == json.loads(json.dumps(results))
    with pytest.raises(TypeError, match="NiahConfig"):
        niah.run(argparse.Namespace(**vars(config)))
    with pytest.raises(ValueError, match="samples_per_cell must be an integer >= 1"):
        niah.NiahConfig(samples_per_cell=0)
    with pytest.raises(UsageError, match="at least one --model"):
        niah.run(niah.NiahConfig(out=str(tmp_path / "o2")))


def test_the_generator_lives_in_the_data_layer():
    """One generator: the evaluation and the command take data.niah's, neither defines its own."""
    assert niah_eval.NiahGenerator is data_niah.NiahGenerator
    for module in (niah_eval, niah, niah_run):
        assert "class NiahGenerator" not in Path(module.__file__).read_text()


def test_sentencepiece_style_pieces_are_encoded_in_context():
    """A Metaspace tokenizer that marks the start of every string it encodes must not put a word
    marker (an extra space) before each haystack sentence, needle or the question."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    texts = (ESSAYS * 4 + [TEMPLATE + "\n"] * 8 + [data_niah.NOISE_PARAGRAPH] * 4
             + [" ".join(data_niah.WORDS[::5]) + "-:"])
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "</s>"],
                                                      show_progress=False))
    assert tk.encode("\nWhat").tokens[0] == "▁"  # encoded alone, a piece gets a word marker
    gen = data_niah.NiahGenerator(tk, ESSAYS, seed=0)
    for task in ("niah_single_2", "niah_multikey_2"):
        s = gen.sample(task, 600, 50, max_new_tokens=8)
        assert len(s.input_ids) == 592
        text = gen.tokenizer.decode(s.input_ids)
        assert "  " not in text and " \n" not in text, text[:300]
        assert f"\nWhat is the special magic number for {s.queries[0]} mentioned" in text
