"""Pieces of the subcommands' ``--help`` texts that several commands share."""

from __future__ import annotations

from collections.abc import Mapping


def preset_values(presets: Mapping[str, object], field: str, *, fmt: str = "") -> str:
    """``"cpu 200, paper 7935, tiny 20"``: the value of ``field`` in each preset, for an option that
    overrides it (so ``--help`` shows what leaving the option out means)."""
    if not presets:
        raise ValueError("presets must name at least one preset")
    return ", ".join(f"{name} {format(getattr(preset, field), fmt)}" for name, preset in sorted(presets.items()))


def override_help(presets: Mapping[str, object], field: str, what: str | None = None, *, fmt: str = "") -> str:
    """The help of an option that overrides one preset field: ``"<what> (default: the preset's: cpu 200, ...)"``."""
    what = what or field.replace("_", " ")
    return f"{what} (default: the preset's: {preset_values(presets, field, fmt=fmt)})"


__all__ = ["override_help", "preset_values"]
