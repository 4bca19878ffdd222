"""The map's layering, read from the code's own imports: no import circles, and every import inside
`tgserve.server` points down its layers.

Every import counts, at module level or inside a function, under `TYPE_CHECKING` or not: a circle
hidden behind a function-level import is still a circle (the code on each side needs the other).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("server", "router", "kernels")
# tgserve.server's packages, lowest first: a module may import from its own package and from the
# packages before it, never from one after it. docs/STRUCTURE.md gives each one's contents.
SERVER_LAYERS = (
    "protocol",  # SamplingParams, RequestOutput, EngineStats, the ZMQ messages: the router's contract
    "config",  # EngineArgs, SchedulerConfig, BucketConfig
    "core",  # scheduler, block manager, requests, step timing (no torch)
    "device",  # device and dtype selection, host-device copies, the Habana boundary
    "distributed",  # the tensor-parallel group
    "kv_cache",  # KVCacheSpec per layer, the paged pool
    "attention",  # metadata, backends and their registry, the forward context
    "loading",  # model source, config, tokenizer, GGUF, quantized formats, transformers shims
    "models",  # native families, the transformers fallback, the registry, load_model
    "sampling",  # the sampler
    "execution",  # the runner, step inputs, executors (eager, CUDA graphs), memory profile
    "static_shapes",  # buckets, padding, the static-shape executor
    "optimum_habana",  # the Gaudi fallback engine
    "engine",  # LLMEngine, Engine, shards and workers, the engine process, LLM, `tgserve generate`
    "testing",  # fixtures and stand-ins for tests; nothing above imports it
)
# Modules of the attention backends: what model code must never reach (it sees the forward context).
BACKEND_MODULES = (
    "tgserve.server.attention.cpu",
    "tgserve.server.attention.cuda",
    "tgserve.server.attention.hpu",
    "tgserve.server.attention.registry",
    "tgserve.server.device.habana",
)


def module_name(path: Path) -> str:
    parts = ("tgserve", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the package that ships (tests and benchmark scripts left out)."""
    modules = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not {"tests", "bench"} & set(path.relative_to(ROOT).parts):
                modules[module_name(path)] = path
    return modules


def imported_names(path: Path, name: str) -> Iterator[str]:
    """The absolute names of everything the module imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package import counts as its `__init__`)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        targets = {target for target in imported_names(path, name) if target in modules}
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def server_layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["tgserve", "server"] else None


def back_up_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a server package to one above it in SERVER_LAYERS, and packages outside them."""
    wrong = []
    for source, targets in sorted(graph.items()):
        source_layer = server_layer(source)
        if source_layer is None:
            continue
        if source_layer not in SERVER_LAYERS:
            wrong.append(f"{source}: package {source_layer!r} is not in SERVER_LAYERS")
            continue
        for target in sorted(targets):
            target_layer = server_layer(target)
            if target_layer in SERVER_LAYERS and SERVER_LAYERS.index(target_layer) > SERVER_LAYERS.index(
                source_layer
            ):
                wrong.append(f"{source} -> {target} ({source_layer} is below {target_layer})")
    return wrong


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_server_imports_point_down_its_layers() -> None:
    wrong = back_up_imports(import_graph())
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_every_server_module_sits_in_a_layer() -> None:
    loose = sorted(p.name for p in (ROOT / "server").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside server's packages: {loose}; each belongs in one of {SERVER_LAYERS}"
    packages = sorted(p.name for p in (ROOT / "server").iterdir() if (p / "__init__.py").is_file())
    assert set(packages) - {"tests"} == set(SERVER_LAYERS)


def test_the_sides_of_the_project_import_only_downward() -> None:
    """kernels never import the engine or the router; the engine never imports the router; the
    router reaches the engine through `tgserve.server.protocol` (and its offline benchmark)."""
    wrong = []
    for source, targets in import_graph().items():
        for target in targets:
            if source.startswith("tgserve.kernels") and target.startswith(
                ("tgserve.server", "tgserve.router")
            ):
                wrong.append(f"{source} -> {target}")
            if source.startswith("tgserve.server") and target.startswith("tgserve.router"):
                wrong.append(f"{source} -> {target}")
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_a_circle_and_a_back_up_import() -> None:
    """The graph checks themselves, on a made-up graph: they are not vacuous."""
    graph = {
        "tgserve.server.core.a": {"tgserve.server.engine.b"},
        "tgserve.server.engine.b": {"tgserve.server.core.a"},
    }
    assert circles(graph) == [["tgserve.server.core.a", "tgserve.server.engine.b"]]
    assert back_up_imports(graph) == [
        "tgserve.server.core.a -> tgserve.server.engine.b (core is below engine)"
    ]


def run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_model_code_reaches_no_attention_backend() -> None:
    """Models see the forward context, never a backend: importing every model module (native and
    fallback, in a fresh interpreter) loads no backend module, and no models module names one."""
    models = sorted(name for name in project_modules() if name.startswith("tgserve.server.models"))
    graph = import_graph()
    for name in models:
        named = graph[name] & set(BACKEND_MODULES)
        assert not named, f"{name} imports {sorted(named)}"
    code = f"""
import importlib, sys
for name in {models!r}:
    importlib.import_module(name)
loaded = sorted(set(sys.modules) & set({BACKEND_MODULES!r}))
assert not loaded, f"importing the models loaded {{loaded}}"
"""
    result = run_fresh(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "package", ["tgserve.server.protocol", "tgserve.server.core", "tgserve.server.config"]
)
def test_the_packages_the_router_and_the_scheduler_use_import_no_torch(package: str) -> None:
    modules = sorted(name for name in project_modules() if name.startswith(package))
    code = f"""
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
assert 'torch' not in sys.modules, 'torch was imported'
"""
    result = run_fresh(code)
    assert result.returncode == 0, result.stderr


def reads_environment(path: Path) -> bool:
    """`os.environ` or `os.getenv` anywhere in the module."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                return True
    return False


def test_only_the_command_line_reads_the_environment():
    """Configuration is read once, by the CLI (`tgserve serve`'s flags and `tgserve generate`'s),
    and passed on as frozen configuration: no engine, kernel or route reads a variable itself."""
    readers = sorted(name for name, path in project_modules().items() if reads_environment(path))
    assert readers == ["tgserve.router.serve_args", "tgserve.server.engine.cli_generate"]
