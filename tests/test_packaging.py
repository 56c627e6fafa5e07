"""Packaging (issue #17): a LICENSE, torch in an extra (a packing host installs none, and the
loader says how to get it), typed keyword arguments on loader() and dataset()."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from importlib import metadata

from pack_helpers import GPT2, REPO, SHAKESPEARE

import wdsllm
from wdsllm.load.config import Config
from wdsllm.load.loader import Loader


def _names(requirements: list[str]) -> set[str]:
    """The package names of requirement strings ("torch>=2.1; extra == 'torch'" -> "torch")."""
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_torch_is_an_extra_and_the_license_is_apache():
    """What pip sees: the installed distribution's requirements, by extra."""
    requires = metadata.requires("wdsllm") or []
    core = [r for r in requires if "extra ==" not in r]
    extra = [r for r in requires if 'extra == "torch"' in r]
    assert "torch" not in _names(core) and "webdataset" not in _names(core)
    assert {"torch", "webdataset"} <= _names(extra)
    assert metadata.metadata("wdsllm")["License"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


BLOCK = "import sys\nsys.modules['torch'] = None\nsys.modules['webdataset'] = None\n"


def test_a_packing_host_without_torch_packs_and_the_loader_says_what_to_install(tmp_path):
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:5000])
    args = ["pack", str(text), "-o", str(tmp_path / "ds"), "-t", str(GPT2), "-j", "1", "-q"]
    code = BLOCK + (
        "from wdsllm.cli import main\n"
        f"try:\n    main({args!r})\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert sys.modules['torch'] is None\n"
    )
    packed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert packed.returncode == 0, packed.stderr
    assert (tmp_path / "ds" / "index.json").exists()
    code = BLOCK + (
        "import wdsllm\n"
        "for name in ('loader', 'dataset'):\n"
        "    try:\n        getattr(wdsllm, name)\n    except wdsllm.MissingDependencyError as e:\n        print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pip install 'wdsllm[torch]'") == 2


def test_loader_and_dataset_take_typed_keyword_arguments():
    options = {f.name for f in dataclasses.fields(Config)}
    for fn in (wdsllm.loader, wdsllm.dataset, Loader.__init__):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        assert not [p for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)], fn
        assert all(p.annotation is not inspect.Parameter.empty for p in params), fn
        assert options <= {p.name for p in params}, options - {p.name for p in params}
    loader_params = [p for p in inspect.signature(Loader.__init__).parameters.values() if p.name != "self"]
    # the faces add the raw-text options (#15), which they consume before the Loader is built
    from wdsllm.load.raw import RAW_OPTIONS

    face = [p for p in inspect.signature(wdsllm.loader).parameters.values() if p.name not in RAW_OPTIONS]
    assert face == loader_params
    for fn in (wdsllm.loader, wdsllm.dataset):
        assert set(RAW_OPTIONS) <= set(inspect.signature(fn).parameters), fn
