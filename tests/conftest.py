"""Makes tests/amsp_testlib.py importable however pytest is run (with or without __init__.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
