"""The house's shape: every module imports on its own, no import cycles (module-level or inside functions,
packages' __init__ included), the model never reaches into an attention backend, nothing crosses a private name."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "server", "benchmarks", "tools", "pagedserve")  # folders; installed as pagedserve.<folder>


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join(parts if pkg == "pagedserve" else ("pagedserve", *parts))] = path
    return out


def _imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """Every project module `module` imports, anywhere in the file, except under `if TYPE_CHECKING:`. Importing
    a.b.c runs a and a.b first, so those count too."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in node.body for n in ast.walk(sub)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                               else []))
            names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    out = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != module:
                out.add(prefix)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    # a package's own __init__ is run by importing any of its modules: not an edge back to it
    return {m: {d for d in _imports(p, m, known) if not m.startswith(d + ".")} for m, p in known.items()}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_layers_point_one_way():
    graph = _graph()
    e, s, b, t = "pagedserve.engine", "pagedserve.server", "pagedserve.benchmarks", "pagedserve.tools"
    model_deps = graph[f"{e}.models.llama"]
    assert not any(d.startswith(f"{e}.attention.") and d != f"{e}.attention.base" for d in model_deps), \
        "the model imports a backend's internals"
    for m, deps in graph.items():
        if m.startswith(e):
            assert not any(d.startswith((s, b, t)) for d in deps), (m, deps)
        if m.startswith(s):  # `pagedserve bench` is the load tester
            assert not any(d.startswith(b) for d in deps - {b, f"{b}.serve"}), (m, deps)


def test_every_module_imports_in_a_fresh_interpreter():
    # __main__ runs the CLI; the Ray modules need the optional extra (the Ray tier imports them), as does the
    # OpenTelemetry one (the test extra installs it)
    skip = {"pagedserve.server.__main__", *RAY_MODULES}
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        skip.add(OTEL_MODULE)
    mods = sorted(m for m in _modules() if m not in skip)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code, *mods], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


RAY_MODULES = ("pagedserve.server.ray_app", "pagedserve.server.ray_router")


def test_ray_is_imported_only_by_the_ray_modules():
    """Without --replicas nothing loads Ray: the server, the CLI and every other module import without it."""
    mods = sorted(m for m in _modules() if m not in ("pagedserve.server.__main__", *RAY_MODULES))
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "from pagedserve.server.cli import main\n"
            "print('ray' in sys.modules or any(k.startswith('ray.') for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *mods], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("False"), out.stderr[-3000:]
    for m in RAY_MODULES:
        assert "ray" in ast.unparse(ast.parse(_modules()[m].read_text()))  # these, and only these, may


OTEL_MODULE = "pagedserve.server.otel"


def test_opentelemetry_is_imported_only_by_the_otel_module():
    """Without --otlp-traces-endpoint the server never loads the OpenTelemetry SDK or exporter: every other module
    imports, and an app is built, without them. (FastAPI itself may import the OpenTelemetry API: newer releases
    depend on it.)"""
    mods = sorted(m for m in _modules() if m not in ("pagedserve.server.__main__", OTEL_MODULE, *RAY_MODULES))
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "from pagedserve.server.app import ServerConfig, create_app\n"
            "create_app(lambda: None, ServerConfig('m'))\n"
            "print(sorted({k for k in sys.modules if k.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))}))")
    out = subprocess.run([sys.executable, "-c", code, *mods], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("[]"), (out.stdout[-3000:], out.stderr[-3000:])
    users = [m for m, p in _modules().items() if "opentelemetry" in {n.split(".")[0] for n in _imported_names(p)}]
    assert users == [OTEL_MODULE]


def _imported_names(path: Path) -> set[str]:
    return {a.name if isinstance(node, ast.Import) else node.module or "" for node in ast.walk(ast.parse(
        path.read_text())) if isinstance(node, ast.Import | ast.ImportFrom) for a in node.names}


def test_no_private_names_cross_modules():
    known = _modules()
    crossing = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedserve"):
                crossing += [f"{module}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []
