"""No import circles in the package: no module imports, at any depth (imports inside functions
count), a module that imports it back. A circle works only as long as every import in it stays
where it is; one moved to the top of a file breaks the import of the whole package."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import diffserve

ROOT = Path(diffserve.__file__).parent


def module_name(path: Path, root: Path = ROOT.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file: ``import a.b`` and
    ``from a.b import c`` name ``a.b``, or ``a.b.c`` where that is a module."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_finder_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    package = tmp_path / "diffserve"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from diffserve import b\n")
    (package / "b.py").write_text("def f():\n    from diffserve.a import x\n")
    modules = {module_name(p, tmp_path): p for p in package.rglob("*.py")}
    assert circles(imports(modules)) == [["diffserve.a", "diffserve.b"]]


def test_the_package_has_no_import_circles():
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    assert len(modules) > 100
    assert circles(imports(modules)) == []


def upward_imports(package: str, layers, root: Path = ROOT, placed=lambda module: None) -> list[str]:
    """Imports, at any depth, from a module of ``package`` (``diffserve`` or one of its
    packages) to a module of a later layer of ``layers``; every module below ``package`` must be
    named by a layer (the package's own ``__init__`` is below them all). ``placed(module)`` names
    the layer of a module that sits in another layer than its package's, or None."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    modules = {module_name(p, root.parent): p for p in root.rglob("*.py")}
    prefix = f"{package}."

    def layer(module: str) -> int | None:
        if module == package:
            return -1
        if not module.startswith(prefix):
            return None
        return rank[placed(module) or module[len(prefix):].split(".")[0]]

    assert {m[len(prefix):].split(".")[0] for m in modules if m.startswith(prefix)} == set(rank)
    return [f"{module} -> {target}" for module, targets in imports(modules).items()
            if layer(module) is not None for target in targets
            if layer(target) is not None and layer(target) > layer(module)]


def family_builder_parts(module: str) -> str | None:
    """A family folder's parts that build models, its ``__init__`` and the folders' registry sit
    with the builders (``diffserve.executor.families.BUILDER_PARTS``)."""
    from diffserve.executor.families import BUILDER_PARTS, FOLDERS

    registry = "diffserve.executor.families"
    if module == registry:
        return "builders"
    rest = module[len(registry) + 1:].split(".") if module.startswith(registry + ".") else []
    if rest and rest[0] in FOLDERS and (len(rest) == 1 or rest[1] in BUILDER_PARTS):
        return "builders"
    return None


def test_imports_flow_down_the_packages_layers():
    """Every module of the package imports only its own layer's or earlier layers' modules
    (``diffserve.LAYERS``): no import runs back up, not even one hidden inside a function."""
    assert upward_imports("diffserve", diffserve.LAYERS, placed=family_builder_parts) == []


def test_a_family_folders_builders_sit_below_the_executor():
    assert family_builder_parts("diffserve.executor.families.flux.tiny") == "builders"
    assert family_builder_parts("diffserve.executor.families.flux") == "builders"
    assert family_builder_parts("diffserve.executor.families.flux.step") is None
    assert family_builder_parts("diffserve.executor.families.base") is None


def test_imports_flow_down_the_executors_layers():
    """A module of the executor imports only modules of its own layer or of the layers before it
    (``diffserve.executor.LAYERS``), at any depth."""
    from diffserve.executor import LAYERS

    assert upward_imports("diffserve.executor", LAYERS) == []


def test_the_layer_check_sees_an_import_back_up(tmp_path):
    package = tmp_path / "diffserve"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from diffserve.high import b\n")
    (package / "high.py").write_text("from diffserve.low import a\n")
    assert upward_imports("diffserve", (("low",), ("high",)), package) == [
        "diffserve.low.a -> diffserve.high"]


def test_the_packages_top_holds_at_most_fourteen_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 14, top


def test_the_executors_top_holds_at_most_eight_modules():
    top = [p.stem for p in (ROOT / "executor").glob("*.py") if p.stem != "__init__"]
    assert len(top) <= 8, top


def test_the_denoiser_component_names_are_defined_once():
    """No module but ``diffserve.executor.pipeline`` spells the denoisers' component names as a
    tuple (offloading, quantization, weight updates and parallelism ask it)."""
    import re

    spelled = re.compile(r"""\(\s*["'](unet|transformer)["']\s*,\s*["'](unet|transformer|transformer_2)["']""")
    found = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if spelled.search(p.read_text())]
    assert found == ["executor/pipeline.py"]


LIGHT = {
    # The frontend's and the scheduler's processes: they never touch a model.
    "frontend": "import diffserve.frontend.app",
    "scheduler": "import diffserve.scheduler.service",
    # The family tables they read (the embedded models, the random: architectures, the families
    # that take ControlNet): a family folder's tables import none of its step adapter.
    "family tables": ("from diffserve.executor import families; families.embedded_models(); "
                      "families.architectures(); families.controlnet_titles()"),
}


@pytest.mark.parametrize("what", LIGHT)
def test_the_frontend_the_scheduler_and_the_family_tables_import_no_torch(what):
    """In a fresh interpreter: neither torch nor diffusers is imported (each costs seconds of a
    process's start and hundreds of MB)."""
    code = f"import sys; {LIGHT[what]}; print(sorted({{'torch', 'diffusers'}} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
