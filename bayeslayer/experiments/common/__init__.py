"""What the experiments share: option checks, the seeds harness, plots, provenance, threads, the recall core.

The rule of :mod:`bayeslayer.experiments`: each module directly in it is one experiment (one CLI
command, ``run(config) -> record``) and a leaf — it imports this package and the rest of
``bayeslayer`` (``data``, ``design``, ``layers``, ``models``, ``training``, ``evaluation``), never
another experiment.  What two experiments need in common lives here (or lower, in ``data``,
``models``, ``training``, ``evaluation``), and nothing here imports an experiment.
``tests/experiments/test_leaves.py`` holds both halves of the rule.
"""
