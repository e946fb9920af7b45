"""The experiments' one integer check (bayeslayer.experiments.common.options.check_int)."""

from __future__ import annotations

import numpy as np
import pytest

from bayeslayer.experiments.common.options import check_int


@pytest.mark.parametrize("value", [0, 1, 7, np.int64(5), np.int32(0)])
def test_integers_at_or_above_the_minimum_pass_as_int(value):
    out = check_int("steps", value, minimum=0)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [True, False, 3.0, np.float64(2.0), "3", None, [1]])
def test_non_integers_are_a_type_error_naming_the_argument(value):
    with pytest.raises(TypeError, match=r"^steps must be an integer, got "):
        check_int("steps", value, minimum=0)


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), (-1, 0), (1, 2), (np.int64(3), 4)])
def test_below_the_minimum_is_a_value_error_naming_both(value, minimum):
    with pytest.raises(ValueError, match=rf"^length must be an integer >= {minimum}, got {int(value)}$"):
        check_int("length", value, minimum=minimum)
