"""The map's promise for the router process: none of its modules imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[1]


def router_modules() -> list[str]:
    names = []
    for path in sorted(ROUTER.rglob("*.py")):
        parts = path.relative_to(ROUTER).with_suffix("").parts
        if "tests" in parts:
            continue
        names.append(".".join(("tgserve", "router", *(p for p in parts if p != "__init__"))))
    return names


def test_importing_every_router_module_imports_no_torch():
    """In a fresh interpreter (this one has torch loaded by other tests): every module the router
    process can load, the app, the launcher and the load generator included."""
    modules = router_modules()
    assert "tgserve.router.app" in modules and len(modules) > 20
    code = f"""
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
torch_modules = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not torch_modules, f"torch imported: {{torch_modules[:5]}}"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
