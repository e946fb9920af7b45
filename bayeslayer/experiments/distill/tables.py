"""The docs' table of ``bayeslayer distill train``'s record (``distill.json``): what each stage trained and
what it reached.  ``tools/build_tables.py`` finds the committed record and splices the table into the docs."""

from __future__ import annotations

from ...training.distillation import STAGES
from ..common.tables import check_record, markdown_row, separator

STAGE_LABELS = {"phase_a": "Phase A", "phase_b": "Phase B", "gdn_ft": "GDN-FT"}


def table(record: dict) -> str:
    """Per stage of ``distill.json``: steps × tokens per step, trainable tensors / elements (and the MLP's
    share), training time, the final train loss (last 10% of steps) and the validation PPL at length 512."""
    stages = check_record(record)["stages"]
    lines = [markdown_row(["stage", "steps × tokens", "trainable (tensors / elements; MLP)", "time",
                           "final train loss (last 10% of steps)", "validation PPL (L = 512)"]), separator(6)]
    for key in STAGES:
        st = stages[key]
        elements = st["trainable_elements"]
        lines.append(markdown_row([
            STAGE_LABELS[key], f"{st['steps']} × {st['tokens'] // st['steps']:,} = {st['tokens']:,}",
            f"{st['trainable_parameters']} / {sum(elements.values()):,}; {elements.get('mlp', 0):,}",
            f"{st['train_seconds']:.0f} s", f"{st['final_train_loss']:.4f}", f"{st['validation']['all']['ppl']:.2f}"]))
    return "\n".join(lines)


__all__ = ["STAGE_LABELS", "table"]
