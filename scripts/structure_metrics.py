"""Size and reach figures of the package's structure, for the notes of restructuring work.

Prints the longest classes and modules (lines), the builders' argument counts, the modules that
name the config's types (``ZeroEngineConfig`` or one of its section classes), the functions
that take one as an argument (or an argument named as a section and typed ``Any``), and the
world size read outside ``comm/`` (a ``world_size`` name or argument, or ``comm.world_size``:
counts of ranks are asked of the mesh by use there). Counted with ``ast`` over ``zero_engine/``
(integrations, the config package itself, the CLI and ``testing/`` left out: they are the
config's readers by trade). Run from the repository root::

    python scripts/structure_metrics.py [--top 5]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zero_engine"
NOT_COUNTED_FOR_REACH = ("config/", "integrations/", "testing/", "cli.py")


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def _config_types() -> set[str]:
    names = {"ZeroEngineConfig"}
    for file in ("sections.py", "schema.py"):
        tree = ast.parse((PACKAGE / "config" / file).read_text())
        names |= {node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Config")}
    return names


def _relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def _world_size_reads(tree: ast.AST) -> list[int]:
    """Lines naming ``world_size`` (a variable or an argument) or reading ``<...>comm.world_size``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "world_size":
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "world_size":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "world_size":
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "comm":
                lines.append(node.lineno)
    return sorted(set(lines))


# Parameter names that hold a section, whatever their annotation says: typed ``Any`` (or not
# at all), a section would slip past the count.
SECTION_NAMES = {"config", "zero", "section"}


def config_takers(tree: ast.AST, config_types: set[str]) -> list[str]:
    """The functions in ``tree`` that take the config or a section: an argument annotated with
    one of ``config_types``, or named as a section (`SECTION_NAMES`) and annotated ``Any`` or
    not at all."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        annotations = [arg.annotation for arg in arguments if arg.annotation]
        named = {n.id for a in annotations for n in ast.walk(a) if isinstance(n, ast.Name)}
        named |= {a.value for a in annotations if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        untyped = any(
            arg.arg in SECTION_NAMES and (arg.annotation is None or ast.unparse(arg.annotation) in ("Any", "'Any'"))
            for arg in arguments
        )
        if named & config_types or untyped:
            found.append(node.name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    classes, modules, builders, reached, takers, world_reads = [], [], [], [], [], []
    config_types = _config_types()
    for path in _modules():
        text = path.read_text()
        modules.append((len(text.splitlines()), _relative(path)))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                classes.append((node.end_lineno - node.lineno + 1, f"{_relative(path)}:{node.name}", methods))
            if isinstance(node, ast.FunctionDef) and (node.name.startswith("build") or node.name == "__init__"):
                named = [arg.arg for arg in [*node.args.args, *node.args.kwonlyargs]]
                count = len([name for name in named if name != "self"])
                builders.append((count, f"{_relative(path)}:{node.name}"))
        relative = _relative(path)
        if not relative.startswith(("comm/", "testing/")):
            world_reads += [f"{relative}:{line}" for line in _world_size_reads(tree)]
        if not relative.startswith(NOT_COUNTED_FOR_REACH):
            names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            if names & config_types:
                reached.append(relative)
            takers += [f"{relative}:{name}" for name in config_takers(tree, config_types)]
    print("longest classes (lines, methods):")
    for lines, name, methods in sorted(classes, reverse=True)[: args.top]:
        print(f"  {lines:5d} {methods:3d}  {name}")
    print("longest modules (lines):")
    for lines, name in sorted(modules, reverse=True)[: args.top]:
        print(f"  {lines:5d}  {name}")
    print("most arguments of a builder or constructor:")
    for count, name in sorted(builders, reverse=True)[: args.top]:
        print(f"  {count:5d}  {name}")
    print(f"modules that name the config's types ({len(reached)}):")
    for name in reached:
        print(f"  {name}")
    print(f"functions that take the config or a section of it ({len(takers)}):")
    for name in takers:
        print(f"  {name}")
    print(f"the world size read outside comm/ ({len(world_reads)}; ask comm.mesh for a count by use):")
    for place in world_reads:
        print(f"  {place}")


if __name__ == "__main__":
    main()
