"""The documentation site: it builds with warnings as errors (broken links and missing
references fail), the snippets marked runnable run (on 1 or 2 CPU ranks), and the README stays a
front page whose links resolve. The configuration reference is checked against the schema in
tests/test_config.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = re.compile(r"<!-- runnable(?: (\d+))? -->\n```python\n(.*?)```", re.S)


def _snippets() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        for index, match in enumerate(RUNNABLE.finditer(path.read_text())):
            found.append((f"{path.relative_to(ROOT)}#{index}", int(match.group(1) or 1), match.group(2)))
    return found


SNIPPETS = _snippets()


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("zero_engine.initialize", "Engine.save_checkpoint", "zero_engine.integrations.accelerate.Accelerator"):
        assert f"<code>{name}</code>" in api, name


def test_the_api_reference_is_the_docstrings_as_they_are() -> None:
    """docs/reference/api.md is plain Markdown generated from the docstrings, readable in the
    repository (issue 65), and current."""
    done = subprocess.run([sys.executable, "scripts/make_api_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ":::" not in (ROOT / "docs" / "reference" / "api.md").read_text()


def test_runnable_snippets_are_found() -> None:
    assert len(SNIPPETS) >= 3 and any(ranks == 2 for _, ranks, _ in SNIPPETS), SNIPPETS


def run_snippet(rank: int, world_size: int, where: str, code: str) -> None:
    """A snippet as a script of its own, on this rank (torchrun's environment is set)."""
    exec(compile(code, where, "exec"), {"__name__": "__main__"})  # noqa: S102 - the repository's own docs


@pytest.mark.parametrize("where,ranks,code", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_each_runnable_snippet_runs(where: str, ranks: int, code: str, tmp_path: Path) -> None:
    """One rank: a process of its own. Several: the harness's ranks with torchrun's
    environment, which report each rank's exception. (Not torchrun itself: with torch 2.13 a
    2-rank gloo script that ran autograd aborts at interpreter exit in about 2 runs of 5,
    engine or not: "terminate called without an active exception", after its last line.)"""
    if ranks > 1:
        run_on_ranks(ranks, run_snippet, where, code, backend=None, timeout=240, allow_numpy=True)
        return
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, (where, result.stderr[-3000:])


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && torchrun --standalone' in readme
    assert "python -m pytest -q\n" in readme
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


_NOT_OURS = re.compile(r"^[\"']?zero[-_.]?engine(?:\[[^\]]*\])?(?:[=<>~!].*)?[\"']?$", re.I)


def test_no_install_line_names_the_index_package_we_do_not_own() -> None:
    """"zero-engine" on the public index is another project (issue 65): every install line
    installs from the repository (``pip install -e .``), never by that name, and the
    distribution is named otherwise."""
    offending = []
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "zero_engine").rglob("*.py"),
             *(ROOT / "scripts").glob("*"), *(ROOT / "examples").rglob("*"), ROOT / ".ci" / "run"]
    for path in files:
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for command in re.findall(r"pip install ([^`|&;\n]*)", line):
                if any(_NOT_OURS.match(token) for token in command.split()):
                    offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offending, offending
    metadata = (ROOT / "setup.cfg").read_text()
    assert "\nname = zero-sharding-engine\n" in metadata
