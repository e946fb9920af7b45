"""``python -m bayeslayer.evaluation ...``: lm-eval's command line with bayeslayer's models registered."""

from .harness import main

main()
