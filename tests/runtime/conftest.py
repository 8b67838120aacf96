"""Skip the runtime tests cleanly when torch (the `runtime` extra) is not installed."""

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py", "_*.py", "mp.py"]
