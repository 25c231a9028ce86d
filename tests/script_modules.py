"""The repository's scripts (benchmarks/, examples/) as modules, for the tests that call their
functions: a helper in tests/, not part of the installed package."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str) -> ModuleType:
    """Run the script at `path` (absolute, or relative to the repository root) as module `name`,
    registered in sys.modules before it runs: its dataclasses look their module up while they
    are made."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
