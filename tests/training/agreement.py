"""The check every multi-rank training test makes first: rank 0's run against the one-process run of the same
steps (losses and every weight within tolerances, and the steps moved the weights, so agreement means something)."""

from __future__ import annotations


def check_against_one_process(main: dict, tol_losses: float, tol_weights: float) -> None:
    print("losses", main["losses"], "relative error", main["losses_rel"],  # shown with pytest -s
          "weights", max(main["weights_rel"].values()), "moved", main["moved"])
    assert main["losses_rel"] <= tol_losses, main
    bad = {k: v for k, v in main["weights_rel"].items() if not v <= tol_weights}
    assert not bad, f"weights off by more than {tol_weights} relative: {bad}"
    assert main["moved"] > 1e-3, main["moved"]  # the steps moved every weight (so agreement means something)
