"""Packaging (issue #17): a LICENSE, torch in an extra (a packing host installs none, and the
loader says how to get it), typed keyword arguments on loader() and dataset()."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from importlib import metadata

import pytest
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


def test_loader_and_dataset_take_typed_records():
    """Every option is a typed field of one record; the faces take the records whole (typed
    keywords) or their fields as keywords, and refuse any other keyword by name."""
    from wdsllm.load.options import FACE_RECORDS

    names = [f.name for record in FACE_RECORDS for f in dataclasses.fields(record)]
    assert len(names) == len(set(names)), "an option declared in two records"
    assert {f.name for f in dataclasses.fields(Config)} <= set(names)
    for record in FACE_RECORDS:
        assert all(f.type not in (None, "Any") for f in dataclasses.fields(record)), record
    for fn in (wdsllm.loader, wdsllm.dataset, Loader.__init__):
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        assert all(p.annotation is not inspect.Parameter.empty for p in params), fn
        typed = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        assert {"order", "batch", "reading", "layout"} <= typed, fn
    with pytest.raises(wdsllm.ConfigError, match="batch_size"):
        wdsllm.loader("/nonexistent", batch_sise=4)
