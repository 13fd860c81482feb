"""``python -m shardwise``: the ``shardwise`` command (as ``python -m shardwise.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
