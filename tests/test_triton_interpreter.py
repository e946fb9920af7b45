"""The test harness's shortcut in Triton's interpreter (tests/triton_interpreter.py) changes the time, not the
results: the segment-scan forward (its prep, covariance, Phase A and B, and mean kernels, and their helpers
such as ``tl.sum``) gives bit-identical outputs with the interpreter as shipped, while the language is
patched far fewer times."""

from __future__ import annotations

import os

import pytest
import torch

from .ops.scan_inputs import regime_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="the shortcut is installed only under TRITON_INTERPRET=1")


def _run():
    from bayeslayer.ops.bayesian_layer import mean_pass_fla
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, 32, 1, 8, 4, seed=5)
    with mean_pass_fla.one_autotune_config():
        o, var, (M, P) = bl_chunk_triton(q, k, v, r2, ell2, alpha, output_final_state=True, return_variance=True,
                                         chunk_size=16, n_segments=2)
    return [o, var, M, P]


def test_the_shortcut_gives_bit_identical_results_with_fewer_patches(monkeypatch):
    from triton.runtime import interpreter

    from .triton_interpreter import skip_repeated_patching

    # whatever this process runs with (the stock interpreter under BL_TEST_STOCK_TRITON_INTERPRETER=1) comes back
    # after the test: monkeypatch restores the value it first saw
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang)
    assert skip_repeated_patching({}), "the shortcut is not installed: Triton's interpreter internals changed"
    fast = interpreter._patch_lang
    patches = {"n": 0}
    stock_patch_builtin = interpreter._patch_builtin

    def count(*args):
        patches["n"] += 1
        return stock_patch_builtin(*args)

    monkeypatch.setattr(interpreter, "_patch_builtin", count)
    monkeypatch.setattr(interpreter, "_patch_lang", fast.stock)
    stock = _run()
    stock_patches, patches["n"] = patches["n"], 0
    monkeypatch.setattr(interpreter, "_patch_lang", fast)
    shortcut = _run()
    assert len(stock) == len(shortcut) == 4
    for a, b in zip(stock, shortcut, strict=True):
        assert torch.equal(a, b)
    assert patches["n"] * 10 < stock_patches, (patches["n"], stock_patches)


def test_stock_interpreter_on_request():
    from .triton_interpreter import skip_repeated_patching

    assert skip_repeated_patching({"BL_TEST_STOCK_TRITON_INTERPRETER": "1"}) is False
