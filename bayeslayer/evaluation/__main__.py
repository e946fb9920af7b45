"""``python -m bayeslayer.evaluation ...``: lm-eval's command line with bayeslayer's models registered.

lm-eval's start-up (its import, then the index of its few thousand task files) takes up to a minute
on a small machine before it prints anything; the two lines below say what is happening meanwhile.
"""

import sys
import time

_start = time.perf_counter()
print("bayeslayer.evaluation: importing lm-eval ...", file=sys.stderr, flush=True)
from .lm_eval_adapter import main  # noqa: E402 - imported after the line above, since the import is the slow part

print(f"bayeslayer.evaluation: lm-eval imported in {time.perf_counter() - _start:.0f} s; indexing its tasks "
      "(up to a minute) ...", file=sys.stderr, flush=True)
main()
