"""``python -m wdsllm``: the ``wdsllm`` command."""

from .cli import main

main()
