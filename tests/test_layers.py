"""The package keeps its shape: each part imports only the parts below it, and no modules import each other in a
circle. Read from the source (every import statement, those inside functions included), nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "twinplane"

# Bottom to top: a module may import its own part and the parts on lower lines, never one on its own line or above.
# The package's face (twinplane/__init__.py: the version and the public names) is no part: anything may import it.
LAYERS = [
    "errors",
    "platform",
    "tokenizer sandbox algos",
    "model",
    "rewards",
    "config",
    "data",
    "rollout train",
    "serving",
    "agents",
    "cluster",
    "producer",
    "controller",
    "run",
    "tools",
    "cli",
]
RANK = {part: rank for rank, line in enumerate(LAYERS) for part in line.split()}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def type_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:` (annotations only: they load nothing at run time)."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and isinstance(block.test, ast.Name)
            and block.test.id == "TYPE_CHECKING" for stmt in block.body for node in ast.walk(stmt)}


def imported_modules(path: Path, annotations: bool = True) -> list[tuple[int, str]]:
    """(line, module) for each twinplane module the file imports; `from M import name` counts as M.name when that
    is a module of its own. `annotations=False` leaves out the imports made for type checking only."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if annotations else type_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else node.module))
    return [(line, name) for line, name in found if name == "twinplane" or name.startswith("twinplane.")]


def part(module: str) -> str | None:
    """`twinplane.rollout.engine` -> "rollout"; None for the package's face."""
    return module.split(".")[1] if "." in module else None


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_part_has_a_layer():
    parts = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" and p.stem != "__init__"} | \
            {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert parts == set(RANK)


def test_layer_order():
    upward = []
    for name, path in modules().items():
        own = part(name)
        for line, target in imported_modules(path):
            other = part(target)
            if own is not None and other is not None and other != own and RANK[other] >= RANK[own]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target}")
    assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


def test_no_import_circles():
    """No circle of imports that run (a family's blocks may name ModelConfig in their annotations)."""
    graph = {name: sorted({t for _, t in imported_modules(path, annotations=False) if t != name})
             for name, path in modules().items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> list[str] | None:
        """The first circle reachable from `name`, as the modules along it."""
        if name in trail:
            return trail[trail.index(name):] + [name]
        if name in done:
            return None
        for target in graph.get(name, []):
            circle = visit(target, trail + [name])
            if circle:
                return circle
        done.add(name)
        return None

    for name in graph:
        circle = visit(name, [])
        assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_controller_reaches_the_algorithms_through_their_seam():
    """Algorithm-specific steps are `algos.Algorithm` methods: the controller imports `twinplane.algos` alone."""
    algos = {target for _, target in imported_modules(PACKAGE / "controller.py") if part(target) == "algos"}
    assert algos == {"twinplane.algos"}
