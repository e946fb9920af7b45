"""Where value checks run (``ops/utils/validation.py``): eager CPU calls by default, never inside
``torch.func`` transforms or on meta tensors, every eager call with ``True``, none with ``False``."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.errors import NonFiniteError
from bayeslayer.ops import bl_chunk, set_value_checks, value_checks
from bayeslayer.ops.utils.validation import can_read_values, check_tensor, values_checked


def test_modes_and_their_default():
    with value_checks("auto"):
        x = torch.ones(3)
        assert values_checked(x) and can_read_values()
        assert not values_checked(torch.ones(3, device="meta"))  # shapes only
        assert not values_checked(torch.ones(0))  # nothing to check
        assert not values_checked(None)
    with value_checks(False):
        assert not values_checked(torch.ones(3))
    with value_checks(True):
        assert values_checked(torch.ones(3))
    with pytest.raises(ValueError, match="set_value_checks takes True, False or 'auto'"):
        set_value_checks("sometimes")
    with pytest.raises(ValueError, match="set_value_checks takes"):
        set_value_checks(1)


def test_the_package_default_is_auto():
    """The test suite runs with True (conftest); a fresh process starts at "auto"."""
    import importlib

    from bayeslayer.ops.utils import validation

    previous = set_value_checks(True)
    try:
        fresh = importlib.reload(validation)
        assert fresh._VALUE_CHECKS == "auto"
    finally:
        importlib.reload(validation)
        set_value_checks(previous)


def test_no_value_check_inside_vmap():
    """A batched tensor has no single value: inside ``torch.func.vmap`` the checks step aside (a NaN flows through)
    where eager mode names it."""
    x = torch.ones(2, 4)
    x[1, 2] = float("nan")
    with value_checks(True):
        with pytest.raises(NonFiniteError, match="x contains NaN"):
            check_tensor("x", x)
        seen = torch.func.vmap(lambda row: torch.tensor(float(can_read_values())) + 0 * check_tensor("x", row))(x)
    assert bool((seen[0] == 0).all())  # can_read_values() was False inside, and the NaN was not refused


def test_chunk_path_runs_under_vmap_with_checks_on():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 1, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    r2, ell2 = 0.5 + torch.rand(3, 1, 9, 2, generator=g, dtype=torch.float64), torch.full((3, 1, 9, 2), 0.01,
                                                                                             dtype=torch.float64)
    with value_checks(True):
        out = torch.func.vmap(lambda *a: bl_chunk(*a, chunk_size=4)[0])(q, k, v, r2, ell2)
    ref = torch.cat([bl_chunk(q[b], k[b], v[b], r2[b], ell2[b], chunk_size=4)[0] for b in range(3)])
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-12, atol=1e-12)
