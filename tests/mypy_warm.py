"""mypy as pyproject's [tool.mypy] sets it, from an incremental cache that outlives the checkout.

A fresh checkout (CI's) has no .mypy_cache, and mypy then analyses every module shardwise imports,
transformers' and torch's among them (thousands of modules: 35 s of CPU, 40-110 s on a loaded
machine), for the result a warm cache gives in 1 s of CPU. A warm cache gives the same result: mypy
reuses a module's cached analysis only if the file's hash is the one it analysed and the interfaces
of everything it depends on are unchanged, and it ignores a cache written by another mypy version or
under other options.

The cache kept between runs is ``$SHARDWISE_MYPY_CACHE`` (default ``~/.cache/shardwise/mypy``, or
under ``$XDG_CACHE_HOME``; ``off``: none, every run cold). mypy runs on a private copy of it, which
replaces it once mypy is done: runs at once (several checkouts' suites) never write one cache's files
together, and the last to finish leaves its cache. Arguments are passed on to mypy.

    python tests/mypy_warm.py [mypy arguments]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mypy.api

ENV_VAR = "SHARDWISE_MYPY_CACHE"


def kept_cache() -> Path | None:
    """Where the cache is kept between runs (None: nowhere)."""
    where = os.environ.get(ENV_VAR)
    if where == "off":
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise" / "mypy"


def _copy_in(kept: Path, private: Path) -> None:
    try:
        shutil.copytree(kept, private)
    except (OSError, shutil.Error) as exc:  # replaced by another run while copied: this one starts cold
        shutil.rmtree(private, ignore_errors=True)
        print(f"mypy_warm: {kept} could not be copied ({exc}); mypy starts without a cache", file=sys.stderr)


def _keep(private: Path, kept: Path) -> None:
    """``private`` in ``kept``'s place: renames within ``kept``'s folder, each of which either happens or not."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    staged = kept.with_name(f"{kept.name}.{os.getpid()}.new")
    old = kept.with_name(f"{kept.name}.{os.getpid()}.old")
    shutil.move(private, staged)
    with contextlib.suppress(FileNotFoundError):  # none kept yet
        kept.rename(old)
    try:
        staged.rename(kept)
    except OSError:  # another run put its cache there in between: keep that one
        shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def main(args: list[str]) -> int:
    kept = kept_cache()
    with tempfile.TemporaryDirectory(prefix="shardwise-mypy-") as tmp:
        private = Path(tmp) / "cache"
        if kept is not None and kept.is_dir():
            _copy_in(kept, private)
        # In this process (not a child): a test run that stops early kills this process, and mypy with it.
        out, err, status = mypy.api.run(["--cache-dir", str(private), *args])
        sys.stdout.write(out)
        sys.stderr.write(err)
        if kept is not None and private.is_dir():
            try:
                _keep(private, kept)
            except OSError as exc:  # the result stands; only the next run is slower
                print(f"mypy_warm: the cache could not be kept in {kept} ({exc})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
