"""The layout's rules, read from the source (README "Layout"): no import cycles, the running
gateway imports nothing from loadtest/, the shipped packages import nothing from tests/,
and the policies see the gateway only through gateway/overflow.py: the roles it declares
and the values it names, besides the vocabulary every part shares."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "policies", "loadtest")
# What a policy may import from the gateway besides gateway/overflow.py: the config, errors,
# outcomes, clock and request record every part shares, and the one circuit breaker the
# provider's gate and the rate limiter use. The values overflow.py names from elsewhere
# (what was served, a target, an answer's usage) a policy imports from overflow.py.
VOCABULARY = {
    "gateway.config",
    "gateway.errors",
    "gateway.outcome",
    "gateway.clock",
    "gateway.breaker",
    "gateway.request",
}


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, *, types: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module runs, at its top or inside its functions; those under
    `if TYPE_CHECKING:`, which only name types for the checker, with `types`."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child) and not types:
            for node in child.orelse:
                yield from imports(ast.Module(body=[node], type_ignores=[]))
        elif isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        else:
            yield from imports(child, types=types)


def import_graph(*, types: bool = False) -> dict[str, set[str]]:
    """Module → the modules of gateway, policies and loadtest it imports (`types`: also
    those it imports only to name types)."""
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str | None] = set()
        for node in imports(ast.parse(path.read_text(), filename=str(path)), types=types):
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
                continue
            assert node.level == 0, f"{module}: relative import (the graph reads absolute ones)"
            base = node.module or ""
            for alias in node.names:
                name = f"{base}.{alias.name}"  # a module imported from its package
                targets.add(name if name in files else known(base))
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_that_matter() -> None:
    graph = import_graph()
    assert "gateway.front.pipeline" in graph["gateway.app"]
    assert "gateway.app" in graph["gateway.workers"]
    assert "gateway.capacity.charts" in graph["gateway.capacity.render"], "a function's import"
    assert "policies.queue.fair_queue" in graph["policies.queue.policy"]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycles_even_through_the_names_of_types() -> None:
    graph = import_graph(types=True)
    assert "gateway.front.exchange" in graph["gateway.front.trace"], "a type-only import"
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_running_gateway_imports_nothing_from_loadtest() -> None:
    code = (
        "import sys, gateway.app, gateway.serve, gateway.workers; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('loadtest', 'tests')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_shipped_packages_import_nothing_from_tests() -> None:
    for module, path in module_files().items():
        for node in imports(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all((name or "").split(".")[0] != "tests" for name in names), module


def test_gateway_modules_import_nothing_from_loadtest() -> None:
    graph = import_graph()
    reaching = {m: ts for m, ts in graph.items() if m.startswith("gateway")}
    assert not {m for m, ts in reaching.items() if any(t.startswith("loadtest") for t in ts)}


def past_overflow(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each policy module → the gateway's modules it imports other than gateway/overflow.py
    and the shared vocabulary."""
    allowed = {"gateway.overflow", *VOCABULARY}
    return {
        module: outside
        for module, targets in graph.items()
        if module.startswith("policies")
        and (outside := {t for t in targets if t.startswith("gateway")} - allowed)
    }


def test_policies_see_the_gateway_through_overflow() -> None:
    """Even to name a type: a policy that imported gateway/upstream/ could write to the
    client or forward around the exchange; what it may do is a method of its context."""
    assert past_overflow(import_graph(types=True)) == {}


def test_a_policy_importing_the_upstream_is_found() -> None:
    graph = {
        "policies.cache.policy": {"gateway.overflow", "gateway.upstream.relay"},
        "policies.reject": {"gateway.overflow", "gateway.errors"},
        "gateway.front.exchange": {"gateway.upstream.relay"},
    }
    assert past_overflow(graph) == {"policies.cache.policy": {"gateway.upstream.relay"}}


# The gateway's rooms, lowest first (gateway/README.md "Rooms"): a module imports from its
# own room and the rooms before it, never from one after it, even to name a type. A
# prefix names a module or a whole folder, and no folder is split between rooms, so the
# folders show which way the arrows run.
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "gateway.config",
            "gateway.errors",
            "gateway.outcome",
            "gateway.clock",
            "gateway.sweep",
            "gateway.tasks",
            "gateway.breaker",
            "gateway.metrics",
            "gateway.request",
            "gateway.slo",
        ),
    ),
    ("clients", ("gateway.redis_io", "gateway.upstream")),
    ("state", ("gateway.ratelimit", "gateway.admission", "gateway.capacity")),
    ("overflow", ("gateway.overflow",)),
    ("feeds", ("gateway.shared",)),
    ("policies", ("policies",)),
    ("front", ("gateway.front",)),
    ("services", ("gateway.batch", "gateway.ops")),
    (
        "composition",
        (
            *("gateway.app", "gateway.shared_mode", "gateway.workers", "gateway.serve"),
            *("gateway.cli", "gateway.cli_docs"),
        ),
    ),
]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(ROOMS):
        if any(_within(module, p) for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no room: add it to ROOMS and gateway/README.md")


def test_no_folder_is_split_between_rooms() -> None:
    """A room holds whole folders: were a folder's files in two rooms (the Redis batcher
    once sat in gateway/shared/ below the ledger, the feeds beside it above), the
    folders would show arrows running both ways between them."""
    placed = [(room, p) for room, (_, prefixes) in enumerate(ROOMS) for p in prefixes]
    split = sorted(
        f"{inner} ({ROOMS[r][0]}) within {outer} ({ROOMS[s][0]})"
        for r, inner in placed
        for s, outer in placed
        if r != s and _within(inner, outer)
    )
    assert split == []


def test_every_gateway_module_is_in_a_room() -> None:
    for module in module_files():
        if module.split(".")[0] in ("gateway", "policies") and module != "gateway":
            room_of(module)


def test_imports_run_down_the_rooms_only() -> None:
    upward = sorted(
        f"{module} ({ROOMS[room_of(module)][0]}) imports {target} ({ROOMS[room_of(target)][0]})"
        for module, targets in import_graph(types=True).items()
        if module.split(".")[0] in ("gateway", "policies") and module != "gateway"
        for target in targets
        if target.split(".")[0] in ("gateway", "policies")
        and target != "gateway"
        and room_of(target) > room_of(module)
    )
    assert upward == []


def test_an_upward_import_is_found() -> None:
    assert room_of("gateway.front.pipeline") > room_of("gateway.admission.routing.router")
    assert room_of("gateway.redis_io.batch") < room_of("gateway.ratelimit.redis_limiter")
    # the ledger uses the Redis client below it, never the feeds that share its figures
    assert room_of("gateway.redis_io.batch") < room_of("gateway.admission.ledger.shared")
    assert room_of("gateway.shared.ledger_feed") > room_of("gateway.admission.ledger.shared")
    assert room_of("gateway.shared.service_feed") > room_of("gateway.overflow")


def test_the_tests_mirror_the_packages() -> None:
    """tests/unit/ and tests/integration/ hold their tests in the folders of the source
    they test (tests/unit/gateway/admission/ tests gateway/admission/); only tests of the
    whole layout sit at the top."""
    astray = []
    for kind in ("unit", "integration"):
        base = ROOT / "tests" / kind
        for test in base.rglob("test_*.py"):
            folder = test.parent.relative_to(base)
            at_top = folder == Path(".")
            if (at_top and kind == "integration") or not (ROOT / folder).is_dir():
                astray.append(str(test.relative_to(ROOT)))
    assert astray == []
