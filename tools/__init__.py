"""Command-line tools of the repository.

Importing this package makes the repository root importable as the package `dspark`: the remote-code
files at the root import each other relatively (as the Hub's remote-code loader requires), so they are
used from tools, tests and benchmarks as `dspark.modeling_dspark`, `dspark.generation_utils`, ...
"""

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

if "dspark" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "dspark", REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
    )
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["dspark"] = _package
    _spec.loader.exec_module(_package)
