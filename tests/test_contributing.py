"""The README's "Contributing" recipes run as written and do what they say.

Each recipe is the fenced ``python`` block right after ``<!-- recipe: NAME -->`` in README.md.  The
test executes it in a fresh module namespace (as if it were a file of the package) and then checks the
result through the package's own entry points: the mixer through ``build_mixer``, the optimiser groups
and the state-budget solver; the design model's chunked path against its recurrent oracle in float64;
the experiment through ``run(config)``, the one training loop, its JSON and ``--plot-only`` on the CLI;
the backend through ``backend=`` and ``"auto"`` on the ops, the design models, a layer and the language model,
against the PyTorch backend.  Registry entries a recipe adds are removed again after each test.
"""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe(name: str, source: Path = README) -> str:
    """The python block right after ``<!-- recipe: name -->`` in ``source`` (README.md or a file of docs/;
    exactly one such marker)."""
    text = source.read_text()
    found = re.findall(rf"<!-- recipe: {re.escape(name)} -->\s*```python\n(.*?)```", text, flags=re.S)
    assert len(found) == 1, f"{source.name} must have exactly one '<!-- recipe: {name} -->' python block"
    return found[0]


def exec_recipe(name: str) -> types.ModuleType:
    """Run the recipe as the body of a module ``bayeslayer_recipe_<name>`` (in ``sys.modules`` while it
    runs, so dataclasses and the CLI can import it by name); the restore_registries fixture removes it."""
    module = types.ModuleType(f"bayeslayer_recipe_{name}")
    module.__file__ = f"<README recipe {name}>"
    sys.modules[module.__name__] = module
    exec(compile(recipe(name), module.__file__, "exec"), module.__dict__)
    return module


@pytest.fixture
def restore_registries():
    """Put the mixer registry, ``DESIGNS``, the backend registry and the CLI's command list back."""
    from bayeslayer import cli
    from bayeslayer.design import DESIGNS
    from bayeslayer.layers import MIXER_REGISTRY
    from bayeslayer.ops.backend import BACKEND_REGISTRY

    saved = [(d, dict(d)) for d in (MIXER_REGISTRY, DESIGNS, BACKEND_REGISTRY)]
    commands = list(cli._COMMAND_MODULES)
    modules = set(sys.modules)
    yield
    for d, items in saved:
        d.clear()
        d.update(items)
    cli._COMMAND_MODULES[:] = commands
    for name in set(sys.modules) - modules:
        if name.startswith("bayeslayer_recipe_"):
            del sys.modules[name]


def test_every_recipe_marker_has_one_block():
    for name in ("mixer", "design", "experiment", "backend"):
        assert recipe(name).strip()


# -- (a) a token mixer -----------------------------------------------------------------------------


def test_mixer_recipe(restore_registries):
    from bayeslayer.layers import MIXER_LABELS, MIXERS, build_mixer
    from bayeslayer.models.state_budget import mixer_design
    from bayeslayer.training.optim import decay_split, param_groups

    mod = exec_recipe("mixer")
    cls = mod.FixedDecayDeltaNet
    assert MIXERS["fixed_decay_deltanet"] is cls
    assert MIXER_LABELS["fixed_decay_deltanet"] == "FD-DeltaNet"
    assert mod.register_mixer.__module__ == "bayeslayer.layers.registry"  # the recipe's one registration call
    assert tuple(mod.out.o.shape) == (2, 10, 64)

    # builds by name, runs forward, and prefill + one decoding step equals one forward
    layer = build_mixer("fixed_decay_deltanet", 32, num_heads=2, head_dim=16, layer_idx=0)
    x = torch.randn(2, 9, 32)
    full = layer(x).o
    assert full.shape == x.shape and torch.isfinite(full).all()
    pre = layer(x[:, :8], use_cache=True)
    step = layer(x[:, 8:], state=pre.state, use_cache=True)
    torch.testing.assert_close(torch.cat([pre.o, step.o], 1), full, atol=1e-5, rtol=1e-4)
    assert layer.num_parameters_formula() == sum(p.numel() for p in layer.parameters())

    # the decay parameter really steers the recurrence (a gradient reaches it)
    full.square().sum().backward()
    assert layer.decay_logit.grad is not None and bool(layer.decay_logit.grad.abs().max() > 0)

    # the flagged parameter gets zero weight decay from the one optimiser's groups; projections do not
    assert decay_split(layer)["decay_logit"] == "flagged"
    groups = param_groups(layer, 0.1)
    wd = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert wd[id(layer.decay_logit)] == 0.0
    assert wd[id(layer.b_proj.weight)] == 0.1 and wd[id(layer.q_proj.weight)] == 0.1

    # the language model takes it by name, per layer (hybrids too), and decodes with its cache
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    lm_config = BayesLayerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                                 mixer="fixed_decay_deltanet", mixer_overrides={1: "gated_deltanet"})
    lm = BayesLayerForCausalLM(lm_config).eval()
    assert sum(isinstance(mx, cls) for mx in lm.modules()) == 1
    tokens = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        full = lm(tokens).logits
        pre = lm(tokens[:, :5], use_cache=True)
        nxt = lm(tokens[:, 5:], past_key_values=pre.past_key_values, use_cache=True).logits
    torch.testing.assert_close(nxt[:, -1], full[:, -1], atol=1e-4, rtol=1e-4)

    # MQAR sizes it by the state budget through its registered rule (budget="heads"), and the built layer
    # carries exactly the state the solver counted with the design's state_size (build_model checks that)
    from bayeslayer.experiments.common import mqar_setup
    from bayeslayer.models import state_budget

    assert mixer_design("fixed_decay_deltanet") is cls.design
    assert state_budget.budget_rule("fixed_decay_deltanet") == "heads"
    assert "fixed_decay_deltanet" in mqar_setup.known_mixers()
    preset = mqar_setup.PRESETS["tiny"]
    model = mqar_setup.build_model("fixed_decay_deltanet", preset, preset.width)
    head = state_budget.solve_state_budget(preset.budget, preset.width, "fixed_decay_deltanet")
    assert model.state_size_per_layer() == head.state_size <= preset.budget
    assert any(isinstance(mx, cls) for mx in model.modules())


def test_mixer_recipe_is_registered_only_while_the_test_runs():
    from bayeslayer.layers import MIXER_LABELS, MIXERS

    assert "fixed_decay_deltanet" not in MIXERS and "fixed_decay_deltanet" not in MIXER_LABELS


# -- (b) a design model ----------------------------------------------------------------------------


def test_design_recipe(restore_registries):
    from bayeslayer.design import DESIGNS, get_design

    mod = exec_recipe("design")
    design = mod.GATED_DIAGONAL
    assert DESIGNS[design.name] is design and get_design(design.name) is design
    torch.testing.assert_close(mod.out.o, mod.ref.o, atol=1e-4, rtol=1e-4)  # the recipe's own float32 run

    # float64, with an initial state: chunked == recurrent (output, variance, state) and step == recurrent
    dt = torch.float64
    B, T, H, D, m = 2, 37, 2, 6, 4
    q, k, v = torch.randn(B, T, H, D, dtype=dt), torch.randn(B, T, H, D, dtype=dt) / D**0.5, torch.randn(
        B, T, H, m, dtype=dt)
    r2, ell2 = 0.1 + torch.rand(B, T, H, dtype=dt), 0.01 + 0.1 * torch.rand(B, T, H, dtype=dt)
    alpha = 0.85 + 0.15 * torch.rand(B, T, H, dtype=dt)
    M0 = torch.randn(B, H, D, m, dtype=dt)
    P0 = torch.diag_embed(0.5 + torch.rand(B, H, D, dtype=dt))
    args = dict(r2=r2, ell2=ell2, alpha=alpha, initial_state=(M0, P0), output_final_state=True)
    rec = design.recurrent(q, k, v, **args)
    chk = design.chunk(q, k, v, **args, return_variance=True, chunk_size=16)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(chk.o, rec.o, **tol)
    torch.testing.assert_close(chk.variance, rec.variance, **tol)
    torch.testing.assert_close(chk.state[0], rec.state[0], **tol)
    torch.testing.assert_close(chk.state[1], rec.state[1], **tol)
    assert design.state_size(D, m) == D * m + D  # diagonal covariance: D·m + G·D

    state = (M0, P0)
    for t in range(T):
        out = design.step(q[:, t], k[:, t], v[:, t], state=state, r2=r2[:, t], ell2=ell2[:, t], alpha=alpha[:, t])
        torch.testing.assert_close(out.o, rec.o[:, t], **tol)
        state = out.state

    # the declared dynamics are enforced: a diagonal decay is refused
    with pytest.raises(ValueError, match="scalar dynamics"):
        design.chunk(q, k, v, r2=r2, ell2=ell2, alpha=alpha[..., None].expand(B, T, H, D))


# -- (c) an experiment -----------------------------------------------------------------------------


def test_experiment_recipe(restore_registries, tmp_path, monkeypatch):
    from bayeslayer import cli
    from bayeslayer.experiments.common import harness
    from bayeslayer.training.loop import TrainConfig, train_loop

    mod = exec_recipe("experiment")
    loops = []

    def counting_loop(*args, **kwargs):
        loops.append(args[3].steps)
        return train_loop(*args, **kwargs)

    monkeypatch.setattr(harness, "train_loop", counting_loop)
    out = tmp_path / "demo"
    config = mod.RecallDemoConfig(mixers=("gated_deltanet", "linear_attention"), width=32, seq_len=16,
                                  num_pairs=2, vocab_size=32, seeds=(0, 1),
                                  train=TrainConfig(steps=3, batch_size=4, lr=1e-3), out=str(out))
    record = mod.run(config)
    assert loops == [3, 3, 3, 3]  # two mixers × two seeds, each trained by the one loop
    saved = json.loads((out / "recall_demo.json").read_text())
    assert saved.pop("provenance")["seeds"] == [0, 1]  # written by the one results writer, with its provenance
    assert saved == json.loads(json.dumps(record))
    assert saved["experiment"] == "recall_demo" and saved["config"]["train"]["steps"] == 3
    for name in config.mixers:
        seeds = saved["models"][name]["seeds"]
        assert [s["seed"] for s in seeds] == [0, 1]
        assert all(len(s["loss_curve"]["loss"]) == 3 and 0 <= s["accuracy"] <= 1 for s in seeds)
    png = out / "recall_demo.png"
    assert png.stat().st_size > 0

    # registered on the CLI: --plot-only redraws the figure from the JSON alone, training nothing
    cli._COMMAND_MODULES.append(mod.__name__)
    png.unlink()
    loops.clear()
    assert cli.main(["recall-demo", "--out", str(out), "--plot-only"]) == 0
    assert png.stat().st_size > 0 and loops == []
    # ... and a run from the command line maps its options onto the config
    out2 = tmp_path / "cli"
    real_run = mod.run  # the command's own _main builds the config; shrink only the sizes it leaves at default
    monkeypatch.setattr(mod, "run", lambda c: real_run(replace(c, width=32, seq_len=16, num_pairs=2, vocab_size=32,
                                                              train=replace(c.train, batch_size=4))))
    assert cli.main(["recall-demo", "--mixers", "deltanet", "--steps", "2", "--seeds", "3", "--out", str(out2)]) == 0
    cli_record = json.loads((out2 / "recall_demo.json").read_text())
    assert list(cli_record["models"]) == ["deltanet"] and cli_record["config"]["seeds"] == [3]
    assert cli_record["config"]["train"]["steps"] == 2 and loops == [2]
    # a bad input is one line and exit code 2
    assert cli.main(["recall-demo", "--out", str(tmp_path / "none"), "--plot-only"]) == 2
    with pytest.raises(TypeError, match="RecallDemoConfig"):
        real_run({"mixers": ["deltanet"]})
    with pytest.raises(ValueError, match="mixers"):
        mod.RecallDemoConfig(mixers=("no_such_mixer",))



# -- (d) a backend ---------------------------------------------------------------------------------


def test_backend_recipe(restore_registries):
    from bayeslayer.design import BAYESIAN, GATED_DELTANET
    from bayeslayer.layers import BayesianLayer
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
    from bayeslayer.ops import BackendError, backend_names, bl_step, initial_bl_state
    from bayeslayer.ops.backend import BACKEND_REGISTRY, check_backend

    from .triton_spy import TorchPathRan, backend_only

    mod = exec_recipe("backend")
    counting = mod.counting
    assert BACKEND_REGISTRY["counting"] is counting and backend_names() == ("auto", "torch", "triton", "counting")
    assert mod.register_backend.__module__ == "bayeslayer.ops.backend"  # the recipe's one registration call
    assert torch.equal(mod.o, mod.ref) and counting.calls == {"chunk": 1, "step": 0}

    # float64, the variance and the state too: forced, and chosen by "auto" for CPU tensors, equal to PyTorch
    dt = torch.float64
    B, T, H, D, m = 2, 21, 2, 8, 4
    q, k, v = torch.randn(B, T, H, D, dtype=dt), torch.randn(B, T, H, D, dtype=dt) / D**0.5, torch.randn(
        B, T, H, m, dtype=dt)
    r2, ell2 = 0.1 + torch.rand(B, T, H, dtype=dt), 0.01 * torch.rand(B, T, H, dtype=dt)
    alpha = 0.9 + 0.1 * torch.rand(B, T, H, dtype=dt)
    kw = dict(r2=r2, ell2=ell2, alpha=alpha, output_final_state=True, return_variance=True, chunk_size=16)
    ref = BAYESIAN.chunk(q, k, v, backend="torch", **kw)
    for backend in ("counting", "auto"):
        with backend_only("counting") as calls:
            out = BAYESIAN.chunk(q, k, v, backend=backend, **kw)
        assert calls == {"chunk": 1}
        for a, b in ((out.o, ref.o), (out.variance, ref.variance), (out.state[0], ref.state[0]),
                     (out.state[1], ref.state[1])):
            assert torch.equal(a, b)
    st = initial_bl_state(B, H, D, m, dtype=dt)
    with backend_only("counting") as calls:
        o1, s1 = bl_step(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], alpha[:, 0], state=st, backend="counting")
    assert calls == {"step": 1}
    o2, s2 = bl_step(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], alpha[:, 0], state=st, backend="torch")
    assert torch.equal(o1, o2) and torch.equal(s1[0], s2[0]) and torch.equal(s1[1], s2[1])

    # what it does not take: "auto" falls back to PyTorch; forcing it says its reason
    with pytest.raises(TorchPathRan), backend_only("counting"):
        GATED_DELTANET.chunk(q, k, v, gain=r2, alpha=alpha, chunk_size=16)
    with pytest.raises(BackendError, match="backend='counting' cannot run this chunk: write model 'reset' is not "
                                           "forwarded"):
        GATED_DELTANET.chunk(q, k, v, gain=r2, alpha=alpha, chunk_size=16, backend="counting")

    # a layer and the language model take it by name, check their configuration against it, and equal PyTorch
    torch.manual_seed(0)
    layer = BayesianLayer(16, num_heads=2, head_dim=8, chunk_size=16, backend="counting").double()
    ref_layer = BayesianLayer(16, num_heads=2, head_dim=8, chunk_size=16, backend="torch").double()
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 16, dtype=dt)
    with torch.no_grad(), backend_only("counting") as calls:
        pre = layer(x[:, :8], use_cache=True)
        nxt = layer(x[:, 8:], state=pre.state, use_cache=True)
    assert calls == {"chunk": 1, "step": 1}
    with torch.no_grad():
        ref_pre = ref_layer(x[:, :8], use_cache=True)
        ref_nxt = ref_layer(x[:, 8:], state=ref_pre.state, use_cache=True)
    assert torch.equal(pre.o, ref_pre.o) and torch.equal(nxt.o, ref_nxt.o)
    with pytest.raises(BackendError, match=r"BayesianLayer\(backend='counting'\) cannot run this layer: write "
                                           "model 'diagonal' is not forwarded"):
        BayesianLayer(16, num_heads=2, head_dim=8, covariance="diagonal", backend="counting")
    config = BayesLayerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=8,
                              mixers=["bayesian", "attention"], mixer_kwargs={"bayesian": {"chunk_size": 16}},
                              backend="counting")
    lm = BayesLayerForCausalLM(config).eval()
    with torch.no_grad(), backend_only("counting") as calls:
        lm(torch.randint(0, 32, (1, 7)))
    assert calls == {"chunk": 1}
    with pytest.raises(BackendError, match="backend='counting' but none of the model's mixers"):
        BayesLayerForCausalLM(BayesLayerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=2,
                                               head_dim=8, mixers=["attention"], backend="counting"))
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton', 'counting'\)"):
        check_backend("count")


def test_backend_recipe_is_registered_only_while_the_test_runs():
    from bayeslayer.ops import backend_names
    from bayeslayer.ops.backend import select_backend

    assert backend_names() == ("auto", "torch", "triton")
    assert select_backend("auto", "chunk", device="cpu") == "torch"
