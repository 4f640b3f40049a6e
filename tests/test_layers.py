"""The package's import contract (docs/architecture.md, "Layers"): every import goes down the layers.

    netagg/ (wire, configs, framing, faults)  <-  hoststack, softswitch, controller  <-  mlfabric, bmv2
        <-  apps  <-  testing (helpers for tests and benchmarks)

A module imports only from layers below its own (siblings of one layer do not import each other), read from
the source of every module, imports inside functions included. One edge is allowed by name:
``netagg/torch_backend.py`` is the public name users import (``import netagg.torch_backend``) for the
backend that ``apps`` implements. Product code never starts a benchmark.
"""

from __future__ import annotations

import ast
from pathlib import Path

from netagg import dataplane as dp

LAYERS = {"netagg": 0, "hoststack": 1, "softswitch": 1, "controller": 1, "mlfabric": 2, "bmv2": 2, "apps": 3,
          "testing": 4}
ALLOWED = {("netagg/torch_backend.py", "apps")}


def _folder_of(module: str) -> str | None:
    """The folder of an absolute ``netagg...`` module name (None: not netagg's)."""
    parts = module.split(".")
    if parts[0] != "netagg":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "netagg"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _edges() -> dict[tuple[str, str], set[str]]:
    edges: dict[tuple[str, str], set[str]] = {}
    for folder in LAYERS:
        for path in sorted((dp.REPO_ROOT / folder).glob("*.py")):
            where = f"{folder}/{path.name}"
            for module in _imports(path):
                target = _folder_of(module)
                if target is not None and target != folder:
                    edges.setdefault((where, target), set()).add(module)
    return edges


def test_every_import_goes_down_the_layers() -> None:
    edges = _edges()
    assert edges, "no imports found: the scan is broken"
    wrong = sorted(f"{where} imports {', '.join(sorted(modules))} ({target}, layer {LAYERS[target]})"
                   for (where, target), modules in edges.items()
                   if LAYERS[target] >= LAYERS[where.split("/")[0]] and (where, target) not in ALLOWED)
    assert not wrong, "\n".join(wrong)


def test_no_folder_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for (where, target) in _edges():
        if (where, target) not in ALLOWED:
            graph.setdefault(where.split("/")[0], set()).add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph.get(start, ()))

    assert not [folder for folder in graph if reaches(folder, folder, set())]


def _names_a_benchmark(path: Path) -> bool:
    """Whether a string in ``path`` is a benchmark's module name (``python -m benchmarks.x``)."""
    return any(isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("benchmarks.")
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_product_code_never_starts_a_benchmark_or_imports_the_test_helpers() -> None:
    offenders = []
    for folder in [f for f in LAYERS if f != "testing"]:
        for path in sorted((dp.REPO_ROOT / folder).glob("*.py")):
            if _names_a_benchmark(path):
                offenders.append(f"{folder}/{path.name}: starts a benchmark")
            if any(m.startswith(("netagg.testing", "benchmarks")) for m in _imports(path)):
                offenders.append(f"{folder}/{path.name}: imports test helpers or a benchmark")
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from netagg.apps.demo import run_demo\n    import netagg.hoststack.kv\n")
    assert {"netagg.apps.demo", "netagg.apps.demo.run_demo", "netagg.hoststack.kv"} <= _imports(bad)
    assert _folder_of("netagg.apps.demo") == "apps" and _folder_of("netagg.wire") == "netagg"
    starter = tmp_path / "s.py"
    starter.write_text('CMD = ["python", "-m", "benchmarks.mlfabric_worker"]\n')
    assert _names_a_benchmark(starter) and not _names_a_benchmark(bad)
