"""``python -m wdsllm.cli``: the ``wdsllm`` command."""

from .app import main

main()
