"""The layout holds: the packer and the loader share only the format, storage and the input readers
(``inputs/``, which imports neither), the packing side and the loader's core never import torch,
and every error derives from WdsllmError."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import wdsllm
from wdsllm import errors

PACKAGE = Path(wdsllm.__file__).parent


def _imports(path: Path) -> set[str]:
    """The wdsllm modules a source file imports (relative imports resolved), at any depth."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]  # the package a relative import starts from (for __init__ too)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join(base + tuple((node.module or "").split("."))).strip(".")
            names = [module] + [f"{module}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith("wdsllm"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("wdsllm"))
    return out


@pytest.mark.parametrize(
    ("room", "never"),
    [
        ("pack", "wdsllm.load"),
        ("load", "wdsllm.pack"),
        ("inputs", "wdsllm.load"),
        ("inputs", "wdsllm.pack"),
        ("inputs", "wdsllm.integrations"),
        ("format", "wdsllm.load"),
        ("format", "wdsllm.pack"),
        ("storage", "wdsllm.load"),
        ("storage", "wdsllm.pack"),
        ("pack", "wdsllm.integrations"),
        ("load", "wdsllm.integrations"),
        ("format", "wdsllm.integrations"),
        ("storage", "wdsllm.integrations"),
    ],
)
def test_rooms_import_only_what_the_layout_allows(room, never):
    for path in sorted((PACKAGE / room).glob("*.py")):
        wrong = sorted(i for i in _imports(path) if i == never or i.startswith(never + "."))
        assert not wrong, f"{path.relative_to(PACKAGE)} imports {wrong}"


@pytest.mark.parametrize(
    "code",
    [
        "from wdsllm.cli import main\nsys.argv = ['wdsllm', 'pack', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass",
        "import wdsllm.pack.job, wdsllm.pack.merge, wdsllm.format.verify, wdsllm.format.head",
        "import wdsllm.inputs.sources, wdsllm.inputs.tasks, wdsllm.inputs.tokenizer, wdsllm.inputs.text",
        "import wdsllm.load.raw, wdsllm.load.rawread, wdsllm.load.rawcount",
        "import wdsllm.load.stats, wdsllm.load.counts, wdsllm.load.sources.open, wdsllm.load.state",
        "import wdsllm.integrations\nassert wdsllm.integrations.model_inputs({'epoch': 0}) == {}",
    ],
)
def test_packing_and_stats_start_without_torch(code):
    check = f"import sys\n{code}\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_error_class_derives_from_the_root():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, Exception)]
    assert len(classes) >= 10
    assert all(issubclass(c, errors.WdsllmError) for c in classes)
    for path in PACKAGE.rglob("*.py"):  # and no module defines an exception class of its own
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases
            ):
                assert path.name == "errors.py", f"{path.relative_to(PACKAGE)} defines {node.name}"


def test_on_error_takes_the_same_words_everywhere():
    from wdsllm.load.config import read_options
    from wdsllm.pack.job import PackConfig

    assert read_options(None, None, 0, "skip").on_error == "skip"
    assert PackConfig(inputs=[], output="o", tokenizer="t", on_error="skip").on_error == "skip"
    with pytest.warns(DeprecationWarning, match="'raise'"):
        assert PackConfig(inputs=[], output="o", tokenizer="t", on_error="stop").on_error == "raise"
    for bad in ("ignore", "stop!"):
        with pytest.raises(errors.ConfigError, match="on_error"):
            read_options(None, None, 0, bad)
