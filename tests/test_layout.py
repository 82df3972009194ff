"""The import rule of mtpkit's layout (docs/design.md, "Layout"): every import points down.

Each module lies on a floor; a module may import modules of lower floors and of its own package,
never a higher floor or a sibling package of its own floor. Imports inside functions count too
(a deferred import is still a dependency). The rule is checked on the real package, and the
checker itself is checked on a planted upward import.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mtpkit"

# Bottom to top. A module's floor is that of the longest prefix naming it.
FLOORS: dict[str, int] = {
    "mtpkit.errors": 0, "mtpkit.display": 0,
    "mtpkit.shapes": 1, "mtpkit.parallel": 1, "mtpkit.config": 1,
    "mtpkit.step": 2,                                   # the data of one step
    "mtpkit.kernels": 3, "mtpkit.sampling": 3,
    "mtpkit.text": 4, "mtpkit.checkpoint": 4, "mtpkit.structured": 4,   # structured: llguidance
    "mtpkit.layers": 5,
    "mtpkit.models": 6,
    "mtpkit.speculative": 7,
    "mtpkit.graphs": 8,
    "mtpkit.engine": 9,
    "mtpkit.llm": 10,                                   # the facade
    "mtpkit.notebook": 11, "mtpkit.serve": 11,          # the notebook view; the HTTP server
    "mtpkit.cli": 12,                                   # the command line (`mtpkit serve` starts the server)
    "mtpkit": 13,                                       # the package's own __init__ / __main__
}


def floor_of(module: str) -> tuple[str, int]:
    """(the FLOORS key naming `module`, its floor)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in FLOORS:
            return key, FLOORS[key]
    raise KeyError(f"{module} is on no floor: add its package to FLOORS in tests/test_layout.py")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every mtpkit import in the file, deferred ones included."""
    mod = module_name(root, path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from mtpkit.x import y` may import the module mtpkit.x.y
            subs = [f"{target}.{a.name}" for a in node.names
                    if (root.parent / (f"{target}.{a.name}".replace(".", "/") + ".py")).exists()
                    or (root.parent / f"{target}.{a.name}".replace(".", "/") / "__init__.py").exists()]
            found += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return [(line, m) for line, m in found if m == root.name or m.startswith(root.name + ".")]


def violations(root: Path) -> list[str]:
    """Every import in the package under `root` that points up or sideways."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "assets" in path.parts:
            continue
        mod = module_name(root, path)
        key, floor = floor_of(mod)
        for line, target in imports_of(root, path):
            tkey, tfloor = floor_of(target)
            if tkey == key or mod == root.name:
                continue        # its own package; the package's __init__ may import anything
            if key.startswith(tkey + ".") and tkey == root.name:
                continue
            if tfloor >= floor:
                out.append(f"{path.relative_to(root.parent)}:{line}: {mod} (floor {floor}) imports {target} "
                           f"(floor {tfloor})")
    return out


def test_every_import_points_down():
    bad = violations(PACKAGE)
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_every_module_is_on_a_floor():
    for path in PACKAGE.rglob("*.py"):
        if "assets" not in path.parts:
            floor_of(module_name(PACKAGE, path))


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mtpkit"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("planted", [
    "from mtpkit.engine.scheduler import Scheduler\n",          # step data importing the engine
    "def f():\n    from ..engine import scheduler\n",           # a deferred, relative one
    "import mtpkit.kernels.paged\n",                            # a sibling floor above: kernels
])
def test_the_checker_fails_on_a_planted_upward_import(tmp_path, planted):
    root = _plant(tmp_path, {"__init__.py": "", "step/__init__.py": "", "step/metadata.py": planted,
                             "engine/__init__.py": "", "engine/scheduler.py": "Scheduler = 1\n",
                             "kernels/__init__.py": "", "kernels/paged.py": ""})
    bad = violations(root)
    assert len(bad) == 1 and "mtpkit.step.metadata (floor 2)" in bad[0], bad


def test_the_checker_accepts_downward_and_own_package_imports(tmp_path):
    root = _plant(tmp_path, {"__init__.py": "from mtpkit.engine import scheduler\n",
                             "step/__init__.py": "", "step/metadata.py": "from mtpkit.errors import E\n",
                             "errors.py": "E = 1\n", "engine/__init__.py": "",
                             "engine/scheduler.py": "from mtpkit.step import metadata\nfrom . import runner\n",
                             "engine/runner.py": ""})
    assert violations(root) == []
