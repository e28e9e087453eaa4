"""The shape of the package, as a test: every folder sits on a floor and imports only floors below it (the order a
request travels, docs/architecture.md), no folder or module imports itself back through others, kernels import
nothing of kestrel but the error type and the switch registry, the environment is read in one registry (and the
CLI), and only the registry knows model classes by name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import kestrel

ROOT = Path(kestrel.__file__).parent

# The floors, top to bottom, in the order a request travels: a unit (a folder of kestrel/, or a module at its root)
# imports only units on floors below its own; units sharing a floor do not import each other.
FLOORS: list[set[str]] = [
    {"cli"},                                                        # `kestrel ...`: picks a subcommand's module
    {"server", "bench", "train", "generate_cli", "convert_cli", "quantize_cli"},   # the front doors
    {"__init__"},                                                   # the package: LLM, SamplingParams
    {"llm"},                                                        # the offline front door
    {"frontend"},                                                   # the process boundary
    {"engine"},                                                     # the step loop
    {"ranks", "speculative", "cache", "structured"},                # beside the step loop, below it
    {"forward"},                                                    # building and running a runner
    {"config"},
    {"speculative_config"},
    {"models"},
    {"layers"},
    {"distributed", "attention"},                                   # the collectives; attention backends
    {"kernels"},
    {"batch", "sampling_params", "progress"},                       # the vocabulary everyone speaks
    {"envs", "errors"},
]
KERNELS_MAY_IMPORT = {"kestrel.envs", "kestrel.errors"}


def _unit(module: str) -> str:
    """kestrel.forward.runner -> forward; kestrel.config -> config; kestrel -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


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


def _unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: the module-level imports that make the arrow}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for name, imports in _modules().items():
        for imported in imports:
            a, b = _unit(name), _unit(imported)
            if a != b:
                graph.setdefault(a, {}).setdefault(b, []).append(f"{name} -> {imported}")
    return graph


def test_every_folder_and_root_module_has_a_floor():
    units = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in ROOT.glob("*.py")}
    placed = [u for floor in FLOORS for u in floor]
    assert len(placed) == len(set(placed)), "a unit sits on two floors"
    assert units == set(placed)


def test_every_unit_imports_only_floors_below_it():
    floor_of = {u: i for i, floor in enumerate(FLOORS) for u in floor}
    upward = [arrow for a, targets in _unit_graph().items() for b, arrows in targets.items()
              if floor_of[b] <= floor_of[a] for arrow in arrows]
    assert upward == []


def test_no_cycle_between_folders():
    """Strongly connected units (Tarjan's algorithm, on the unit graph): each must be alone."""
    graph = {a: set(targets) for a, targets in _unit_graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                knots.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert knots == []


def test_kernels_import_only_the_error_type_and_the_switch_registry():
    outside = {name: sorted(i for i in imports if not i.startswith("kestrel.kernels") and i not in KERNELS_MAY_IMPORT)
               for name, imports in _modules().items() if name.startswith("kestrel.kernels")}
    assert {name: bad for name, bad in outside.items() if bad} == {}


def test_the_speculative_config_is_torch_free():
    """It is parsed in the server process too, before torch is imported."""
    config_imports = ast.walk(ast.parse((ROOT / "speculative_config.py").read_text()))
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


def test_the_collectives_import_nothing_from_kestrel():
    """distributed/ holds only what the sharded layers call; the rank processes live in ranks/."""
    modules = _modules()
    assert {name: sorted(imports) for name, imports in modules.items()
            if name.startswith("kestrel.distributed") and imports - {n for n in modules if n.startswith("kestrel.distributed")}} == {}
