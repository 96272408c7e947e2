"""No import cycle among the modules of any package, the imports under TYPE_CHECKING included (issue 53).

pyproject.toml's import-linter contracts leave type-only imports out (they are no dependency at run time), so its
acyclic_siblings contract alone would let a type-only import close a cycle. This test builds the same graph with
them (grimp, import-linter's graph library) and holds every package to the same rule: for each package, its
children (modules and subpackages) form no cycle, where child A depends on child B when any module in A's subtree
imports any module in B's subtree. A type that two siblings need each other for belongs below both: a Protocol or
a dataclass in the lower module, or the dependency reversed."""
from __future__ import annotations

import grimp

ROOTS = ("hybridflow", "hybridflow_operator")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOTS, exclude_type_checking_imports=False, cache_dir=None)


def _sibling_edges(graph: grimp.ImportGraph, package: str) -> dict[tuple[str, str], list[str]]:
    """(child A, child B) -> the imports ('importer -> imported (l.N)') that make A depend on B."""
    children = graph.find_children(package)
    owner = {m: child for child in children for m in {child} | graph.find_descendants(child)}
    edges: dict[tuple[str, str], list[str]] = {}
    for module, child in owner.items():
        for imported in graph.find_modules_directly_imported_by(module):
            other = owner.get(imported)
            if other is not None and other != child:
                lines = ", ".join(f"l.{d['line_number']}" for d in
                                  graph.get_import_details(importer=module, imported=imported))
                edges.setdefault((child, other), []).append(f"{module} -> {imported} ({lines})")
    return edges


def _a_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    """One cycle among the children (its nodes in order, the first repeated last), or None."""
    after: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        after.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in after.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(after):
        if start not in state and (found := visit(start)):
            return found
    return None


def sibling_cycles(graph: grimp.ImportGraph) -> list[str]:
    """A message for each package whose children import each other in a cycle: the cycle, and each step's imports."""
    out = []
    for package in sorted(m for m in graph.modules if m.split(".")[0] in ROOTS and graph.find_children(m)):
        edges = _sibling_edges(graph, package)
        cycle = _a_cycle(edges)
        if cycle:
            steps = "\n".join(f"    {a} -> {b}: " + "; ".join(edges[a, b]) for a, b in zip(cycle, cycle[1:]))
            out.append(f"{package}: {' -> '.join(cycle)}\n{steps}")
    return out


def test_no_package_has_an_import_cycle_among_its_modules_type_checking_imports_included():
    cycles = sibling_cycles(_graph())
    assert not cycles, "import cycles (TYPE_CHECKING imports included):\n" + "\n".join(cycles)


def test_the_check_finds_a_cycle_that_only_a_type_checking_import_closes():
    """The check itself: a type-only import back up (hybridflow.api.fields -> hybridflow.api.schema, which imports
    fields) is a cycle, named with its imports."""
    graph = _graph()
    graph.add_import(importer="hybridflow.api.fields", imported="hybridflow.api.schema", line_number=1,
                     line_contents="from hybridflow.api.schema import JobSpec")
    found = [c for c in sibling_cycles(graph) if c.startswith("hybridflow.api: ")]
    assert found and "hybridflow.api.fields -> hybridflow.api.schema (l.1)" in found[0], found
