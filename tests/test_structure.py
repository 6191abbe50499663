"""The package's structure, as `scripts/structure_metrics.py` reads it: no count of ranks taken
from the world size outside `comm/` (the mesh answers by use, so a new axis changes the mesh
alone)."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def _metrics():
    return load_script("structure_metrics")


def test_no_world_size_outside_comm():
    metrics = _metrics()
    found = []
    for path in sorted((ROOT / "zero_engine").rglob("*.py")):
        relative = path.relative_to(ROOT / "zero_engine").as_posix()
        if relative.startswith(("comm/", "testing/")):
            continue
        found += [f"{relative}:{line}" for line in metrics._world_size_reads(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_sees_each_kind_of_read():
    reads = _metrics()._world_size_reads(ast.parse(
        "def f(world_size):\n    x = world_size\n    y = self.comm.world_size\n    z = comm.world_size\n"
        "    w = group.world_size\n"
    ))
    assert reads == [1, 2, 3, 4]  # a group's own size (line 5) is its size, not a degree


def test_at_most_twenty_functions_take_the_config_or_a_section():
    """The config reaches the package through few doors (the structure issue's item 6): each
    part gets settings derived once, not the config."""
    metrics = _metrics()
    config_types = metrics._config_types()
    takers = []
    for path in sorted((ROOT / "zero_engine").rglob("*.py")):
        relative = path.relative_to(ROOT / "zero_engine").as_posix()
        if not relative.startswith(metrics.NOT_COUNTED_FOR_REACH):
            found = metrics.config_takers(ast.parse(path.read_text()), config_types)
            takers += [f"{relative}:{name}" for name in found]
    assert 0 < len(takers) <= 20, takers


def test_a_section_typed_any_is_still_counted():
    found = _metrics().config_takers(ast.parse(
        "def a(zero: Any): ...\ndef b(section): ...\ndef c(config: ZeroEngineConfig): ...\n"
        "def d(x: OffloadConfig | None): ...\ndef e(model_config: Any): ...\ndef f(zero: Stage): ...\n"
    ), {"ZeroEngineConfig", "OffloadConfig"})
    assert found == ["a", "b", "c", "d"]


# sharding/'s sub-packages, bottom first: each may import those before it, never one after.
SHARDING_ORDER = ["shards", "tiers", "optimizer_side", "units", "reduction", "gathering", "building"]


def _sharding_imports(path: Path, modules: bool = False) -> set[str]:
    """The sub-packages of `sharding/` that ``path`` imports, by absolute module name (with
    ``modules``, ``sub.module`` where a module is named)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = [*base, *(node.module or "").split(".")] if node.module else base
            names = module if node.module else [*module, *(alias.name for alias in node.names)]
            if names[:2] == ["zero_engine", "sharding"] and len(names) > 2:
                found.add(".".join(names[2:4]) if modules else names[2])
    return found


def test_shardings_sub_packages_import_only_downward():
    upward = []
    for sub in SHARDING_ORDER:
        for path in sorted((ROOT / "zero_engine" / "sharding" / sub).glob("*.py")):
            allowed = set(SHARDING_ORDER[: SHARDING_ORDER.index(sub) + 1])
            upward += [f"{path.name} imports sharding.{other}" for other in _sharding_imports(path) - allowed]
    assert upward == []
    assert sorted(p.name for p in (ROOT / "zero_engine" / "sharding").glob("*.py")) == ["__init__.py"]


def _modules_unnamed(package: Path) -> list[str]:
    """The modules of ``package`` its ``__init__`` docstring does not name (as `` `module` ``)."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [path.stem for path in sorted(package.glob("*.py"))
            if path.name != "__init__.py" and f"`{path.stem}`" not in docstring]


def test_each_sharding_package_names_every_module_it_holds():
    """STRUCTURE item 8: a reader finds every module from its package's docstring, and
    `sharding/`'s names every sub-package in its order."""
    sharding = ROOT / "zero_engine" / "sharding"
    found = {sub: _modules_unnamed(sharding / sub) for sub in SHARDING_ORDER}
    assert found == {sub: [] for sub in SHARDING_ORDER}
    assert sorted(p.name for p in sharding.iterdir() if (p / "__init__.py").exists()) == sorted(SHARDING_ORDER)
    docstring = ast.get_docstring(ast.parse((sharding / "__init__.py").read_text())) or ""
    listed = [line.split("`")[1] for line in docstring.splitlines() if line[:1].isdigit()]
    assert listed == SHARDING_ORDER


def test_the_docstring_check_sees_a_module_left_out(tmp_path: Path):
    (tmp_path / "__init__.py").write_text('"""Holds `kept`, and a kept_too without quotes."""\n')
    for name in ("kept", "kept_too", "new"):
        (tmp_path / f"{name}.py").write_text("")
    assert _modules_unnamed(tmp_path) == ["kept_too", "new"]


def test_transforms_take_of_sharding_only_the_call_rows():
    """STRUCTURE item 3: the transforms live beside `sharding/`, not in it; of the mechanism they
    use the call agreement's rows alone (and the plan's vocabulary of placements, pure data, by
    which a transform that cuts parameters declares where they lie), and nothing in `sharding/`
    imports them."""
    used = set()
    for path in sorted((ROOT / "zero_engine" / "transforms").glob("*.py")):
        used |= _sharding_imports(path, modules=True)
    assert {module.split(".")[0] for module in used} - {"units"} <= {"gathering"}, used
    assert {module for module in used if module.startswith("units")} <= {"units.param_placement"}, used
    for path in sorted((ROOT / "zero_engine" / "sharding").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any("transforms" in module for module in modules), path


def test_no_class_over_300_lines_and_initialize_under_60():
    long = []
    for path in sorted((ROOT / "zero_engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long.append(f"{path.name}:{node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "initialize" and path.name == "entry.py":
                assert node.end_lineno - node.lineno + 1 < 60
    assert long == []


def test_at_most_20_functions_take_the_config_or_a_section():
    """The config is read where settings are derived, not handed down: functions that take it
    or a section (counted as scripts/structure_metrics.py counts them, its readers by trade
    left out) stay few."""
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        import sys

        argv, sys.argv = sys.argv, ["structure_metrics"]
        try:
            _metrics().main()
        finally:
            sys.argv = argv
    line = next(line for line in out.getvalue().splitlines() if line.startswith("functions that take the config"))
    assert int(line.split("(")[1].split(")")[0]) <= 20, line


# The loop: what every feature's obligations used to be written into by name (STRUCTURE item 1).
LOOP_FILES = ("engine.py", "model_access.py", "step.py", "entry.py")
TIER_MODULES = ("nvme", "nvme_gradient", "swap", "host_gradient")


def _names_and_imports(source: str) -> tuple[set[str], set[str]]:
    """Every identifier a module's code uses (names, attributes, arguments, definitions) and the
    last part of every module it imports."""
    names, imported = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
            imported.add(node.name.split(".")[-1])
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[-1])
    return names, imported


def test_the_loop_names_no_tier_and_imports_none():
    """A feature's resources reach the loop through what the build registered
    (`zero_engine.sharding.tiers.held`): the engine, its state access, the step and
    `initialize` import no tier module and use no name of NVMe or swap."""
    found = []
    for name in LOOP_FILES:
        names, imported = _names_and_imports((ROOT / "zero_engine" / name).read_text())
        found += [f"{name} imports {module}" for module in sorted(imported & set(TIER_MODULES))]
        found += [f"{name} names {word}" for word in sorted(names) if "nvme" in word.lower() or "swap" in word.lower()]
    assert found == []


def test_the_name_check_sees_imports_attributes_and_arguments():
    names, imported = _names_and_imports(
        "from .sharding.tiers.nvme import swap_space\nimport a.swap\ndef f(nvme_path):\n    self.param_swap = 1\n"
    )
    assert {"swap_space", "nvme_path", "param_swap"} <= names and {"nvme", "swap"} <= imported


# What names a tier or an optimizer: a word of these, the tier enum, a table key as a string.
NAMING_WORDS = ("nvme", "swap", "muon", "adam", "sgd")


def _names_a_tier_or_optimizer(source: str, allowed: set[str]) -> list[str]:
    """Identifiers (but ``allowed``) and string constants (not docstrings) that name a tier or
    an optimizer, and imports of a tier module."""
    from zero_engine.optimizer_kinds import OPTIMIZERS

    names, imported = _names_and_imports(source)
    found = [f"imports {module}" for module in sorted(imported & set(TIER_MODULES))]
    found += [name for name in sorted(names - allowed)
              if name == "Tier" or any(word in name.lower() for word in NAMING_WORDS)]
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value.lower()
            if text in OPTIMIZERS or any(word in text for word in NAMING_WORDS):
                found.append(repr(node.value))
    return found


def test_the_formula_and_the_estimate_name_no_tier_and_no_optimizer():
    """STRUCTURE item 6: the memory formula sums what each tier and each optimizer kind declares
    (`zero_engine.accounting`, `zero_engine.optimizer_kinds`), and `zero-engine estimate` prints
    the report's parts with each tier's and optimizer's own note: neither decides by a tier's or
    an optimizer's name. The report's fields (a part per tier among them) and the units'
    measurement of each (``<field>_bytes``) are the report's words, allowed."""
    from zero_engine.memory import MemoryReport

    allowed = set(MemoryReport._fields) | {f"{field}_bytes" for field in MemoryReport._fields}
    found = {name: _names_a_tier_or_optimizer((ROOT / "zero_engine" / name).read_text(), allowed)
             for name in ("memory.py", "cli.py")}
    assert found == {"memory.py": [], "cli.py": []}
    planted = ("from .sharding.tiers.nvme import check_swap_directories\n"
               "def f(report, plan):\n    '''A docstring may say Muon.'''\n"
               "    if config.optimizer.type.lower() == 'muon':\n        return report.nvme + plan.on_nvme\n"
               "    return Tier.HOST, 'SGD'\n")
    assert _names_a_tier_or_optimizer(planted, allowed) == [
        "imports nvme", "Tier", "check_swap_directories", "on_nvme", "'muon'", "'SGD'"]


def _sequence_degree_arithmetic(tree: ast.AST) -> list[int]:
    """Lines that divide by or take a remainder of ``sequence_parallel_size`` (the key read as
    an attribute or a mapping key): a count of ranks that only the mesh derives."""
    def names_the_key(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "sequence_parallel_size")
                   or (isinstance(n, ast.Constant) and n.value == "sequence_parallel_size") for n in ast.walk(node))
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.BinOp)
                   and isinstance(node.op, (ast.FloorDiv, ast.Mod, ast.Div)) and names_the_key(node)})


def test_no_sequence_degree_arithmetic_outside_comm_and_config():
    """STRUCTURE item 2: the batch ranks, a rank's batch index and a slice's length come from the
    mesh (`Mesh.from_config` needs no processes), not from ``// sequence_parallel_size``."""
    found = []
    for path in sorted((ROOT / "zero_engine").rglob("*.py")):
        relative = path.relative_to(ROOT / "zero_engine").as_posix()
        if not relative.startswith(("comm/", "config/")):
            found += [f"{relative}:{line}" for line in _sequence_degree_arithmetic(ast.parse(path.read_text()))]
    assert found == []
    planted = ("b = config.batch_sizes(ranks // config.sequence_parallel_size)\n"
               "r = rank % raw['sequence_parallel_size']\n")
    assert _sequence_degree_arithmetic(ast.parse(planted)) == [1, 2]


def _test_modules_imported(tree: ast.AST) -> list[str]:
    """The test modules (``test_*``) an import statement anywhere in ``tree`` names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[-1].startswith("test_")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_"):
            found.append(node.module)
    return found


def test_no_test_module_imports_another():
    """STRUCTURE item 9: what tests share lives in helper modules (`tiny`, `disk`, the ``*_cases``
    modules), so a test module can change without breaking another, and collecting one module
    never runs another's module-level code."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        found += [f"{path.name} imports {module}" for module in _test_modules_imported(ast.parse(path.read_text()))]
    assert found == []
    planted = "from test_nvme import DISK\ndef f():\n    import test_muon\n    from tests.test_trl import lora\n"
    assert _test_modules_imported(ast.parse(planted)) == ["test_nvme", "test_muon", "tests.test_trl"]
