"""torchtitan's route (``bayeslayer.training.titan``): the model spec, its parallelisation function and its
state-dict adapter.

torchtitan is optional (not installed by the test set-up: docs/distributed.md says how to get it); without it
only the first test runs and the others skip.  With it: the registry parses as torchtitan's command line parses
it, the model built the torchtitan way (meta device, then ``init_weights``) is ``BayesLayerForCausalLM``'s,
the adapter round-trips to ``from_pretrained``'s layout, and two gloo ranks (``titan_worker.py``: torchtitan's
meshes, the spec's ``parallelize_fn``, its optimiser and loss) train as one process does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.training import titan

ROOT = Path(__file__).resolve().parents[2]
LR = 8e-4  # bayeslayer_debug's AdamW
SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16}


def test_without_torchtitan_the_module_imports_and_says_how_to_install_it(monkeypatch):
    titan._classes.cache_clear()
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # as if it were not installed
    try:
        with pytest.raises(ImportError, match="pip install torchtitan==0.3.0"):
            titan.model_spec()
        with pytest.raises(ImportError, match="pip install torchtitan"):
            titan.BayesLayerTitanModel  # noqa: B018
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            titan.nothing  # noqa: B018
    finally:
        titan._classes.cache_clear()


@pytest.fixture
def torchtitan():
    return pytest.importorskip("torchtitan", reason="torchtitan is optional: docs/distributed.md, 'torchtitan'")


def test_torchtitans_command_line_finds_the_registry(torchtitan):
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "bayeslayer.training.titan", "--config", "bayeslayer_debug",
                                         "--training.steps", "3", "--training.seq_len", "256"])
    assert config.model_spec.name == "bayeslayer" and config.model_spec.flavor == "debugmodel"
    assert config.training.steps == 3 and config.training.seq_len == 256
    assert config.model_spec.parallelize_fn is titan.parallelize_bayeslayer
    assert config.model_spec.state_dict_adapter is titan.BayesLayerStateDictAdapter
    assert config.model_spec.model.hf_config == titan.FLAVORS["debugmodel"]


def test_the_model_built_on_meta_and_initialised_is_the_hugging_face_model(torchtitan):
    spec = titan.model_spec(**SMALL)
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    params, flops = spec.model.get_nparams_and_flops(model, 48)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    torch.manual_seed(0)
    reference = BayesLayerForCausalLM(BayesLayerConfig(**SMALL, mixer="bayesian"))
    state, expected = model.lm.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    for name, buffer in reference.named_buffers():  # the mixers' buffers too, which to_empty left unset
        assert torch.equal(model.lm.get_buffer(name), buffer)
    assert params == sum(p.numel() for p in reference.parameters())
    assert flops == reference.flops(1, 48).total // 48 > 0
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16))
    assert torch.equal(model(tokens), reference(input_ids=tokens).logits)
    with pytest.raises(ValueError, match="token ids only"):
        model(tokens, positions=None)


@pytest.mark.parametrize("tied", [False, True])
def test_the_state_dict_adapter_round_trips_to_from_pretrained(torchtitan, tied, tmp_path):
    spec = titan.model_spec(**SMALL, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    hf = adapter.to_hf(model.state_dict())
    assert ("lm_head.weight" in hf) is not tied
    model.lm.save_pretrained(tmp_path)
    loaded = BayesLayerForCausalLM.from_pretrained(tmp_path)
    saved = loaded.state_dict()
    assert all(torch.equal(hf[k], saved[k]) for k in hf)
    assert set(saved) - set(hf) == ({"lm_head.weight"} if tied else set())
    native = adapter.from_hf({k: v for k, v in saved.items() if k in hf})
    torch.manual_seed(1)
    other = spec.model.build()
    other.load_state_dict(native, strict=True)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16))
    assert torch.equal(other(tokens), model(tokens))
    with pytest.raises(ValueError, match="outside the model 'lm.'"):
        adapter.to_hf({"layers.0.w": torch.zeros(1)})


def test_parallelize_refuses_what_the_model_has_no_plan_for(torchtitan):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims

    spec = titan.model_spec(**SMALL)
    with torch.device("meta"):
        model = spec.model.build()

    def parallelize(dims, parallelism=None, compile_config=None, ac=None):
        return titan.parallelize_bayeslayer(
            model, parallel_dims=ParallelDims(world_size=2, spmd_backend="partial_dtensor", **dims),
            training=TrainingConfig(), parallelism=parallelism or ParallelismConfig(spmd_backend="partial_dtensor"),
            compile_config=compile_config or CompileConfig(), ac_config=ac)

    one = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        parallelize({**one, "tp": 2})
    with pytest.raises(ValueError, match="context_parallel_degree"):
        parallelize({**one, "cp": 2})
    with pytest.raises(ValueError, match="spmd_backend must be 'partial_dtensor'"):
        parallelize({**one, "dp_shard": 2}, parallelism=ParallelismConfig(spmd_backend="spmd_types"))
    with pytest.raises(ValueError, match="compile.enable"):
        parallelize({**one, "dp_shard": 2}, compile_config=CompileConfig(enable=True))
    with pytest.raises(ValueError, match="activation_checkpoint must be 'full' or 'none'"):
        parallelize({**one, "dp_shard": 2}, ac=SelectiveAC.Config())
    with pytest.raises(TypeError, match="BayesLayerTitanModel"):
        titan.parallelize_bayeslayer(torch.nn.Linear(2, 2), parallel_dims=None, training=None, parallelism=None,
                                     compile_config=None, ac_config=None)


def _run(folder: Path, ranks: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "tests.training.titan_worker", str(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((folder / "record.json").read_text())


def test_two_ranks_train_as_one_process(torchtitan, tmp_path):
    """torchtitan's meshes, the spec's parallelize_fn (FSDP2, each block a unit, the blocks recomputed), its AdamW
    and its token-normalised loss: two gloo ranks, each with half of every batch, give the one-process losses and
    weights (float32; measured over 4 steps: losses 1.1e-7 relative, weights 8.0e-6 apart = 1% of lr) and each
    holds half of the parameters and moments."""
    one, two = _run(tmp_path / "1", 1), _run(tmp_path / "2", 2)
    assert two["fsdp_units"] == one["fsdp_units"] == ["lm", "lm.model.embeddings", "lm.model.layers.0",
                                                       "lm.model.layers.1"]
    assert two["gradient_checkpointing"] and one["gradient_checkpointing"]
    full = one["full_param_bytes"]
    assert one["param_bytes"] == full and two["param_bytes"] == full // 2
    assert two["adam_bytes"] == full  # two moments, each half of the parameters
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"]))
    assert rel <= 1e-5, (two["losses"], one["losses"])
    assert two["losses"][-1] < two["losses"][0]
    a = BayesLayerForCausalLM.from_pretrained(tmp_path / "2" / "final").state_dict()
    b = BayesLayerForCausalLM.from_pretrained(tmp_path / "1" / "final").state_dict()
    assert a.keys() == b.keys()
    # AdamW moves a weight by about lr a step whatever the gradient's size, so float32 rounding in a gradient near
    # zero shows in the weights at a fraction of lr: bound the difference by 5% of one step
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print("losses", two["losses"], "relative to one process", rel, "weights", worst)  # shown with pytest -s
    assert worst <= 0.05 * LR, worst
