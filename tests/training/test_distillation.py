"""Distillation objectives: the loss terms against hand computations, KL direction, the weight
schedule, hooks, the trainable set on a tiny retrofitted model, freeze-and-verify, bad input."""

import math

import pytest
import torch

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM, replace_layers
from bayeslayer.training import distillation as dl


def _t(rows):
    return torch.tensor([rows], dtype=torch.float64)  # [1, T, d]


# ----------------------------------------------------------------------------- Phase A terms


def test_normalized_mse_by_hand():
    teacher = _t([[1.0, 2.0], [3.0, 6.0], [5.0, 10.0]])
    student = teacher + _t([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    # per-channel means (3, 6); squared deviations 4+16+0+0+4+16 = 40; squared error 1 + 4 = 5
    assert dl.normalized_mse(student, teacher).item() == pytest.approx(5 / 40)
    # masking the last token: means (2, 4), deviations 1+4+1+4 = 10, error still 5
    mask = torch.tensor([[1, 1, 0]])
    assert dl.normalized_mse(student, teacher, mask).item() == pytest.approx(5 / 10)
    # predicting the per-channel mean scores exactly 1
    mean = teacher.mean(dim=1, keepdim=True).expand_as(teacher)
    assert dl.normalized_mse(mean, teacher).item() == pytest.approx(1.0)


def test_cosine_distance_by_hand():
    teacher = _t([[0.0, 1.0], [2.0, 2.0], [1.0, 0.0]])
    student = _t([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]])  # cosines 0, 1, -1
    assert dl.cosine_distance(student, teacher).item() == pytest.approx(1 - 0 / 3)
    assert dl.cosine_distance(student, teacher, torch.tensor([[0, 1, 0]])).item() == pytest.approx(0.0)
    assert dl.cosine_distance(student, teacher, torch.tensor([[1, 0, 1]])).item() == pytest.approx(1.5)


def test_layer_matching_loss_averages_layers_with_the_cosine_weight():
    torch.manual_seed(0)
    t = {3: torch.randn(2, 5, 4, dtype=torch.float64), 7: torch.randn(2, 5, 4, dtype=torch.float64)}
    s = {k: v + 0.3 * torch.randn_like(v) for k, v in t.items()}
    loss, parts = dl.layer_matching_loss(s, t)
    expected = sum(dl.normalized_mse(s[k], t[k]) + 0.05 * dl.cosine_distance(s[k], t[k]) for k in t) / 2
    assert loss.item() == pytest.approx(expected.item())
    assert parts["nmse/3"] == pytest.approx(dl.normalized_mse(s[3], t[3]).item())
    assert set(parts) == {"nmse", "cos_distance", "nmse/3", "nmse/7", "cos_distance/3", "cos_distance/7"}
    same, _ = dl.layer_matching_loss(t, t)
    assert same.item() == pytest.approx(0.0, abs=1e-12)


def test_phase_a_gradient_reaches_the_student_only():
    teacher = torch.randn(1, 4, 3, requires_grad=True)
    student = torch.randn(1, 4, 3, requires_grad=True)
    loss, _ = dl.layer_matching_loss({0: student}, {0: teacher})
    loss.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


# ----------------------------------------------------------------------------- Phase B terms


def test_kl_is_teacher_to_student_on_a_known_pair():
    p, q = [0.9, 0.1], [0.5, 0.5]
    kl_pq = sum(a * math.log(a / b) for a, b in zip(p, q))   # 0.3681
    kl_qp = sum(b * math.log(b / a) for a, b in zip(p, q))   # 0.5108
    assert abs(kl_pq - kl_qp) > 0.1
    teacher = torch.tensor([[p]]).log()
    student = torch.tensor([[q]]).log() + 3.0                 # logits: shift-invariant
    assert dl.kl_teacher_student(teacher, student).item() == pytest.approx(kl_pq, rel=1e-5)
    assert dl.kl_teacher_student(student, teacher).item() == pytest.approx(kl_qp, rel=1e-5)


def test_kl_mask_and_temperature():
    torch.manual_seed(1)
    teacher, student = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    per_token = (teacher.softmax(-1) * (teacher.log_softmax(-1) - student.log_softmax(-1))).sum(-1)
    expected = per_token[mask].mean().item()
    assert dl.kl_teacher_student(teacher, student, mask).item() == pytest.approx(expected, rel=1e-5)
    tau = 2.0
    scaled = (teacher / tau).softmax(-1) * ((teacher / tau).log_softmax(-1) - (student / tau).log_softmax(-1))
    assert dl.kl_teacher_student(teacher, student, temperature=tau).item() == pytest.approx(
        tau**2 * scaled.sum(-1).mean().item(), rel=1e-5)


def test_phase_b_weight_schedule():
    assert dl.phase_b_weights(0, 100) == (0.8, 0.2)
    assert dl.phase_b_weights(99, 100) == (0.8, 0.2)
    assert dl.phase_b_weights(100, 100) == (0.9, 0.1)
    assert dl.phase_b_weights(5000, 100) == (0.9, 0.1)
    assert dl.phase_b_weights(3, 0) == (0.9, 0.1)


def test_joint_loss_combines_kl_and_nmse():
    torch.manual_seed(2)
    tl, sl = torch.randn(1, 4, 9), torch.randn(1, 4, 9)
    to, so = {1: torch.randn(1, 4, 5)}, {1: torch.randn(1, 4, 5)}
    loss, parts = dl.joint_loss(tl, sl, so, to, weights=(0.9, 0.1))
    kl = dl.kl_teacher_student(tl, sl).item()
    nmse = dl.normalized_mse(so[1], to[1]).item()
    assert loss.item() == pytest.approx(0.9 * kl + 0.1 * nmse, rel=1e-5)
    assert parts == pytest.approx({"kl": kl, "nmse": nmse, "w_kl": 0.9, "w_mse": 0.1})


# ----------------------------------------------------------------------------- models


def _teacher(layers=4):
    torch.manual_seed(0)
    config = BayesLayerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_heads=2, head_dim=16,
                              mixer="gated_deltanet", tie_word_embeddings=False)
    return BayesLayerForCausalLM(config).eval()


def _student(teacher, layers):
    student = BayesLayerForCausalLM(teacher.config.__class__.from_dict(teacher.config.to_dict()))
    student.load_state_dict(teacher.state_dict())
    replace_layers(student, layers)
    return student


def test_capture_hooks_record_the_mixer_outputs_and_are_removed():
    model = _teacher()
    ids = torch.randint(0, 64, (2, 6))
    seen = {}

    def reference_hook(module, args, out):
        seen["o"] = out.o  # returns None: the output is left as it is

    handle = model.model.layers[2].attn.register_forward_hook(reference_hook)
    with dl.MixerOutputCapture(model, [2, 0]) as cap:
        model(ids)
        assert sorted(cap.outputs) == [0, 2]
        assert cap.outputs[2].shape == (2, 6, 32)
        assert torch.equal(cap.outputs[2], seen["o"])
    handle.remove()
    assert all(not layer.attn._forward_hooks for layer in model.model.layers)
    assert cap.outputs == {}


def test_trainable_selection_on_a_retrofitted_model():
    teacher = _teacher()
    student = _student(teacher, [1, 3])
    sel = dl.select_trainable(student, [1, 3], lr=1e-3, mlp_parts=("down_proj",), weight_decay=0.1)
    names = sel.names
    assert "model.layers.1.attn.r2_proj.weight" in names["new_projections"]
    assert "model.layers.3.attn.ell2_proj.weight" in names["new_projections"]
    assert "model.layers.1.attn.q_proj.weight" in names["old_projections"]
    assert "model.layers.1.attn.o_proj.weight" in names["old_projections"]
    assert "model.layers.3.attn.g_proj.weight" in names["output_gate"]
    assert {"model.layers.1.attn.A_log", "model.layers.1.attn.r2_bias"} <= set(names["recurrence"])
    assert names["mlp"] == ["model.layers.1.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight"]
    everything = dict(student.named_parameters())
    expected = {n for n in everything if n.startswith(("model.layers.1.attn.", "model.layers.3.attn."))}
    expected |= set(names["mlp"])
    assert set(sel.trainable) == expected
    assert {n for n, p in everything.items() if p.requires_grad} == expected
    assert set(sel.frozen) == set(everything) - expected
    groups = {g["name"]: g for g in sel.param_groups}
    assert groups["mixers"]["lr"] == 1e-3 and groups["mixers"]["weight_decay"] == 0.1
    assert groups["mixers/no_decay"]["weight_decay"] == 0.0
    assert groups["mlp"]["lr"] == pytest.approx(1e-4)
    assert sum(len(g["params"]) for g in sel.param_groups) == len(expected)


def test_gdn_ft_control_selects_the_same_layers_of_the_teacher():
    teacher = _teacher()
    sel = dl.select_trainable(teacher, [1, 3], lr=1e-3)
    assert "model.layers.1.attn.b_proj.weight" in sel.names["recurrence"]
    assert not sel.names["new_projections"] and not sel.names["mlp"]
    assert {n.split(".attn.")[0] for n in sel.trainable} == {"model.layers.1", "model.layers.3"}


def test_phase_a_then_b_steps_train_only_the_selection():
    teacher = _teacher()
    for p in teacher.parameters():
        p.requires_grad_(False)
    layers = [1, 3]
    student = _student(teacher, layers).train()
    sel = dl.select_trainable(student, layers, lr=3e-3, mlp_parts=("down_proj",))
    frozen = dl.freeze_and_snapshot(student, sel)
    trained = dl.ParameterSnapshot(student, sel.trainable)
    optim = torch.optim.AdamW(sel.param_groups)
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (4, 24))
    losses = []
    with dl.MixerOutputCapture(student, layers) as s, dl.MixerOutputCapture(teacher, layers) as t:
        for step in range(12):
            with torch.no_grad():
                teacher_logits = teacher(ids).logits
            student_logits = student(ids).logits
            if step < 6:
                loss, _ = dl.layer_matching_loss(s.outputs, t.outputs)
            else:
                loss, _ = dl.joint_loss(teacher_logits, student_logits, s.outputs, t.outputs,
                                        weights=dl.phase_b_weights(step - 6, 3))
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[5] < losses[0]
    frozen.assert_unchanged(student)
    moved = set(trained.changed(student))
    assert moved >= {"model.layers.1.attn.r2_proj.weight", "model.layers.3.mlp.down_proj.weight"}


def test_phase_a_on_the_teachers_inputs():
    teacher = _teacher()
    layers = [1, 3]
    student = _student(teacher, layers).train()
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    with torch.no_grad(), dl.MixerOutputCapture(teacher, layers) as t:
        teacher(ids, attention_mask=mask)
        targets, inputs = dict(t.outputs), dict(t.inputs)
        assert torch.equal(t.masks[1], mask)
    assert inputs[1].shape == (2, 16, 32)
    # a GDN mixer run on its own captured input reproduces its output
    again = dl.mixer_outputs_on(teacher, inputs, mask)
    torch.testing.assert_close(again[3], targets[3])
    # the student's replaced mixers on the teacher's inputs: one independent regression per layer
    sel = dl.select_trainable(student, layers, lr=1e-2)
    frozen = dl.freeze_and_snapshot(student, sel)
    optim = torch.optim.AdamW(sel.param_groups)
    valid = mask.bool()
    losses = []
    for _ in range(15):
        loss, parts = dl.layer_matching_loss(dl.mixer_outputs_on(student, inputs, mask), targets, valid)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    frozen.assert_unchanged(student)
    with pytest.raises(ValueError, match="non-empty dict"):
        dl.mixer_outputs_on(student, {})


def test_snapshot_catches_a_changed_parameter():
    model = _teacher(2)
    snap = dl.ParameterSnapshot(model)
    snap.assert_unchanged(model)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-6
    assert snap.changed(model) == ["model.norm.weight"]
    with pytest.raises(AssertionError, match="model.norm.weight"):
        snap.assert_unchanged(model)


def test_freeze_and_snapshot_refuses_a_wrong_requires_grad():
    model = _teacher(2)
    sel = dl.select_trainable(model, [0], lr=1e-3)
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(AssertionError, match="lm_head"):
        dl.freeze_and_snapshot(model, sel)


# ----------------------------------------------------------------------------- bad input


def test_bad_loss_inputs():
    a, b = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="same shape"):
        dl.normalized_mse(a, torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="3 dims"):
        dl.cosine_distance(a[0], b[0])
    with pytest.raises(TypeError, match="floating"):
        dl.normalized_mse(a.long(), b)
    with pytest.raises(TypeError, match="torch.Tensor"):
        dl.normalized_mse(a.tolist(), b)
    with pytest.raises(ValueError, match="non-finite"):
        dl.normalized_mse(a, b.masked_fill(b > 0, float("nan")))
    with pytest.raises(ValueError, match=r"mask must have shape"):
        dl.normalized_mse(a, b, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="only 0 and 1"):
        dl.normalized_mse(a, b, torch.full((1, 3), 2))
    with pytest.raises(TypeError, match="bool or integer"):
        dl.normalized_mse(a, b, torch.ones(1, 3))
    with pytest.raises(ValueError, match="no token"):
        dl.normalized_mse(a, b, torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="variance is 0"):
        dl.normalized_mse(a, torch.ones(1, 3, 4))
    with pytest.raises(ValueError, match="temperature"):
        dl.kl_teacher_student(a, b, temperature=0.0)
    with pytest.raises(ValueError, match="differ"):
        dl.layer_matching_loss({1: a}, {2: b})
    with pytest.raises(ValueError, match="no layer"):
        dl.layer_matching_loss({}, {})
    with pytest.raises(ValueError, match="cosine_weight"):
        dl.layer_matching_loss({1: a}, {1: b}, cosine_weight=-1)
    with pytest.raises(ValueError, match="weights"):
        dl.joint_loss(a, b, {1: a}, {1: b}, weights=(0.9,))
    with pytest.raises(ValueError, match="step"):
        dl.phase_b_weights(-1, 10)
    with pytest.raises(ValueError, match="switch_step"):
        dl.phase_b_weights(1, 2.5)


def test_bad_selection_and_hook_arguments():
    model = _teacher(2)
    with pytest.raises(ValueError, match="out of range"):
        dl.select_trainable(model, [2], lr=1e-3)
    with pytest.raises(ValueError, match="duplicates"):
        dl.MixerOutputCapture(model, [0, 0])
    with pytest.raises(ValueError, match="empty"):
        dl.select_trainable(model, [], lr=1e-3)
    with pytest.raises(TypeError, match="ints"):
        dl.select_trainable(model, [0.5], lr=1e-3)
    with pytest.raises(ValueError, match="lr must"):
        dl.select_trainable(model, [0], lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        dl.select_trainable(model, [0], lr=1e-3, weight_decay=-0.1)
    with pytest.raises(ValueError, match="mlp_parts"):
        dl.select_trainable(model, [0], lr=1e-3, mlp_parts=("fc1",))
    with pytest.raises(TypeError, match="model.model.layers"):
        dl.select_trainable(torch.nn.Linear(2, 2), [0], lr=1e-3)
    with pytest.raises(ValueError, match="no parameters named"):
        dl.ParameterSnapshot(model, ["nope"])
