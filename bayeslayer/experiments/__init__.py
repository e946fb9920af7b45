"""One module per experiment of the paper (docs/theory.md §8); each registers a CLI subcommand.

Every module directly in this package is an experiment and a leaf: it imports
:mod:`bayeslayer.experiments.common` (what several experiments share) and the rest of the package,
never another experiment.
"""
