"""The package's shape holds: no module reaches into another's private names, imports form no cycle, not even through
an import inside a function (a refactor that adds one fails here, not at some user's first import or first call),
each package that owns one concern imports nothing of the concerns kept out of it (issue 27: one home per concern),
the config loads no trainer, engine or command, only the command line uses the commands, the top level stays small
and no function grows past 100 lines."""
from __future__ import annotations

import ast
import functools
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


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_imports(tree: ast.Module):
    """Import statements executed when the module is imported (not inside functions or TYPE_CHECKING blocks)."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.Try, ast.If)) and not _type_checking(node):
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    yield child


def _imports_outside_type_checking(node: ast.AST):
    """Every import statement anywhere below ``node`` (functions and methods included) but those under ``if
    TYPE_CHECKING:``, which never run."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not _type_checking(child):
            yield from _imports_outside_type_checking(child)


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


def _import_graph(anywhere: bool = False) -> dict[str, set[str]]:
    """Module -> the gspo modules its module-level imports name (with ``anywhere``, its imports inside functions too)."""
    modules = _modules()
    imports = _imports_outside_type_checking if anywhere else _module_level_imports
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in imports(ast.parse(path.read_text())):
            graph[name] |= _targets(node, modules) - {name}
    return graph


def test_the_import_graph_follows_imports_in_functions_but_not_type_checking_blocks():
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    from gspo import a\n"
                     "def f():\n    from gspo import b\n    if TYPE_CHECKING:\n        import gspo.c\n"
                     "class C:\n    def g(self):\n        import gspo.d\n")
    found = [ast.unparse(n) for n in _imports_outside_type_checking(tree)]
    assert found == ["import os", "from gspo import b", "import gspo.d"]


def test_imports_have_no_cycle():
    """Following every `import gspo...` from every module, those inside functions included, never comes back to where
    it started: an import moved into a function to dodge a cycle leaves the two modules depending on each other."""
    graph = _import_graph(anywhere=True)
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


# ---------------------------------------------------------------------------------------------- one home per concern


def _imports_anywhere(source: str, package: str) -> set[str]:
    """Every module a file's source imports, wherever the statement is (module level, functions, TYPE_CHECKING
    blocks) or through ``importlib.import_module("...")``; relative imports are resolved against ``package`` (the
    package the file is in), and ``from a import b`` counts as importing both ``a`` and ``a.b``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(node.args[0].value)
    return out


def _forbidden_imports(owner: str, forbidden: tuple[str, ...]) -> list[str]:
    """``module imports target`` for each import of a ``forbidden`` module (or one below it) by ``owner`` or a module
    below it."""
    found, scanned = [], 0
    for name, path in _modules().items():
        if name != owner and not name.startswith(owner + "."):
            continue
        scanned += 1
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += [f"{name} imports {m}" for m in sorted(_imports_anywhere(path.read_text(), package))
                  if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert scanned, f"{owner} is gone: move this rule with it"  # a rule over nothing would pass forever
    return found


def test_the_import_finder_sees_imports_in_functions_relative_ones_and_from_the_package():
    source = ("def f():\n    from gspo import dist\n"
              "class C:\n    def g(self):\n        import gspo.train.loop\n"
              "from ..rollout import hf\n"
              "importlib.import_module('gspo.parallel')\n")
    found = _imports_anywhere(source, "gspo.models")
    assert {"gspo.dist", "gspo.train.loop", "gspo.rollout", "gspo.parallel"} <= found


def test_the_run_log_never_imports_the_trainer():
    """runlog/ records what the trainer hands it: importing gspo.train from it (even inside a function) would tie the
    run's files to the loop's internals and make a cycle waiting to happen."""
    assert not _forbidden_imports("gspo.runlog", ("gspo.train",))


def test_models_never_import_the_process_layout_or_the_engines():
    """models/ acts on one Hugging Face model (loading, forward helpers, LoRA, MoE routing); how it is sharded across
    processes or sampled from is its callers' business."""
    assert not _forbidden_imports("gspo.models", ("gspo.parallel", "gspo.dist", "gspo.rollout"))


def test_the_vllm_engine_never_imports_the_checkpoint_module():
    """It needs the RNG capture only (gspo.runtime), not the checkpoint file format."""
    assert not _forbidden_imports("gspo.rollout.vllm_engine", ("gspo.checkpoint",))


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


def _gspo_imports(path: Path) -> set[str]:
    """Every gspo module ``path`` imports, anywhere in the file (functions included), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gspo")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gspo"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _breaks(files, allowed) -> list[str]:
    return [f"{p.relative_to(SRC)} imports {m}" for p in files for m in sorted(_gspo_imports(p)) if not allowed(m)]


def test_the_collectives_and_the_math_import_nothing_above_errors():
    """parallel/comm.py (collectives) and algorithms/ (pure math) import nothing of gspo but gspo.errors (and
    algorithms/ its own modules)."""
    comm = [PACKAGE / "parallel" / "comm.py"]
    algorithms = sorted((PACKAGE / "algorithms").glob("*.py"))
    broken = _breaks(comm, lambda m: m.startswith("gspo.errors"))
    broken += _breaks(algorithms, lambda m: m.startswith(("gspo.errors", "gspo.algorithms")))
    assert not broken, broken


def test_parallel_never_imports_the_trainer_or_the_log_prob_pass():
    """parallel/ holds the policy for the trainer without knowing it: no gspo.train (the actor hands its FSDP entry in)."""
    broken = _breaks(sorted((PACKAGE / "parallel").glob("*.py")), lambda m: not m.startswith("gspo.train"))
    assert not broken, broken


def test_the_top_level_is_a_few_modules_beside_the_packages():
    """At most 8 modules sit at the top of src/gspo beside the packages (__init__ aside)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


def test_no_function_is_over_100_lines():
    """No function or method in the package is longer than 100 lines (a function that long does several things)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long


@functools.cache
def _names_in(path: Path) -> frozenset[str]:
    """The names module ``path`` may hand out: every name it binds anywhere and every string in it (a lazy
    ``__getattr__``'s names, ``__all__``). Lenient on purpose: only a name that is nowhere in the file is missing."""
    names = {"*"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return frozenset(names)


def test_every_gspo_import_names_a_module_that_exists():
    """Every ``gspo...`` import anywhere in src/, tests/ and benchmarks/ (inside functions too, where only a run that
    reaches them would fail) names a module or package of the tree, and each name it imports from one is a module
    below it or a name it defines."""
    modules = _modules()
    root = SRC.parent
    missing = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "benchmarks").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("gspo")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gspo"):
                if node.module not in modules:
                    names = [node.module + " (no such module)"]
                else:  # `from gspo import lora` after lora moved: the package is there, the name is not
                    known = _names_in(modules[node.module])
                    names = [f"{node.module}.{a.name} (no such module or name)" for a in node.names
                             if f"{node.module}.{a.name}" not in modules and a.name not in known]
            else:
                continue
            missing += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n not in modules]
    assert not missing, missing


def test_the_kernels_import_nothing_of_the_trainer_the_engines_collection_or_the_feed():
    """kernels/ is the forward both sides run (the fused decode step, the batch-invariant kernels, their backward): the
    engine and the trainer import it, it imports neither of them (issue 50)."""
    found = _forbidden_imports("gspo.kernels", ("gspo.train", "gspo.rollout", "gspo.collect", "gspo.feed"))
    assert not found, found


# What train/ may take from rollout/: the engine protocol, the rounding of the weights handed to an engine
# (rollout.engine_weight_bits), and the engine's weight copy, which the exact pass keeps as the engine does
# (EngineWeights lives in rollout/graph.py until the paged engine rewrites that file). The kernels come from kernels/;
# the engine is built in collect/.
_TRAIN_FROM_ROLLOUT = {"gspo.rollout.RolloutEngine", "gspo.rollout.rounded_weights", "gspo.rollout.graph.EngineWeights"}


def test_the_trainer_takes_no_kernel_from_the_engines():
    """train/ imports from gspo.rollout only the names above, wherever the import is (functions included): the fused
    decoder, the exact kernels and their backward are gspo.kernels', not reached through an engine module."""
    found, scanned = [], 0
    for name, path in _modules().items():
        if not _under(name, "gspo.train"):
            continue
        scanned += 1
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                taken = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                taken = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{name}:{node.lineno} imports {t}" for t in taken
                      if _under(t, "gspo.rollout") and t not in _TRAIN_FROM_ROLLOUT]
    assert scanned, "gspo.train is gone: move this rule with it"
    assert not found, found


def test_rewards_and_environments_never_import_each_other():
    """rewards/ and envs/ are two clients of the one pool for user code (gspo.workers): neither imports the other,
    at module level or inside a function (envs/ used to borrow the reward workers' internals, and the reward workers'
    fork server imported the environment worker)."""
    found = _forbidden_imports("gspo.rewards", ("gspo.envs",)) + _forbidden_imports("gspo.envs", ("gspo.rewards",))
    assert not found, found


def test_the_worker_pool_imports_none_of_its_clients():
    """workers/ runs user code for whoever asks: its clients name the modules its fork server preloads as strings and
    hand it their worker functions, so it imports nothing of rewards/, envs/ or the trainer, engines and collection."""
    found = _forbidden_imports("gspo.workers", ("gspo.rewards", "gspo.envs", "gspo.train", "gspo.rollout",
                                                "gspo.collect"))
    assert not found, found


def test_the_feed_imports_neither_the_trainer_nor_the_sampling_side():
    """feed/ carries batches from the sampling side to the update and weights back: the collect stage and the engine
    come in as objects, so the feed never imports gspo.train or gspo.collect (even inside a function)."""
    assert not _forbidden_imports("gspo.feed", ("gspo.train", "gspo.collect"))


def test_the_sampling_side_never_imports_the_trainer():
    """collect/ (the collect stage, the sampler's parts, the decode process) samples and scores; a decode process runs
    it without any trainer, so it never imports gspo.train."""
    assert not _forbidden_imports("gspo.collect", ("gspo.train",))


def test_the_checkpoint_files_never_import_the_trainer():
    """gspo.checkpoint (the checkpoint files: write, read, list, export's source) is used by commands that train
    nothing, so it never imports gspo.train."""
    assert not _forbidden_imports("gspo.checkpoint", ("gspo.train",))
