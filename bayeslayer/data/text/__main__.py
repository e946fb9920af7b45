"""``python -m bayeslayer.data.text``: tokenize and cache a corpus (see :func:`bayeslayer.data.text.corpus.main`)."""

import sys

from .corpus import main
from .sources import CorpusNotFoundError

try:
    main()
except CorpusNotFoundError as err:  # the default corpus is not installed: one line that says how
    sys.exit(f"python -m bayeslayer.data.text: error: {err}")
