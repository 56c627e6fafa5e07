"""The cluster engines are extras: neither the CLI, the packer nor the loader imports them."""

from __future__ import annotations

import subprocess
import sys

ENGINES = ("ray", "datatrove")


def test_cli_packer_and_loader_import_neither_ray_nor_datatrove():
    code = (
        "import sys\n"
        "import wdsllm, wdsllm.cli, wdsllm.pack.part, wdsllm.pack.merge, wdsllm.load.loader\n"
        "from wdsllm.cli import main\n"
        "sys.argv = ['wdsllm', 'merge', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "wdsllm.loader\n"
        f"found = [m for m in {ENGINES!r} if m in sys.modules]\n"
        "assert not found, f'imported {found}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
