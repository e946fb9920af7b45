"""The deterministic collision experiment (docs/theory.md §8.1) and its closed forms (docs/theory.md §4).

Expected values here are derived independently of the experiment code where possible
(golden-ratio gain floor, the scalar variance recursion, the delta-rule readout
recursion, the Kalman formula for B's variance change).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from bayeslayer.cli import main
from bayeslayer.design import BAYESIAN, DELTANET
from bayeslayer.experiments import collision as col
from bayeslayer.experiments.common.plotting import RefLine, Series, line_plot, load_json
from bayeslayer.experiments.common.provenance import write_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIGMOID_1 = 1.0 / (1.0 + math.exp(-1.0))


@pytest.fixture(scope="module")
def results():
    return col.run_collision()


@pytest.fixture(scope="module")
def paper_inputs():
    return col.collision_inputs([0.92])


def test_schedule_and_inputs(paper_inputs):
    schedule = "".join(col.IDENTITIES[i] for i in col.write_schedule())
    assert schedule == "ABCDEF" * 2 + "B" * 40 + "A" * 60
    q, k, v = paper_inputs
    assert q.shape == (1, 112, 1, 16) and v.shape == (1, 112, 1, 6) and q.dtype == torch.float64
    k_a, k_b = k[0, 0, 0], k[0, 1, 0]
    assert torch.equal(k_a, torch.eye(16, dtype=torch.float64)[0])
    assert (k_a @ k_b).item() == pytest.approx(0.92, abs=1e-15)
    assert k[0, :, 0].norm(dim=-1).sub(1).abs().max() < 1e-15  # unit keys
    assert torch.equal(q[0, :, 0], k_b.expand(112, 16))  # read at B's key after every step
    assert torch.equal(v[0, 52:, 0], torch.eye(6, dtype=torch.float64)[0].expand(60, 6))  # A's one-hot value


def test_json_shape_exact_and_reproducible(results, tmp_path):
    assert set(results) == {"config", "models", "fixed_prior", "overlap", "closed_form"}
    assert results["config"] == {
        "D": 16,
        "m": 6,
        "rho": 0.92,
        "p0": 3.0,
        "r2": 0.05,
        "ell2": 0.05,
        "steps": 112,
    }
    assert set(results["models"]) == {"bayesian", "reset", "linear_attention", "diagonal"}
    for entry in results["models"].values():
        assert set(entry) == {"p_ab", "margin", "gain"}
        assert all(len(entry[f]) == 112 and all(isinstance(x, float) for x in entry[f]) for f in entry)
    assert list(results["fixed_prior"]) == ["0.01", "0.05", "0.10", "0.50", "1.00", "3.00"]
    for entry in results["fixed_prior"].values():
        assert set(entry) == {"gain", "final_p_ab", "final_margin"}
    overlap = results["overlap"]
    assert set(overlap) == {"rho", "bayesian", "reset", "linear_attention", "diagonal"}
    assert overlap["rho"] == [i / 100 for i in range(100)] and 0.92 in overlap["rho"]
    assert all(len(overlap[n]) == 100 for n in col.MODELS)
    assert set(results["closed_form"]) == {
        "g_inf",
        "g_inf_simulated",
        "delta_B_limit",
        "delta_B_simulated",
        "angle_limit",
        "angle_simulated",
        "reset_plateau",
        "reset_plateau_simulated",
    }
    again = col.run_collision()
    assert again == results  # bit-for-bit: deterministic, no randomness anywhere
    path = write_record(tmp_path / "collision.json", results, allow_nan=False)
    saved = load_json(path)
    assert saved.pop("provenance")["backfilled"] is False
    assert saved == results  # JSON round trip loses nothing


def test_metric_definitions(results):
    for entry in results["models"].values():
        for p, d in zip(entry["p_ab"], entry["margin"], strict=True):
            assert 0.0 < p < 1.0 and d == pytest.approx(2 * p - 1, abs=1e-15)
    # overlap sweep at ρ = 0.92 is the main run's final value
    i = results["overlap"]["rho"].index(0.92)
    for n in col.MODELS:
        assert results["overlap"][n][i] == pytest.approx(results["models"][n]["p_ab"][-1], abs=1e-14)


def test_gain_floor_matches_simulation(results):
    cf = results["closed_form"]
    # r² = ℓ²: the fixed point of x ↦ r²x/(r²+x) + ℓ² gives g_∞ = 1/φ = (√5 − 1)/2
    assert cf["g_inf"] == pytest.approx((math.sqrt(5) - 1) / 2, abs=1e-14)
    assert abs(cf["g_inf_simulated"] - cf["g_inf"]) < 1e-6
    assert abs(results["models"]["bayesian"]["gain"][51] - cf["g_inf"]) < 1e-6  # end of B's 40 writes too


def test_gain_floor_other_noise_levels():
    r2, ell2 = 0.1, 0.02
    out = col.run_collision(r2=r2, ell2=ell2, fixed_priors=[1.0], overlap_rhos=[0.5])
    x = 3.0
    for _ in range(10_000):  # iterate the scalar recursion of docs/theory.md §4.3 to its fixed point
        x = r2 * x / (r2 + x) + ell2
    g = x / (r2 + x)
    assert out["closed_form"]["g_inf"] == pytest.approx(g, abs=1e-12)
    assert abs(out["closed_form"]["g_inf_simulated"] - g) < 1e-6
    assert out["closed_form"]["delta_B_simulated"] == pytest.approx((1 - 0.92**2) * ell2, abs=1e-9)


def test_reset_gain_is_lambda_over_r2_plus_lambda(results):
    lam, r2 = 0.05, 0.05
    expected = lam / (r2 + lam)
    schedule = col.write_schedule()
    # linear attention's ω = 0.5 gives the same gain ω‖k‖² for unit keys
    for name in ("reset", "linear_attention"):
        for g, who in zip(results["models"][name]["gain"], schedule, strict=True):
            if who == col.B:  # ‖k_B‖² = ρ² + (1 − ρ²) is 1 only up to rounding
                assert g == pytest.approx(expected, abs=1e-15)
            else:
                assert g == expected
    for c, entry in results["fixed_prior"].items():
        assert entry["gain"] == pytest.approx(float(c) / (r2 + float(c)), abs=1e-15)
    # the fixed prior with c = λ is the reset filter itself
    assert results["fixed_prior"]["0.05"]["final_p_ab"] == results["models"]["reset"]["p_ab"][-1]


def test_reset_reaches_one_hot_margin_after_reinforcement(results):
    # after 40 writes of B with gain 1/2 the readout at k_B is v_B up to 2^-40: margin exactly 1
    assert results["models"]["reset"]["p_ab"][51] == pytest.approx(SIGMOID_1, abs=1e-10)
    assert results["models"]["reset"]["margin"][51] == pytest.approx(math.tanh(0.5), abs=1e-10)


def test_reset_trajectory_follows_delta_rule_closed_form(results, paper_inputs):
    q, k, v = paper_inputs
    M = DELTANET.recurrent(q[:, :52], k[:, :52], v[:, :52], r2=0.05, lam=0.05, output_final_state=True).state[
        0
    ][0, 0]
    k_a, k_b, v_a = k[0, 52, 0], q[0, 0, 0], v[0, 52, 0]
    a, b = M.T @ k_a, M.T @ k_b
    # the recursion of docs/theory.md §4.5 written out step by step (not the closed form under test)
    for n, p_sim in enumerate(results["models"]["reset"]["p_ab"][52:], start=1):
        b = b + 0.5 * (k_a @ k_b) * (v_a - a)
        a = a + 0.5 * (v_a - a)
        assert torch.sigmoid(b[1] - b[0]).item() == pytest.approx(p_sim, abs=1e-12)
        b_closed = col.delta_rule_readout(M.T @ k_a, M.T @ k_b, v_a, 0.92, 0.5, n)
        assert torch.allclose(b_closed, b, atol=1e-12)
    cf = results["closed_form"]
    assert cf["reset_plateau"] == pytest.approx(cf["reset_plateau_simulated"], abs=1e-12)


def test_delta_b_formula_and_limit(results, paper_inputs):
    q, k, v = paper_inputs
    noise = {"r2": 0.05, "ell2": 0.05, "p0": 3.0}
    full = BAYESIAN.recurrent(q, k, v, **noise)
    var_b = full.variance[0, :, 0, 0]  # 1 + k_Bᵀ P_t k_B
    for t in (52, 60, 111):  # per-step formula at the first, an early and the last write of A
        P = BAYESIAN.recurrent(q[:, :t], k[:, :t], v[:, :t], output_final_state=True, **noise).state[1][0, 0]
        P_bar = P + 0.05 * torch.eye(16, dtype=torch.float64)
        k_a, k_b = k[0, t, 0], q[0, 0, 0]
        predicted = 0.05 - (k_b @ P_bar @ k_a) ** 2 / (0.05 + k_a @ P_bar @ k_a)
        assert (var_b[t] - var_b[t - 1]).item() == pytest.approx(predicted.item(), abs=1e-12)
    cf = results["closed_form"]
    assert cf["delta_B_limit"] == pytest.approx((1 - 0.92**2) * 0.05, abs=1e-15)
    assert cf["delta_B_simulated"] == pytest.approx(cf["delta_B_limit"], abs=1e-9)


def test_write_angle_measurement_and_its_limit(results, paper_inputs):
    q, k, v = paper_inputs
    P = BAYESIAN.recurrent(
        q[:, :52], k[:, :52], v[:, :52], r2=0.05, ell2=0.05, p0=3.0, output_final_state=True
    ).state[1][0, 0]
    k_a = k[0, 52, 0]
    u = (P + 0.05 * torch.eye(16, dtype=torch.float64)) @ k_a  # the write key P̄ k_A of step 53
    angle = math.degrees(math.acos((u @ k_a).item() / u.norm().item()))
    cf = results["closed_form"]
    assert cf["angle_simulated"] == pytest.approx(angle, abs=1e-6)
    assert cf["angle_limit"] == pytest.approx(math.degrees(math.asin(0.92)), abs=1e-12)
    # 40 writes of B do not reach the limit; it is approached from below as B's reinforcement grows
    assert 55.0 < cf["angle_simulated"] < cf["angle_limit"] - 1.0
    long = col.write_angle(0.92, 4000)
    assert cf["angle_simulated"] < long < cf["angle_limit"] and cf["angle_limit"] - long < 0.2


def test_models_recover_paper_ordering(results):
    final = {n: results["models"][n]["p_ab"][-1] for n in col.MODELS}
    assert final["bayesian"] > 0.7 and final["reset"] < 0.5 and final["linear_attention"] < 0.01
    ov = results["overlap"]
    assert all(
        b >= r - 1e-12 for b, r in zip(ov["bayesian"], ov["reset"], strict=True)
    )  # BL never below Delta
    assert all(b >= d - 1e-12 for b, d in zip(ov["bayesian"], ov["diagonal"], strict=True))


def test_oracle_matches_chunked_path():
    diffs = col.chunk_agreement(overlap_rhos=[0.0, 0.5, 0.92, 0.99])
    assert set(diffs) == set(col.MODELS)
    assert max(diffs.values()) < 1e-10


def test_rotated_keys_change_only_the_diagonal_ablation(results):
    rot = col.rotated_keys(0.92, seeds=[0, 1])
    for n in ("bayesian", "reset", "linear_attention"):
        assert rot[n] == pytest.approx([results["models"][n]["p_ab"][-1]] * 2, abs=1e-12)
    assert all(d < results["models"]["diagonal"]["p_ab"][-1] - 0.1 for d in rot["diagonal"])


@pytest.mark.slow  # reruns the whole experiment through the command line (the `results` fixture runs it in-process)
def test_cli_writes_json_and_figures_then_redraws_from_json(results, tmp_path, capsys):
    out = tmp_path / "collision"
    assert main(["collision", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "collision.json" in printed and "How to read the table" in printed
    saved = json.loads((out / "collision.json").read_text())
    assert saved.pop("provenance")["backfilled"] is False
    assert saved == results
    assert set(json.loads((out / "collision_extra.json").read_text())) == {
        "angle_vs_reinforcement",
        "rotated_keys",
        "provenance",
    }
    for name in col.FIGURES:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # redraw from an edited JSON: the figures follow the file, not a rerun
    before = (out / col.FIGURES[0]).read_bytes()
    for name in col.FIGURES:
        (out / name).unlink()
    saved["models"]["bayesian"]["p_ab"] = [0.5] * 112
    (out / "collision.json").write_text(json.dumps(saved))
    assert main(["collision", "--plot-only", "--out", str(out)]) == 0
    assert "Redrew 4 figures" in capsys.readouterr().out
    for name in col.FIGURES:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert (out / col.FIGURES[0]).read_bytes() != before


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rho": 1.0}, ValueError, "rho"),
        ({"rho": -0.1}, ValueError, "rho"),
        ({"rho": float("nan")}, ValueError, "rho"),
        ({"rho": "0.9"}, TypeError, "rho"),
        ({"D": 5}, ValueError, "D must be >= 6"),
        ({"m": 6.0}, TypeError, "m must be an int"),
        ({"p0": 0.0}, ValueError, "p0"),
        ({"r2": -0.05}, ValueError, "r2"),
        ({"ell2": float("inf")}, ValueError, "ell2"),
        ({"ell2": True}, TypeError, "ell2"),
        ({"fixed_priors": []}, ValueError, "fixed_priors"),
        ({"fixed_priors": [0.1, 0.1]}, ValueError, "distinct"),
        ({"fixed_priors": [0.1, -1.0]}, ValueError, "fixed_priors"),
        ({"overlap_rhos": [0.5, 1.2]}, ValueError, "overlap_rhos"),
        ({"overlap_rhos": "0.5"}, ValueError, "overlap_rhos"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        col.run_collision(**kwargs)


def test_bad_helper_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="b_repeats"):
        col.write_schedule(0, 60)
    with pytest.raises(ValueError, match="path"):
        col.simulate(BAYESIAN, {"r2": 0.05, "ell2": 0.05}, col.collision_inputs([0.5]), path="fast")
    assert main(["collision", "--plot-only", "--out", str(tmp_path / "nowhere")]) == 2
    assert "collision.json, which does not exist" in capsys.readouterr().err
    assert main(["collision", "--rho", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "rho must be a key overlap in [0, 1), got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    (tmp_path / "collision.json").write_text("{not json")
    with pytest.raises(ValueError, match="damaged or not JSON"):
        load_json(tmp_path / "collision.json")
    with pytest.raises(ValueError, match="lack 'closed_form'"):
        col.check_results({"config": {}, "models": {}, "fixed_prior": {}, "overlap": {}})
    with pytest.raises(ValueError, match="112 steps"):
        col.check_results(
            {
                "config": {"steps": 112},
                "models": {"bayesian": {"p_ab": [0.5]}},
                "fixed_prior": {},
                "overlap": {},
                "closed_form": {},
            }
        )
    assert main(["collision", "--out", str(tmp_path), "--plot-only", str(tmp_path)]) == 2  # a flag, no value
    assert "unrecognized arguments" in capsys.readouterr().err


def test_plotting_helpers(tmp_path):
    path = line_plot(
        tmp_path / "f.png",
        [Series("a", [1, 2, 3], [0.1, 0.2, 0.3], err=[0.01, 0.02, 0.03])],
        xlabel="x",
        ylabel="y",
        vlines=[RefLine(2, "phase")],
        hlines=[RefLine(0.5, "tie")],
        xscale="log",
    )
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="3 points but y has 2"):
        Series("a", [1, 2, 3], [0.1, 0.2])
    with pytest.raises(ValueError, match="non-finite"):
        Series("a", [1, 2], [0.1, float("nan")])
    with pytest.raises(ValueError, match="err has 1"):
        Series("a", [1, 2], [0.1, 0.2], err=[0.1])
    with pytest.raises(ValueError, match="at least one"):
        line_plot(tmp_path / "g.png", [], xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="xscale"):
        line_plot(tmp_path / "g.png", [Series("a", [1], [1])], xlabel="x", ylabel="y", xscale="symlog")
    with pytest.raises(ValueError, match="NaN|Out of range"):
        write_record(tmp_path / "bad.json", {"x": float("nan")}, allow_nan=False)
