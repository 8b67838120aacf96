"""The package's shape: no import circle, no module too long to hold, no torch on the planner path.

The import graph is read with the standard library's ``ast`` from the source of every module of
``amsp_planner/``: every ``import``/``from ... import`` anywhere in a module, the ones deferred
inside functions included (a deferred import still closes a circle, it only hides it until run
time). ``from pkg import name`` counts as an edge to ``pkg.name`` when that is a module of the
package, else to ``pkg``; an import of a package module counts as one of its ``__init__``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
from amsp_testlib import NO_TORCH

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "amsp_planner"

MAX_LINES = 420
"""About 400 lines: what a newcomer can read in one sitting."""
LONG_EXEMPT = {"solver/ilp.py", "solver/exhaustive.py"}
"""The solver is being split into its parts (tables, formulation, HiGHS session, rounds);
this exemption goes once that split lands."""


def _modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import `level` dots up from `module`."""
    if not level:
        return name or ""
    base = module.split(".")
    base = base[: len(base) - level + (1 if is_pkg else 0)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> nx.DiGraph:
    """Module -> module edges within the package, every import in a module's source counted."""
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    g.add_edge(mod, t)
    return g


def test_the_graph_sees_deferred_imports():
    # preflight imports the checkpoint reader inside a function: the graph must hold that edge.
    g = import_graph()
    assert g.has_edge("amsp_planner.runtime.preflight", "amsp_planner.runtime.checkpoint")
    # and `from package import module` is an edge to the module, not only to the package
    assert g.has_edge("amsp_planner.runtime.tp", "amsp_planner.runtime.model")


def test_no_import_circle():
    g = import_graph()
    circles = [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(g)]
    assert not circles, "import circle(s): " + "; ".join(sorted(circles, key=len)[:5])


def test_no_module_over_the_limit():
    long = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_EXEMPT:
            long.append(f"{rel} ({n} lines)")
    assert not long, f"over {MAX_LINES} lines, split by job: {', '.join(sorted(long))}"


def test_plan_imports_no_torch(tmp_path):
    # A finder that refuses torch: the CLI's import and a full plan must never reach it.
    out = tmp_path / "plan.json"
    script = NO_TORCH + textwrap.dedent(f"""
        import amsp_planner.cli.main
        assert "torch" not in sys.modules
        from amsp_planner.cli.main import main
        try:
            main(["plan", "--model", "llama-7b", "--gpus", "64", "-o", {str(out)!r}])
        except SystemExit as e:
            assert not e.code, e.code
        assert "torch" not in sys.modules
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert out.exists() and out.stat().st_size > 0
