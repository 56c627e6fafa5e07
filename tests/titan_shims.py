"""torchtitan 0.3 on CPU with gloo, for the tests: three shims, nothing else changed.

1. ``torchtitan.distributed.minimal_async_ep.kernels`` imports triton (GPU kernels of expert
   parallelism), which a CPU install lacks; ``torchtitan.trainer`` imports it through the model
   modules. It is replaced by a module whose kernels say so when called.
2. ``torchtitan.tools.utils.device_type`` falls back to ``cuda`` without a GPU, and modules copy
   it when imported; the mesh-building ones are told ``cpu``.
3. ``ParallelDims.build_mesh`` gives size-1 dims torch's ``fake`` process-group backend, which is
   registered by importing torch's fake process group.
"""

from __future__ import annotations

import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def _no_triton(*_args, **_kwargs):
    raise RuntimeError("expert-parallel kernels need triton, which this CPU test install lacks")


def install() -> None:
    """Make torchtitan importable and its meshes buildable on CPU (idempotent)."""
    if KERNELS not in sys.modules:
        stub = types.ModuleType(KERNELS)
        for name in KERNEL_NAMES:
            setattr(stub, name, _no_triton)
        sys.modules[KERNELS] = stub
    import torch
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils

    for module in (utils, parallel_dims, dist_utils):
        module.device_type = "cpu"
    utils.device_module = dist_utils.device_module = torch.cpu
