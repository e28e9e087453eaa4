"""The shape of the package, as a test: the layers below the engine never import it, no module imports itself
back through others, the environment is read in one registry (and the CLI), and only the registry knows model
classes by name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import kestrel

ROOT = Path(kestrel.__file__).parent
BELOW_THE_ENGINE = ("kestrel.attention", "kestrel.layers", "kestrel.models", "kestrel.kernels", "kestrel.cache")
ABOVE = ("kestrel.engine", "kestrel.speculative", "kestrel.frontend", "kestrel.server", "kestrel.bench",
         "kestrel.forward.runner", "kestrel.forward.decode_graphs", "kestrel.forward.prefill_graphs", "kestrel.llm")


def _modules() -> dict[str, set[str]]:
    """module name -> the kestrel modules it imports (at the top or inside functions)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        imports = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kestrel"):
                imports.add(node.module)
            elif isinstance(node, ast.Import):
                imports.update(a.name for a in node.names if a.name.startswith("kestrel"))
        found[name] = imports
    return found


def _resolve(name: str, modules: dict[str, set[str]]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def test_nothing_below_the_engine_imports_it():
    upward = {name: sorted(i for i in imports if i.startswith(ABOVE))
              for name, imports in _modules().items() if name.startswith(BELOW_THE_ENGINE)}
    assert {name: bad for name, bad in upward.items() if bad} == {}


def test_speculative_decoding_sits_beside_the_engine():
    """speculative/ may use forward/, models/, layers/ and cache/, never the process boundary or the server; its
    config module is parsed in the server process too, so it stays torch-free."""
    modules = _modules()
    outward = {name: sorted(i for i in imports if i.startswith(("kestrel.server", "kestrel.frontend", "kestrel.bench",
                                                                 "kestrel.llm")))
               for name, imports in modules.items() if name.startswith("kestrel.speculative")}
    assert {name: bad for name, bad in outward.items() if bad} == {}
    config_imports = ast.walk(ast.parse((ROOT / "speculative" / "config.py").read_text()))
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in ast.unparse(n) for n in config_imports)


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {r for i in imports if (r := _resolve(i, modules)) not in (None, m)} for m, imports in modules.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_environment_is_read_in_one_registry():
    readers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                     if re.search(r"os\.environ|getenv", p.read_text()))
    # the registry; the CLI fallbacks: --api-key ($KESTREL_API_KEY), bench's --base-url ($KESTREL_BASE_URL, which
    # `kestrel launch --then` exports)
    assert readers == ["bench/cli.py", "envs.py", "server/cli.py"]


def test_only_the_registry_names_model_classes():
    model_classes = set()
    for path in (ROOT / "models").glob("*.py"):
        model_classes.update(n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef))
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "models/registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & model_classes:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_collectives_the_layers_call_import_nothing_from_kestrel():
    """layers/ builds its shards with distributed/comm.py; the rest of distributed/ sits above the engine."""
    assert _modules()["kestrel.distributed.comm"] == set()
    below = {name: sorted(i for i in imports if i.startswith("kestrel.distributed") and i != "kestrel.distributed.comm")
             for name, imports in _modules().items() if name.startswith(BELOW_THE_ENGINE)}
    assert {name: bad for name, bad in below.items() if bad} == {}
