"""The package's shape holds: no module reaches into another's private names, module-level imports form no cycle (a
refactor that adds one fails here, not at some user's first import), the config loads no trainer, engine or command,
only the command line uses the commands, and their functions stay short."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gspo"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_level_imports(tree: ast.Module):
    """Import statements executed when the module is imported (not inside functions or TYPE_CHECKING blocks)."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.Try, ast.If)) and not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    yield child


def test_no_module_imports_another_modules_private_names():
    """`from gspo.x import _name` and `module._name` on an imported gspo module are both refused."""
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gspo"):
                for a in node.names:
                    if _private(a.name):
                        found.append(f"{name}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in _modules():
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("gspo") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and _private(node.attr) and aliases[node.value.id] != name:
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert not found, found


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The gspo modules an import statement names (``from gspo import dist`` names gspo.dist)."""
    targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
        [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
    return {t for t in targets if t in modules}


def _import_graph() -> dict[str, set[str]]:
    """Module -> the gspo modules its module-level imports name."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in _module_level_imports(ast.parse(path.read_text())):
            graph[name] |= _targets(node, modules) - {name}
    return graph


def test_module_level_imports_have_no_cycle():
    """Following every module-level `import gspo...` from every module never comes back to where it started."""
    graph = _import_graph()
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return trail + [m, n]
            if n not in state and (cycle := visit(n, trail + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, " -> ".join(cycle)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_config_loads_no_trainer_engine_or_command():
    """Importing any module of gspo.config (the reward workers' and `gspo config`'s path) runs no module of gspo.train,
    gspo.rollout or gspo.commands, directly or through the modules it imports (with their packages' __init__)."""
    graph = _import_graph()
    found = []
    for start in sorted(m for m in graph if _under(m, "gspo.config")):
        seen, trail = {start: None}, [start]
        while trail:
            m = trail.pop()
            parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
            for n in sorted((graph[m] | parents) & set(graph)):
                if n not in seen:
                    seen[n] = m
                    trail.append(n)
        for m in seen:
            if any(_under(m, p) for p in ("gspo.train", "gspo.rollout", "gspo.commands")):
                chain = [m]
                while seen[chain[-1]] is not None:
                    chain.append(seen[chain[-1]])
                found.append(" <- ".join(chain))
    assert not found, found


def test_only_the_command_line_imports_the_commands():
    """gspo.commands is the top of the package: the command line (and the commands among themselves) import it, the
    library never does, not even inside a function."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        if name == "gspo.cli" or _under(name, "gspo.commands"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{name} imports {t}" for t in _targets(node, modules) if _under(t, "gspo.commands")]
    assert not found, found


def test_no_function_of_the_config_the_commands_or_the_command_line_is_over_100_lines():
    """Counted from its `def` line to its last line, nested functions inside the one that holds them."""
    long = []
    for name, path in _modules().items():
        if not (name == "gspo.cli" or _under(name, "gspo.config") or _under(name, "gspo.commands")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
