"""The README's Python snippets import only what the README's own install commands install.

A user runs the README's install lines as written, then pastes its snippets; a snippet importing a package those
lines never install fails with `No module named ...` (it did: `openai`). This reads the README, works out the
distributions its `pip install` lines bring (requirement files followed through `-r`, their dependencies except
under --no-deps, read from this environment's installed metadata), and checks every import of every snippet.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def snippets() -> list[tuple[str, str]]:
    """Each ```python block with the README text of its section before it (from the last heading)."""
    text = README.read_text()
    found = []
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[:match.start()]
        heading = max(before.rfind("\n#"), 0)
        found.append((match[1], before[heading:]))
    return found


def install_commands(text: str) -> list[list[str]]:
    """Each `pip install ...` in text, as argv lists (the `&&` chains split)."""
    commands = []
    for line in text.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part.strip()) if "pip install" in part else []
            if words and words[0].endswith("pip") and words[1:2] == ["install"]:
                commands.append(words[2:])
    return commands


def users_install(section: str) -> list[list[str]]:
    """What a user who pastes a snippet has run: the README's first command (the one that installs and runs the
    default model) and the install lines of the snippet's own section."""
    first = next(line for line in README.read_text().splitlines() if "pip install" in line)
    return install_commands(first) + install_commands(section)


def _requirement_file(path: Path) -> list[str]:
    names = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r"):
            names += _requirement_file(path.parent / line[2:].strip())
        elif line:
            names.append(Requirement(line).name)
    return names


def _with_dependencies(names: list[str]) -> set[str]:
    """names and everything they require, as pip resolves them (extras aside), from the installed metadata."""
    seen, todo = set(), [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def installed_by(commands: list[list[str]]) -> set[str]:
    installed: set[str] = set()
    for args in commands:
        no_deps = "--no-deps" in args
        names: list[str] = []
        words = [a for a in args if a not in ("-q", "--no-deps")]
        for i, word in enumerate(words):
            if word == "-r":
                names += _requirement_file(ROOT / words[i + 1])
            elif word == "-e" and words[i + 1] == ".":
                names.append("kestrel")
            elif not word.startswith("-") and (i == 0 or words[i - 1] not in ("-r", "-e")):
                names.append(Requirement(word).name)
        installed |= {_norm(n) for n in names} if no_deps else _with_dependencies(names)
    return installed


def top_level_imports(code: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_readme_installs_and_shows_code():
    assert len(snippets()) >= 2
    installed = installed_by(users_install(""))
    assert "kestrel" in installed and "torch" in installed


@pytest.mark.parametrize("index", range(len(snippets())))
def test_each_snippet_imports_only_what_the_readme_installs_before_it(index):
    code, section = snippets()[index]
    installed = installed_by(users_install(section))
    providers = md.packages_distributions()
    for module in sorted(top_level_imports(code) - set(sys.stdlib_module_names)):
        dists = {_norm(d) for d in providers.get(module, [])} or {_norm(module)}
        assert dists & installed, (f"README snippet {index} imports {module!r} (from {sorted(dists)}), which the "
                                   f"README's install lines before it do not install")
