"""The package's modules import one another without a circle, lazy (in-function) imports included."""

import ast
from pathlib import Path

import stem_upcycle

PACKAGE = Path(stem_upcycle.__file__).parent


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every `from . import` and `import stem_upcycle...`)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("stem_upcycle", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
                found |= {m for m in (base, *(f"{base}.{a.name}" for a in node.names)) if m in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def test_no_module_imports_back_into_a_module_that_imports_it():
    graph = _import_graph()
    assert "stem_upcycle.loading" in graph and graph["stem_upcycle.convert"]  # the graph was read

    def reaches(start, goal, seen):
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen)) for m in graph[start])

    circles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a, set()))
    assert circles == [], f"import circles through these imports: {circles}"


def test_every_module_of_the_modeling_package_is_exported_and_imports_only_torch_transformers_and_the_stdlib():
    """What `convert` copies next to the weights is the whole modeling package, and it runs where stem-upcycle is
    not installed (tests/test_remote_code.py loads it so)."""
    import sys

    from stem_upcycle.convert import MODELING_DIR, MODELING_FILES

    modules = sorted(p.name for p in MODELING_DIR.glob("*.py") if p.name != "__init__.py")
    assert sorted(MODELING_FILES) == modules
    for name in modules:
        for node in ast.walk(ast.parse((MODELING_DIR / name).read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level or isinstance(node, ast.Import):
                roots = {node.module.split(".")[0]} if isinstance(node, ast.ImportFrom) else \
                    {a.name.split(".")[0] for a in node.names}
                assert roots <= {"torch", "transformers"} | sys.stdlib_module_names, (name, roots)
