"""The import graph: layers only import downward, and no module imports itself through others.

Layers, lowest first: configs -> sharding -> model -> pipeline -> training -> cli -> tools ->
bench -> train. Every import counts, including those inside functions (the lazy ones too):
a lazy upward import is still a dependency the reader has to hold in mind.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["configs", "sharding", "model", "pipeline", "training", "cli", "tools", "bench", "train"]


def modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in LAYERS:
        for p in (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else ():
            parts = p.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (the longest known prefix of each imported name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                found.add(".".join(parts[:n]))
                break
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_every_import_points_down_the_layers():
    layer = {m: LAYERS.index(m.split(".")[0]) for m in modules()}
    upward = [f"{m} imports {d}" for m, deps in graph().items() for d in deps if layer[d] > layer[m]]
    assert not upward, upward


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
