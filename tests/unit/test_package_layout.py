"""The package's shape: no import circle between two files, no file over 400 lines, the runtime in its rooms.

Every import counts, the lazy ones inside functions and the ``TYPE_CHECKING`` ones too: a lazy import is still a
dependency a reader has to follow, and "it builds on this module" comments were how circles hid before.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "ethpipe"
MAX_LINES = 400


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from pkg import submodule`` names the submodule)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif base in modules:
                        graph[name].add(base)
        graph[name].discard(name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_between_files() -> None:
    circles = import_circles(import_graph())
    assert not circles, f"import circles between files: {circles}"


def test_the_circle_finder_finds_a_circle_a_lazy_import_makes(tmp_path: Path) -> None:
    """The check above can fail: a lazy import inside a function closes a circle it reports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert import_circles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert import_circles(import_graph(pkg)) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_over_400_lines(path: Path) -> None:
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_LINES, f"{path.name}: {num_lines} lines; split it by what its parts do"


def test_the_runtime_is_in_rooms_that_name_its_parts() -> None:
    """No flat runtime folder again: its top level keeps the trainer and what every room shares."""
    runtime = PACKAGE / "runtime"
    top = sorted(p.name for p in runtime.glob("*.py"))
    assert top == ["__init__.py", "config.py", "data.py", "groups.py", "step.py", "train.py"]
    rooms = sorted(p.name for p in runtime.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert rooms == ["adapt", "checkpoint", "model", "observe", "pipeline", "start", "sync"]
    for room in rooms:
        assert ast.get_docstring(ast.parse((runtime / room / "__init__.py").read_text())), f"{room}/ says what it holds"


def test_the_runtime_never_imports_the_planner_and_the_planner_never_torch_distributed() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("ethpipe.runtime"):
            assert not any(t.startswith("ethpipe.planner") for t in targets), module
    for path in (PACKAGE / "planner").rglob("*.py"):
        assert "torch.distributed" not in path.read_text(), path


def test_the_torch_pin_keeps_a_containers_pre_release_numbered_build() -> None:
    """NGC ships torch as 2.13.0a0+<sha>.nv..; a pin that rejects it makes `pip install -e .` replace the
    container's CUDA torch (README: "in a container that already has one ... keeps it")."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    torch_pin = next(Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch"))
    assert torch_pin.specifier.contains("2.13.0a0+ecf3bae40a.nv25.09")
    assert torch_pin.specifier.contains("2.13.0") and torch_pin.specifier.contains("2.13.1")
    assert not torch_pin.specifier.contains("2.14.0a0") and not torch_pin.specifier.contains("2.12.1")


def test_src_uses_no_private_torch_distributed_api() -> None:
    """The code style's rule: public torch APIs only in src/ (tests may use torch's testing helpers)."""
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "distributed_c10d._" in p.read_text() or "pipelining._" in p.read_text()]
    assert not offenders, offenders
