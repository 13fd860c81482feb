"""``python -m shardwise.cli``: the ``shardwise`` command without its console script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
