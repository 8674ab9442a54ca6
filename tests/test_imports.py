"""The import graph of warploop/, read from the source (top-level and function-level imports alike):
no cycles, and every import goes down the layers

    target, config -> driver -> bundle, runtime -> std -> llm -> bench, commands, cli

(a module may import its own layer or any layer below it). Run as a script it prints the graph's
cycles and upward edges."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "warploop"
LAYERS = [("warploop", "warploop.target", "warploop.config"), ("warploop.driver",),
          ("warploop.bundle", "warploop.runtime"), ("warploop.std",), ("warploop.llm",),
          ("warploop.bench", "warploop.commands", "warploop.cli")]
# Upward imports allowed for now (none: an exception gets a line saying why)
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The warploop modules `name` imports anywhere in its file (a `from a import b` names a.b when
    that is a module, else a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == "warploop" or t.startswith("warploop."))
    found.discard(name)
    return {t for t in found if t in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    best = (-1, -1)     # (length of the matching prefix, its layer): the longest prefix decides
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), i)
    assert best[1] >= 0, f"{name}: in no layer"
    return best[1]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in g.items() for b in deps
                  if layer(b) > layer(a) and (a, b) not in KNOWN_UPWARD)


def test_the_graph_sees_function_level_and_relative_imports():
    g = graph()
    assert "warploop.runtime" in g["warploop.llm.engine"] or any(
        d.startswith("warploop.runtime") for d in g["warploop.llm.mk.backend"])
    assert len(g) > 100


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_imports_go_down_the_layers():
    assert upward(graph()) == []


def test_known_upward_imports_still_exist():
    """An exception that no longer happens leaves the list."""
    g = graph()
    assert all(b in g[a] for a, b in KNOWN_UPWARD)


if __name__ == "__main__":
    g = graph()
    print("modules", len(g), "edges", sum(map(len, g.values())))
    for c in cycles(g):
        print("cycle:", " ".join(c))
    for a, b in upward(g):
        print(f"upward: {a} -> {b}")
