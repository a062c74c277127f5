"""Structure rules for src/plait (docs: /work/PLAN.md, "Rules the structure test enforces").

Everything here reads the sources with :mod:`ast` and never imports plait, so it is fast
(the parse is most of its time) and still works when a cycle would break ``import plait``.

- layers: a module may import only modules of its own layer or lower ones. Every import
  counts: module level, function-local and type-only (``if TYPE_CHECKING:``).
- no import cycle among plait modules, with the same edges.
- no class longer than ``MAX_CLASS_LINES`` (the torch ProcessGroup subclass is exempt).
- reads of ``x._name`` on anything but ``self``/``cls``/a third-party module: at most
  ``MAX_PRIVATE_READS``, each with a ``# private: <why>`` comment.
"""

from __future__ import annotations

import ast
import io
import itertools
import tokenize
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "plait"

LAYER_NAMES = ("base", "topology", "transport", "algorithms", "tuning", "core", "api", "tools")

# Module -> layer. A key matches the module of that dotted name and every module below it
# (whole components: "plait.comm" does not match "plait.common"); the longest matching key
# wins. The key "plait" is the one exception: it matches only the package __init__, or it
# would silently place every module missing from this table in layer 6.
LAYERS: dict[str, int] = {
    # 0 base
    "plait.errors": 0,
    "plait.config": 0,
    "plait.reduce": 0,
    "plait.buffers": 0,
    "plait.flightrec": 0,
    "plait.work": 0,
    # 1 topology (must not import algorithms)
    "plait.topology": 1,
    # 2 transport; rendezvous only wraps torch Stores
    "plait.transport": 2,
    "plait.rendezvous": 0,
    # 3 algorithms
    "plait.algorithms": 3,
    # 4 tuning
    "plait.tuning": 4,
    # 5 core
    "plait.membership": 5,
    "plait.fabric": 5,
    "plait.executor": 5,
    "plait.health": 5,
    "plait.progress": 5,
    "plait.fastpath": 5,
    "plait.p2p": 5,
    "plait.args": 5,
    "plait.calls": 5,
    "plait.shrink": 5,
    # 6 api
    "plait.comm": 6,
    "plait.check": 6,
    "plait": 6,
    # 7 tools
    "plait.torch": 7,
    "plait.bench": 7,
    "plait.cli": 7,
    "plait.testing": 7,
    "plait.testbed": 7,
}

MAX_CLASS_LINES = 400
# The one class allowed past MAX_CLASS_LINES: the torch ProcessGroup subclass in this file,
# recognised by a base class whose name contains one of these words (it implements torch's
# whole ProcessGroup/Backend interface, which cannot be split across classes).
LONG_CLASS_FILE = "plait/torch/backend.py"
LONG_CLASS_BASE_WORDS = ("ProcessGroup", "Backend")

MAX_PRIVATE_READS = 10
PRIVATE_MARK = "private:"
# The one place torch private names are touched; its private reads are not counted.
PRIVATE_EXEMPT_FILE = "plait/torch/_compat.py"


def layer_of(module: str) -> int | None:
    """The layer of ``module`` by ``LAYERS`` (longest matching key), None if not covered."""
    if module == PACKAGE:
        return LAYERS[PACKAGE]
    best: str | None = None
    for key in LAYERS:
        if key == PACKAGE:
            continue
        if (module == key or module.startswith(key + ".")) and (
            best is None or len(key) > len(best)
        ):
            best = key
    return None if best is None else LAYERS[best]


def describe_layer(layer: int | None) -> str:
    return "no layer" if layer is None else f"layer {layer} {LAYER_NAMES[layer]}"


def is_plait(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


ImportNode = ast.Import | ast.ImportFrom


@dataclass(frozen=True, eq=False)
class SourceFile:
    module: str
    rel: str  # path relative to src/, as printed in messages
    is_package: bool
    tree: ast.Module
    source: str
    lines: tuple[str, ...]
    imports: tuple[tuple[ImportNode, str], ...]  # every import statement, see walk_imports


@dataclass(frozen=True)
class Edge:
    """One import of a plait module by a plait module."""

    src: str
    dst: str
    rel: str
    line: int
    kind: str  # "module-level", "function-local" or "type-only"

    @property
    def site(self) -> str:
        return f"src/{self.rel}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def comments_of(file: SourceFile) -> dict[int, str]:
    """Line number -> the comment on that line. Only for files with private reads: the
    pure-Python tokenizer is the slowest step here."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(file.source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    return comments


@cache
def source_files() -> tuple[SourceFile, ...]:
    files = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        files.append(SourceFile(
            module=module_name(path),
            rel=path.relative_to(SRC).as_posix(),
            is_package=path.name == "__init__.py",
            tree=tree,
            source=source,
            lines=tuple(source.splitlines()),
            imports=tuple(walk_imports(tree)),
        ))
    return tuple(files)


@cache
def known_modules() -> frozenset[str]:
    return frozenset(f.module for f in source_files())


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def walk_imports(tree: ast.Module) -> Iterator[tuple[ImportNode, str]]:
    """Every import statement in ``tree`` with where it sits (module-level, function-local
    or type-only), at any depth: inside functions, classes, try/except, with and if blocks.
    Imports are statements, so only statements (and the except/case clauses holding them)
    are descended into, not expressions: string annotations are never imports."""

    def visit(node: ast.AST, kind: str) -> Iterator[tuple[ImportNode, str]]:
        if isinstance(node, ImportNode):
            yield node, kind
            return
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, "type-only")
            for child in node.orelse:  # the else branch runs
                yield from visit(child, kind)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
            kind == "module-level"
        ):
            kind = "function-local"
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                yield from visit(child, kind)

    yield from visit(tree, "module-level")


def resolve_from(file: SourceFile, node: ast.ImportFrom) -> str | None:
    """The absolute module ``from <...> import`` names; None if it climbs above the top."""
    if node.level == 0:
        return node.module
    package = file.module if file.is_package else file.module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def imported_modules(file: SourceFile, node: ImportNode) -> list[str]:
    """The modules one import statement names (plait or not), one per alias.

    ``import plait.x.y`` names plait.x.y only: that it runs plait/__init__ and plait/x/
    __init__ first is true of every import of a plait module, and counting it would put
    the package __init__ (layer 6) under every module. ``from pkg import name`` names the
    submodule pkg.name when there is one, else pkg (name is then an attribute of pkg).
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = resolve_from(file, node)
    if base is None:
        return []  # test_imports_respect_layers reports it
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if alias.name != "*" and sub in known_modules() else base)
    return out


@cache
def import_edges() -> tuple[Edge, ...]:
    edges: dict[Edge, None] = {}  # ordered set: `from .x import a, b` is one edge
    for file in source_files():
        for node, kind in file.imports:
            for target in imported_modules(file, node):
                if is_plait(target):
                    edges[Edge(file.module, target, file.rel, node.lineno, kind)] = None
    return tuple(edges)


# ---------------------------------------------------------------------------- layers


def test_every_module_has_a_layer() -> None:
    missing = [f"src/{f.rel}: {f.module}" for f in source_files() if layer_of(f.module) is None]
    assert not missing, (
        "modules not placed in any layer; add them to LAYERS in tests/test_structure.py "
        "(and to the layer table of PLAN.md):\n  " + "\n  ".join(missing)
    )


def test_imports_respect_layers() -> None:
    bad = [
        f"src/{file.rel}:{node.lineno}: relative import climbs above the top package"
        for file in source_files()
        for node, _ in file.imports
        if isinstance(node, ast.ImportFrom) and resolve_from(file, node) is None
    ]
    for edge in import_edges():
        src_layer, dst_layer = layer_of(edge.src), layer_of(edge.dst)
        if src_layer is None:
            continue  # test_every_module_has_a_layer reports it
        if dst_layer is None or dst_layer > src_layer:
            bad.append(
                f"{edge.site}: {edge.src} ({describe_layer(src_layer)}) imports {edge.dst} "
                f"({describe_layer(dst_layer)}) [{edge.kind}]"
            )
    assert not bad, (
        f"{len(bad)} imports break the layer order (a module may import only its own layer "
        "or lower ones; type-only and function-local imports count; the layers are LAYERS "
        "in tests/test_structure.py):\n  " + "\n  ".join(bad)
    )


# ---------------------------------------------------------------------------- cycles


def import_graph() -> dict[str, dict[str, list[Edge]]]:
    """src -> dst -> the import statements making that edge. Self-edges (a package
    __init__ doing ``from . import name`` of its own attribute) are not cycles."""
    graph: dict[str, dict[str, list[Edge]]] = {m: {} for m in known_modules()}
    for edge in import_edges():
        if edge.src != edge.dst:
            graph[edge.src].setdefault(edge.dst, []).append(edge)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[Edge]]]) -> list[list[str]]:
    """Tarjan's algorithm; the components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_path(graph: dict[str, dict[str, list[Edge]]], start: str, goal: str,
                  within: set[str]) -> list[str]:
    prev: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        v = queue.popleft()
        if v == goal:
            path = [v]
            while path[-1] != start:
                path.append(prev[path[-1]])
            return path[::-1]
        for w in sorted(graph[v]):
            if w in within and w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no path {start} -> {goal} inside its component")


def cycles_of(graph: dict[str, dict[str, list[Edge]]], comp: list[str]) -> list[list[str]]:
    """A set of cycles covering every edge inside ``comp``: for each edge u -> v the
    shortest cycle through it. Each cycle is listed from its smallest module, closed
    (first module repeated at the end); breaking all of them breaks the component."""
    members = set(comp)
    found: dict[tuple[str, ...], list[str]] = {}
    for u in comp:
        for v in sorted(graph[u]):
            if v not in members:
                continue
            cycle = [u, *shortest_path(graph, v, u, members)[:-1]]
            first = cycle.index(min(cycle))
            rotated = cycle[first:] + cycle[:first]
            found.setdefault(tuple(rotated), [*rotated, rotated[0]])
    return [found[key] for key in sorted(found, key=lambda k: (len(k), k))]


def describe_cycle(graph: dict[str, dict[str, list[Edge]]], cycle: list[str]) -> str:
    steps = []
    for u, v in itertools.pairwise(cycle):
        sites = ", ".join(f"{e.site} [{e.kind}]" for e in graph[u][v])
        steps.append(f"      {u} -> {v}  at {sites}")
    return "    cycle " + " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_no_import_cycles() -> None:
    # Edges from a package __init__ to its own submodules are kept: plait's package
    # __init__s only re-export their submodules, so they close a cycle only when a
    # submodule imports a name back from its package __init__ — which is a real cycle
    # (it works only in one import order), not a spurious one.
    graph = import_graph()
    reports = []
    for comp in strongly_connected(graph):
        cycles = cycles_of(graph, comp)
        reports.append(
            f"  {len(comp)} modules import each other: {comp}\n"
            + "\n".join(describe_cycle(graph, c) for c in cycles)
        )
    assert not reports, (
        "import cycles (type-only and function-local imports count; break each cycle "
        "listed):\n" + "\n".join(reports)
    )


def test_bench_loop_and_report_do_not_import_each_other() -> None:
    # PLAN.md: what they share (the result dataclasses) lives in plait/bench/results.py.
    graph = import_graph()
    loop, report = "plait.bench.loop", "plait.bench.report"
    for comp in strongly_connected(graph):
        if {loop, report} <= set(comp):
            members = set(comp)
            cycle = shortest_path(graph, loop, report, members)
            cycle += shortest_path(graph, report, loop, members)[1:]
            raise AssertionError(
                f"{loop} and {report} import each other (move what they share to "
                "plait/bench/results.py):\n" + describe_cycle(graph, cycle)
            )


# ---------------------------------------------------------------------------- classes


def is_exempt_long_class(file: SourceFile, node: ast.ClassDef) -> bool:
    return file.rel == LONG_CLASS_FILE and any(
        word in ast.unparse(base) for base in node.bases for word in LONG_CLASS_BASE_WORDS
    )


def test_no_long_classes() -> None:
    bad = []
    for file in source_files():
        for node in ast.walk(file.tree):
            if not isinstance(node, ast.ClassDef) or is_exempt_long_class(file, node):
                continue
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CLASS_LINES:
                bad.append(f"src/{file.rel}:{node.lineno}: class {node.name} is {length} lines")
    assert not bad, (
        f"classes longer than {MAX_CLASS_LINES} lines (split them; only the ProcessGroup "
        f"subclass in {LONG_CLASS_FILE} is exempt):\n  " + "\n  ".join(bad)
    )


# ---------------------------------------------------------------------------- privates


def is_private_name(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def is_foreign_module(base: ast.expr, foreign: frozenset[str]) -> bool:
    """``os``, ``torch``, or a public dotted path below one (``torch.distributed``)."""
    while isinstance(base, ast.Attribute) and not base.attr.startswith("_"):
        base = base.value
    return isinstance(base, ast.Name) and base.id in foreign


def foreign_module_names(file: SourceFile) -> frozenset[str]:
    """Names bound, anywhere in the file, only by imports of non-plait modules (os, sys,
    torch, ``from torch import distributed as dist``, ...): their private names are the
    third party's business, not plait's encapsulation."""
    foreign: set[str] = set()
    ours: set[str] = set()
    for node, _ in file.imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.partition(".")[0]
                (ours if is_plait(alias.name) else foreign).add(bound)
        else:
            base = resolve_from(file, node) or PACKAGE  # unresolved: count it as ours
            for alias in node.names:
                (ours if is_plait(base) else foreign).add(alias.asname or alias.name)
    return frozenset(foreign - ours)


def is_own_object(base: ast.expr, classes: tuple[str, ...]) -> bool:
    """``self``/``cls`` and the same object seen as its class or through ``super()``:
    ``super()``, ``type(self)``, ``self.__class__``, and an enclosing class by its name
    (``Work._lock`` inside ``class Work``)."""
    if isinstance(base, ast.Name):
        return base.id in ("self", "cls") or base.id in classes
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Name):
        if base.func.id == "super":
            return True
        if base.func.id == "type" and len(base.args) == 1 and not base.keywords:
            return is_own_object(base.args[0], classes)
    if isinstance(base, ast.Attribute) and base.attr == "__class__":
        return is_own_object(base.value, classes)
    return False


@dataclass(frozen=True)
class PrivateRead:
    rel: str
    line: int
    expr: str  # the attribute read, e.g. comm._cfg
    text: str  # its source line
    marked: bool

    def __str__(self) -> str:
        return f"src/{self.rel}:{self.line}: {self.text}    [{self.expr}]"


def attribute_reads(tree: ast.Module) -> Iterator[tuple[ast.Attribute, tuple[str, ...]]]:
    """Every ``x.name`` read in ``tree``, with the names of the classes around it."""
    stack: list[tuple[ast.AST, tuple[str, ...]]] = [(tree, ())]
    while stack:  # iterative: a recursive generator is the slowest part of this test
        node, classes = stack.pop()
        if isinstance(node, ast.ClassDef):
            classes = (*classes, node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            yield node, classes
        stack.extend((child, classes) for child in ast.iter_child_nodes(node))


@cache
def private_reads() -> tuple[PrivateRead, ...]:
    out = []
    for file in source_files():
        if file.rel == PRIVATE_EXEMPT_FILE:
            continue
        foreign = foreign_module_names(file)
        for node, classes in attribute_reads(file.tree):
            if not is_private_name(node.attr):
                continue
            base = node.value
            if is_own_object(base, classes) or is_foreign_module(base, foreign):
                continue
            assert node.end_lineno is not None
            # The comment may sit on the line above or on any line of the expression.
            lines = range(node.lineno - 1, node.end_lineno + 1)
            marked = any(PRIVATE_MARK in comments_of(file).get(n, "") for n in lines)
            expr = ast.unparse(node)
            expr = expr if len(expr) <= 60 else "..." + expr[-57:]
            text = file.lines[node.lineno - 1].strip()
            out.append(PrivateRead(file.rel, node.lineno, expr, text, marked))
    return tuple(sorted(out, key=lambda r: (r.rel, r.line)))


def test_private_reads_are_few() -> None:
    reads = private_reads()
    assert len(reads) <= MAX_PRIVATE_READS, (
        f"{len(reads)} reads of another object's private attribute (x._name, x not self/"
        f"cls/super()/a third-party module); at most {MAX_PRIVATE_READS} are allowed in "
        "src/plait. Make the name public or give its owner a method:\n  "
        + "\n  ".join(str(r) for r in reads)
    )


def test_private_reads_are_explained() -> None:
    unmarked = [r for r in private_reads() if not r.marked]
    assert not unmarked, (
        f"{len(unmarked)} reads of another object's private attribute without a "
        f"'# {PRIVATE_MARK} <why>' comment on the same line or the line above:\n  "
        + "\n  ".join(str(r) for r in unmarked)
    )
