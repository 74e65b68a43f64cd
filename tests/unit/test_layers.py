"""The package's layers stay true: a module imports only from its own layer or below.

Read from the source with `ast` (every import, also those inside functions and under
TYPE_CHECKING), so a lazy import cannot hide a dependency on a higher layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trainckpt

PACKAGE = Path(trainckpt.__file__).parent

# Bottom to top. A module's layer is the first entry its dotted name (inside `trainckpt`) starts
# with; the package root (`__init__`), the public facade, is above everything it re-exports.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "identity", "testing", "version"),
    ("storage",),
    ("format",),
    ("core",),
    ("local",),  # the node-local tier, on top of the commit machinery
    ("retention",),
    (
        "checkpointer",
        "config",
        "saving",  # the Checkpointer's mix-ins: save path, save thread, rollback, finders
        "background_saves",
        "rollback",
        "finders",
        "manager",
        "save_events",  # the checkpoint events the manager logs
        "train_module",
        "plain_state",  # train_module's plain walk of model and optimizer state
        "model_states",
    ),
    ("cli", "integrations", "olmo", "__main__"),  # olmo: a deprecated alias of integrations
    ("",),  # the package root
]


def layer_of(module: str) -> int:
    head = module.split(".")[0] if module else ""
    for rank, names in enumerate(LAYERS):
        if head in names:
            return rank
    raise AssertionError(f"trainckpt.{module} is in no layer: add it to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module inside trainckpt) of every import of the package in `path`."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainckpt")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
                found.append((node.lineno, "trainckpt." + module if module else "trainckpt"))
            elif node.module and node.module.split(".")[0] == "trainckpt":
                # `from trainckpt.format import layout` imports trainckpt.format.layout
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, m.removeprefix("trainckpt").lstrip(".")) for line, m in found]


SOURCES = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")])  # .pyi: a compiled module


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p) or "__init__")
def test_module_imports_only_its_layer_or_below(path: Path) -> None:
    own = layer_of(module_name(path))
    upward = [
        f"line {line}: imports trainckpt.{target} (layer {layer_of(target)} > {own})"
        for line, target in imported_modules(path)
        if target and layer_of(target) > own
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} imports from a higher layer:\n" + "\n".join(
        upward
    )


def test_every_module_has_a_layer() -> None:
    for path in SOURCES:
        layer_of(module_name(path))
    assert len(SOURCES) > 40  # the scan found the package


def test_no_import_circle() -> None:
    """No two modules import each other, directly or around a circle (imports inside
    functions and under TYPE_CHECKING count too)."""
    names = {module_name(p) for p in SOURCES}

    def owner(target: str) -> str:
        while target and target not in names:  # `format.layout.X` is module `format.layout`
            target = target.rpartition(".")[0]
        return target

    graph = {
        module_name(p): {owner(t) for _, t in imported_modules(p)} - {"", module_name(p)}
        for p in SOURCES
    }
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(trail[trail.index(module) :] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
