"""RULER NIAH scoring and decoding (bayeslayer.evaluation.niah): string_match_all on hand-made answers, the
six-task summary, greedy answers against a manual argmax loop, a flash-linear-attention checkpoint evaluated."""

import pytest
import torch

from bayeslayer.evaluation import niah as niah_eval
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.models.pretrained import load_model

from . import niah_setup

# the shared module-scoped fixtures
tokenizer, generator = niah_setup.tokenizer, niah_setup.generator


# ----------------------------------------------------------------------------- scoring


def test_scoring_follows_ruler_string_match_all():
    assert niah_eval.score_prediction(" 1234567.", ["1234567"]) == 1.0
    assert niah_eval.score_prediction(" 123456", ["1234567"]) == 0.0
    assert niah_eval.score_prediction("it is 7654321 or maybe 1234567", ["1234567"]) == 1.0
    uuid = "8F2C0A1E-0000-4000-8000-000000000000"
    assert niah_eval.score_prediction(f"the code is {uuid.lower()}", [uuid]) == 1.0  # case-insensitive
    four = ["1111111", "2222222", "3333333", "4444444"]
    assert niah_eval.score_prediction("2222222, 4444444 and 9999999", four) == 0.5
    assert niah_eval.score_prediction("", four) == 0.0
    assert niah_eval.score_predictions(["1111111 2222222 3333333 4444444", "1111111"],
                                       [four, four]) == pytest.approx(62.5)


def test_summary_averages_the_six_tasks_per_length():
    cells = [{"task": t, "length": L, "depth": d, "n": 2, "score": s}
             for t, s in (("niah_single_1", 100.0), ("niah_single_2", 50.0), ("niah_multikey_2", 0.0))
             for L in (2048, 4096) for d in (0.0, 100.0)]
    cells.append({"task": "niah_single_1", "length": 2048, "depth": 50.0, "n": 2, "score": 40.0})
    out = niah_eval.summarize(cells)
    assert out["task_length"]["niah_single_1"]["2048"] == pytest.approx(80.0)  # (100 + 100 + 40) / 3
    assert out["summary"]["2048"] == pytest.approx((80.0 + 50.0) / 2)        # multikey_2 is not in the six
    assert out["summary"]["4096"] == pytest.approx(75.0)
    assert out["summary_tasks"] == ["niah_single_1", "niah_single_2"]
    assert "niah_multivalue" in out["missing"]
    assert len(niah_eval.SUMMARY_TASKS) == 6
    assert {"niah_single_1", "niah_single_2", "niah_multivalue", "niah_multiquery"} <= set(niah_eval.SUMMARY_TASKS)


def test_greedy_answers_equal_a_manual_argmax_loop(tmp_path, tokenizer, generator):
    torch.manual_seed(0)
    config = BayesLayerConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                              num_heads=2, head_dim=16, mixer="bayesian")
    model = BayesLayerForCausalLM(config).eval()
    s = generator.sample("niah_single_1", 300, 50, max_new_tokens=5)
    [answer] = niah_eval.generate_answers(model, [s], generator.tokenizer)
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = ids[0, len(s.input_ids):].tolist()
    eos = generator.tokenizer.eos_id()
    if eos in expected:
        expected = expected[: expected.index(eos)]
    assert answer == generator.tokenizer.decode(expected)


def test_answers_decode_on_the_cache_even_when_the_config_says_use_cache_false(tokenizer, generator):
    """Folders that ``lm train`` wrote before it saved ``use_cache: true``: one prefill, then one token per
    forward call, not the whole prefix again at every step."""
    torch.manual_seed(0)
    config = BayesLayerConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
                              num_heads=2, head_dim=16, mixer="bayesian", use_cache=False)
    model = BayesLayerForCausalLM(config).eval()
    samples = [generator.sample("niah_single_1", 300, 50, max_new_tokens=4)]
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    niah_eval.generate_answers(model, samples, generator.tokenizer)
    assert seen[0] == len(samples[0].input_ids) and set(seen[1:]) <= {1} and len(seen) >= 2


def test_bad_scoring_arguments():
    with pytest.raises(ValueError, match="answers"):
        niah_eval.score_prediction("x", [])
    with pytest.raises(ValueError, match="answers"):
        niah_eval.score_prediction("x", "1234567")
    with pytest.raises(TypeError, match="prediction"):
        niah_eval.score_prediction(None, ["1"])
    with pytest.raises(ValueError, match="as many predictions"):
        niah_eval.score_predictions(["a"], [["1"], ["2"]])


def test_an_fla_gated_deltanet_checkpoint_is_evaluated_as_gdn_zero(tmp_path, tokenizer, generator):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform"
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    torch.manual_seed(0)
    fla = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
        expand_v=2, hidden_ratio=2, fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False))
    fla.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert isinstance(model, BayesLayerForCausalLM) and model.config.layer_mixers == ["gated_deltanet"] * 2
    cells = niah_eval.evaluate(model, generator, tasks=["niah_single_1"], lengths=[300], depths=[50.0],
                          samples_per_cell=2, max_new_tokens=3, batch_size=2)
    assert cells[0]["n"] == 2 and 0 <= cells[0]["score"] <= 100
