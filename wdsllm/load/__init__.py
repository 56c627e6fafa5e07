"""The loader: shards -> catalog -> plan -> read -> stream -> batching -> collate -> loader.

Nothing here is imported by ``import wdsllm``; ``wdsllm.dataset`` and ``wdsllm.loader`` import the
faces (``dataset``, ``loader``) when first used. The core (catalog, plan, stream, batching, counts,
stats) never imports torch.
"""
