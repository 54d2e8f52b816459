"""The import-layer contract, read from the source with `ast` (nothing is imported), and the test tree's rule.

minisched's subpackages are layers: a module may import modules of its own subpackage and of the
subpackages LAYERS lists for it, never one of a layer above. sched sits beside ops and below model: the
scheduler is plain Python (no torch, no kernels), so it may import only base. Every import statement counts:
at module level, inside a function (a lazy import) and under `if TYPE_CHECKING:` (a dependency for a
reader and for import-linter as much as any other). The modules of minisched import each other without a
cycle. Tests import shared code from tests/helpers/, never another test module or a conftest.py.

The scheduler is sealed: outside minisched/sched/ no module reads a Scheduler's queues, pool, tree or
records, nor any object's `_private` field (collaborators use public methods), and inside it only
scheduler.py moves a request between queues or sets its status.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# where minisched's modules sit in the tree: the package, and the Triton kernels at the top of the tree,
# which setup.py's package_dir ships as minisched.triton_kernels (test_the_trees_are_setup_pys checks it)
TREES = {"minisched": ROOT / "minisched", "minisched.triton_kernels": ROOT / "triton_kernels"}

# layer -> the layers its modules may import besides their own, lowest layer first. A layer is a subpackage
# of minisched (minisched/<layer>/), or one of the two modules at the top: "minisched" is the package's face
# (minisched/__init__.py: `from minisched import Engine`), "__main__" is `python -m minisched`.
LAYERS = {
    "base": set(),
    "triton_kernels": set(),  # the Triton kernels: torch and triton only, imported by ops
    "ops": {"base", "triton_kernels"},
    "sched": {"base"},
    "model": {"base", "ops", "sched"},
    "parallel": {"base", "ops", "sched", "model"},
    "engine": {"base", "ops", "sched", "model", "parallel"},
    "minisched": {"base", "ops", "sched", "model", "parallel", "engine"},
    "serve": {"base", "ops", "sched", "model", "engine", "parallel"},
    "observe": {"base", "ops", "sched", "model", "engine", "parallel", "serve"},
    "cli": {"base", "ops", "sched", "model", "engine", "parallel", "serve", "observe", "minisched"},
    "__main__": {"cli"},
}
EXTENSIONS = {"minisched.ops._C"}  # compiled modules (from csrc/, built by setup.py): no source to read
NO_TORCH = {"base", "sched"}  # layers that import neither torch nor triton, not even for type checking


@dataclass(frozen=True)
class Import:
    """One imported name of one import statement: `source` (a minisched module) imports `target`."""

    source: str
    target: str
    path: Path
    line: int
    statement: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.statement}"


def module_name(path: Path) -> str:
    """The dotted name of a file: by the tree of TREES that holds it, else by its path under ROOT."""
    prefix, root = next(((name, tree) for name, tree in TREES.items() if tree in path.parents), ("", ROOT))
    parts = list(path.relative_to(root).with_suffix("").parts)
    name = ".".join(([prefix] if prefix else []) + (parts[:-1] if parts[-1] == "__init__" else parts))
    return name or prefix


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "minisched" if len(parts) == 1 else parts[1]


def imported_names(path: Path, module: str):
    """(node, absolute name) of every import in the file, wherever it sits; `from m import a` gives m.a."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                yield node, f"{base}.{alias.name}"


def sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


MODULES = {module_name(p): p for tree in TREES.values() for p in sources(tree)}
KNOWN = set(MODULES) | EXTENSIONS


def resolve(name: str) -> str | None:
    """The minisched module an imported name is or lives in (`from m import f`: m.f if a module, else m)."""
    while name and name not in KNOWN:
        name = name.rpartition(".")[0]
    return name or None


def package_imports() -> list[Import]:
    out = []
    for module, path in MODULES.items():
        for node, name in imported_names(path, module):
            target = resolve(name)
            if target is not None and target != module:
                out.append(Import(module, target, path, node.lineno, ast.unparse(node)))
    return out


IMPORTS = package_imports()


def test_every_module_has_a_layer():
    unplaced = sorted({layer_of(m) for m in MODULES} - set(LAYERS))
    assert not unplaced, f"parts of minisched in no layer: {unplaced}; add them to LAYERS in {Path(__file__).name}"


def test_the_trees_are_setup_pys():
    """TREES is where setup.py takes the package from: its package_dir maps every tree but minisched/."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    package_dir = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_dir"))
    assert {name: ROOT / path for name, path in package_dir.items()} == {
        name: path for name, path in TREES.items() if name != "minisched"
    }
    packages = ast.unparse(next(k.value for k in call.keywords if k.arg == "packages"))
    assert all(repr(name) in packages for name in package_dir), packages


def test_layers_are_ordered():
    """The table itself: every allowed layer exists and sits lower (no two layers may import each other)."""
    order = list(LAYERS)
    for layer, allowed in LAYERS.items():
        below = set(order[: order.index(layer)])
        assert allowed <= below, f"LAYERS: {layer} may import {sorted(allowed - below)}, not listed before it"


def test_no_import_climbs_a_layer():
    bad = [
        imp
        for imp in IMPORTS
        if layer_of(imp.target) != layer_of(imp.source)
        and layer_of(imp.target) not in LAYERS.get(layer_of(imp.source), set())
    ]
    assert not bad, "imports of a layer not below the importer's (see LAYERS):\n" + "\n".join(
        f"  {imp}  ({layer_of(imp.source)} -> {layer_of(imp.target)})" for imp in bad
    )


def test_base_and_sched_import_no_torch():
    bad = []
    for module, path in MODULES.items():
        if layer_of(module) in NO_TORCH:
            for node, name in imported_names(path, module):
                if name.split(".")[0] in ("torch", "triton"):
                    bad.append(f"  {path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, f"{sorted(NO_TORCH)} must run without torch:\n" + "\n".join(bad)


def cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def one_cycle(edges: dict[str, dict[str, Import]], comp: list[str]) -> list[Import]:
    """A shortest import path from comp[0] back to itself, inside the component."""
    start, inside = comp[0], set(comp)
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, imp in sorted(edges.get(v, {}).items()):
                if w == start:
                    path = [imp]
                    while path[0].source != start:
                        path.insert(0, prev[path[0].source])
                    return path
                if w in inside and w not in prev:
                    prev[w] = imp
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycle():
    edges: dict[str, dict[str, Import]] = {}
    for imp in IMPORTS:
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    found = cycles(edges)
    assert not found, "import cycles between minisched modules:\n" + "\n".join(
        f"  {len(comp)} modules import each other ({', '.join(comp)}); one cycle:\n"
        + "\n".join(f"    {imp}" for imp in one_cycle(edges, comp))
        for comp in found
    )


def test_the_checks_see_every_kind_of_import(tmp_path):
    """Lazy, TYPE_CHECKING, relative and `from package import module` imports all resolve to their module."""
    pkg = tmp_path / "minisched" / "sched"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .req import Req\n")
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minisched.model.llama import LlamaModel\n"
        "def f():\n    from minisched import ops\n    import torch\nfrom . import policy\n"
    )
    (pkg / "x.py").write_text(src)
    names = sorted(name for _, name in imported_names(pkg / "x.py", "minisched.sched.x"))
    assert names == [
        "minisched.model.llama.LlamaModel",
        "minisched.ops",
        "minisched.sched.policy",
        "torch",
        "typing.TYPE_CHECKING",
    ]
    assert [name for _, name in imported_names(pkg / "__init__.py", "minisched.sched")] == ["minisched.sched.req.Req"]
    assert resolve("minisched.model.llama.LlamaModel") == "minisched.model.llama"
    assert resolve("minisched.ops") == "minisched.ops" and resolve("minisched.ops._C") == "minisched.ops._C"
    assert layer_of("minisched.triton_kernels.store_kv") == "triton_kernels" and layer_of("minisched") == "minisched"
    assert module_name(ROOT / "triton_kernels" / "store_kv.py") == "minisched.triton_kernels.store_kv"
    assert module_name(ROOT / "triton_kernels" / "__init__.py") == "minisched.triton_kernels"
    assert module_name(ROOT / "minisched" / "ops" / "__init__.py") == "minisched.ops"
    edges = {"a": {"b": Import("a", "b", ROOT, 1, "import b")}, "b": {"a": Import("b", "a", ROOT, 2, "import a")}}
    assert cycles(edges) == [["a", "b"]] and [i.line for i in one_cycle(edges, ["a", "b"])] == [1, 2]


# -- the test tree ------------------------------------------------------------------------------------------


def test_shared_test_code_lives_in_helpers():
    """Outside tests/helpers/ there are only test modules and conftest.py files (fixtures)."""
    stray = [
        str(p.relative_to(ROOT))
        for p in sources(TESTS)
        if "helpers" not in p.relative_to(TESTS).parts and not (p.name.startswith("test_") or p.name == "conftest.py")
    ]
    assert not stray, f"shared test code belongs in tests/helpers/ (imported as `helpers.<module>`): {stray}"


def test_tests_do_not_import_each_other():
    """No file of tests/ imports a test module or a conftest: pytest would collect an imported module's tests
    twice, and a conftest is pytest's to load; shared code comes from tests/helpers/."""
    bad = []
    for path in sources(TESTS):
        for node, name in imported_names(path, module_name(path)):
            top = name.split(".")[0]
            if top.startswith("test_") or top == "conftest":
                bad.append(f"  {path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "tests import test modules or conftest (move the shared code to tests/helpers/):\n" + "\n".join(
        sorted(set(bad), key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
    )


# -- the scheduler's seal ----------------------------------------------------------------------------------

# A Scheduler's own state (minisched/sched/scheduler.py): outside minisched/sched/ it is read through the
# scheduler's public methods (snapshot, records, drain_records, flush_cache, get, ...), never directly.
SCHEDULER_STATE = {
    "waiting",
    "running",
    "chunked_req",
    "pool",
    "tree",
    "forks",
    "policy",
    "events",
    "step_stats",
    "reqs",
    "in_flight",
    "speculator",
    "unrun_loads",
    "new_token_ratio",
    "prefill_rounds",
    "stalled",
    "step_count",
    "num_retracted",
}
SCHEDULER_NAMES = {"sched", "scheduler"}  # what a scheduler is called: a variable or an attribute
# `_private` attributes of another object that are a library's documented call, not its state
PUBLIC_UNDERSCORE = {"_exit"}  # os._exit: how a forked child leaves without running the parent's cleanup


def names_a_scheduler(node: ast.expr, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in SCHEDULER_NAMES or node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in SCHEDULER_NAMES


def seal_breaks(path: Path, root: Path = ROOT) -> list[str]:
    """`x.<scheduler state>` where x names a scheduler (`sched`, `...scheduler`, or a name bound to one or to
    `Scheduler(...)`), and `x._private` where x is not `self` / `cls` (another object's private field)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            made = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Scheduler"
            if made or names_a_scheduler(value, set()):
                aliases.add(node.targets[0].id)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        where = f"  {path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"
        if node.attr in SCHEDULER_STATE and names_a_scheduler(node.value, aliases):
            bad.append(where + "  (a scheduler's state)")
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if private and not own and node.attr not in PUBLIC_UNDERSCORE:
            bad.append(where + "  (another object's private field)")
    return bad


def test_the_scheduler_is_sealed():
    """No module outside minisched/sched/ reads a scheduler's queues, pool, tree or records, nor any module
    another object's `_private` field: collaborators use public methods."""
    bad = [line for module, path in MODULES.items() if layer_of(module) != "sched" for line in seal_breaks(path)]
    assert not bad, "reads of a scheduler's state or of another object's private field:\n" + "\n".join(bad)


def test_the_seal_check_sees_aliases_and_private_fields(tmp_path):
    src = (
        "def f(engine, other):\n    s = engine.scheduler\n    a = s.waiting\n    b = engine.scheduler.events\n"
        "    c = other._hidden\n    d = self._mine\n    e = s.snapshot().running\n    os._exit(0)\n"
        "    q = Scheduler(cfg)\n    q.tree.evict(1)\n"
    )
    (tmp_path / "x.py").write_text(src)
    got = [line.split(": ", 1)[1] for line in seal_breaks(tmp_path / "x.py", tmp_path)]
    assert got == [
        "s.waiting  (a scheduler's state)",
        "engine.scheduler.events  (a scheduler's state)",
        "other._hidden  (another object's private field)",
        "q.tree  (a scheduler's state)",
    ]


# A request's status and its queue change together, in one place: the Scheduler's methods (scheduler.py).
QUEUE_FIELDS = {"waiting", "running", "chunked_req", "limbo", "status", "place"}
MOVES = {"append", "remove", "insert", "pop", "clear", "extend"}
MOVER = TREES["minisched"] / "sched" / "scheduler.py"


def queue_writes(path: Path, root: Path = ROOT) -> list[str]:
    """Assignments to another object's queue or status field (`x.waiting = ...`, `x.running[:0] = ...`,
    `x.status = ...`) and calls that change a queue in place (`x.running.remove(r)`); `self.<field>` is a
    class's own and not counted."""
    bad = []

    def field_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in QUEUE_FIELDS:
            own = isinstance(node.value, ast.Name) and node.value.id == "self"
            return None if own else node.attr
        return None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES:
            targets = [node.func.value]
        for t in targets:
            if field_of(t) is not None:
                bad.append(
                    (node.lineno, f"  {path.relative_to(root)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
                )
    return [line for _, line in sorted(bad)]


def test_only_the_scheduler_moves_requests():
    """Outside scheduler.py no module writes a request's status or a scheduler queue: batch_builder.py,
    retraction.py and preemption.py call the Scheduler's methods (admit, carry, retract, end), which keep
    `Req.place` and the status in step (docs/architecture.md, "The scheduler's surface")."""
    bad = [line for path in MODULES.values() if path != MOVER for line in queue_writes(path)]
    assert not bad, "a request moved or its status set outside the Scheduler:\n" + "\n".join(bad)


def test_the_queue_check_sees_each_kind_of_write(tmp_path):
    src = (
        "def f(sched, req, adder):\n    sched.waiting = []\n    sched.running.remove(req)\n"
        "    sched.waiting[:0] = [req]\n    req.status = 1\n    carried, sched.chunked_req = sched.chunked_req, None\n"
        "    self.running = []\n    n = len(sched.running)\n    adder.can_run.append(req)\n"
    )
    (tmp_path / "x.py").write_text(src)
    got = [line.split(": ", 1)[1] for line in queue_writes(tmp_path / "x.py", tmp_path)]
    assert got == [
        "sched.waiting = []",
        "sched.running.remove(req)",
        "sched.waiting[:0] = [req]",
        "req.status = 1",
        "carried, sched.chunked_req = (sched.chunked_req, None)",
    ]
