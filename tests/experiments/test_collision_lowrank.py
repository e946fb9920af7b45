"""The low-rank rank sweep of the deterministic collision (collision_lowrank.json)."""

from __future__ import annotations

import pytest

from bayeslayer.experiments import collision as col

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep():
    return col.run_lowrank(ranks=(0, 1, 16), seeds=(0, 1))


def test_keys_and_state_floats(sweep):
    assert set(sweep["models"]) == {"bayesian", "diagonal", "reset"} | {
        col.lowrank_key(p, r) for p in ("conservative", "lofi") for r in (0, 1, 16)}
    D, m = 16, 6
    for r in (0, 1, 16):
        assert sweep["models"][col.lowrank_key("conservative", r)]["state_floats"] == D * m + D * (r + 1)
    assert sweep["models"]["bayesian"]["state_floats"] == D * m + D * D
    assert sweep["models"]["diagonal"]["state_floats"] == D * m + D
    for e in sweep["models"].values():
        assert len(e["p_ab"]) == len(e["gain"]) == 112 and len(e["rotated_final_p_ab"]) == 2
        assert all(0 <= g < 1 for g in e["gain"])
    assert sweep["chunk_agreement"] < 1e-10


def test_full_rank_is_the_dense_filter(sweep):
    dense = sweep["models"]["bayesian"]
    for p in ("conservative", "lofi"):
        full = sweep["models"][col.lowrank_key(p, 16)]
        assert full["p_ab"] == pytest.approx(dense["p_ab"], abs=1e-10)
        assert full["gain"] == pytest.approx(dense["gain"], abs=1e-10)
        assert full["rotated_final_p_ab"] == pytest.approx(dense["rotated_final_p_ab"], abs=1e-10)


def test_what_rotations_change(sweep):
    models = sweep["models"]
    # the conservative projection of an isotropic diagonal is rotation-equivariant; LoFi's diagonal is not
    for r in (0, 1):
        e = models[col.lowrank_key("conservative", r)]
        assert e["rotated_final_p_ab"] == pytest.approx([e["final_p_ab"]] * 2, abs=1e-10)
    lofi0 = models[col.lowrank_key("lofi", 0)]
    assert max(lofi0["rotated_final_p_ab"]) < lofi0["final_p_ab"] - 0.05
    # r = 0 conservative keeps no write: the gain of A's 60th write is near 1 (the prior has grown)
    assert models[col.lowrank_key("conservative", 0)]["gain"][-1] > 0.99


@pytest.fixture(scope="module")
def multi():
    return col.run_multi_pair(pairs=(1, 3), ranks=(0, 1, 16), seeds=(0, 1))


def test_multi_pair_inputs_and_limits(multi):
    (q, k, v), keys = col.multi_pair_inputs(3, 0.92)
    assert k.shape == (1, 2 * 6 + 40 * 3 + 60 * 3, 1, 16) and v.shape[-1] == 6
    assert float(keys[1] @ keys[0]) == pytest.approx(0.92) and float(keys[2] @ keys[1]) == 0.0
    models = multi["models"]
    for field in ("mean_p_ab", "rotated_mean_p_ab", "rotated_min_p_ab"):
        for p in ("conservative", "lofi"):
            assert models[col.lowrank_key(p, 16)][field] == pytest.approx(models["bayesian"][field], abs=1e-10)
        # conservative: rotation-equivariant
    e = models[col.lowrank_key("conservative", 1)]
    assert e["rotated_mean_p_ab"] == pytest.approx(e["mean_p_ab"], abs=1e-10)
    assert models["bayesian"]["state_floats"] == [16 * 2 + 256, 16 * 6 + 256]
    with pytest.raises(ValueError, match="2·pairs <= D"):
        col.multi_pair_inputs(9, 0.92)


def test_figures_and_table(sweep, multi, tmp_path):
    paths = col.plot_lowrank(sweep, tmp_path)
    assert [p.name for p in paths] == list(col.LOWRANK_FIGURES[:3])
    paths = col.plot_lowrank({**sweep, "multi_pair": multi}, tmp_path)
    assert [p.name for p in paths] == list(col.LOWRANK_FIGURES)
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC
    table = col.format_lowrank_table({**sweep, "multi_pair": multi})
    assert "conservative/1" in table and "chunked path" in table and "n=3" in table
    with pytest.raises(ValueError, match="collision_lowrank results lack 'ranks'"):
        col.plot_lowrank({"config": {}}, tmp_path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="ranks"):
        col.run_lowrank(ranks=[])
    with pytest.raises(ValueError, match="rank must be <= the key dim D = 16"):
        col.run_lowrank(ranks=[17], seeds=[0])
    with pytest.raises(ValueError, match="projection must be one of"):
        col.run_lowrank(ranks=[1], projections=["svd"], seeds=[0])
