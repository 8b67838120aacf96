"""The test environment is whole: a package the suite uses and that is installed imports.

Tests that need transformers, DeepSpeed or torchtitan skip where the package is absent (the
plain `pip install -e .` of a user); where it is installed but cannot be imported (a
dependency resolved apart from it, as torchtitan's datasets once pinned huggingface-hub
under what transformers needed), those tests would skip silently. Here that fails, naming the
package and the reason."""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest


@pytest.mark.parametrize("dist,module", [("transformers", "transformers"),
                                         ("deepspeed", "deepspeed"),
                                         ("torchtitan", "torchtitan")])
def test_installed_packages_import(dist, module):
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        pytest.fail(f"{dist} is installed but does not import: {type(e).__name__}: {e}")
