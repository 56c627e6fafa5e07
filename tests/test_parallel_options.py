"""How a layout is said, and what is refused, in one process (a gloo group of one rank): a mesh
whose data-parallel dims are not named, a current mesh with the global rank, options that
contradict each other."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
from synth import write_dataset
from torch.distributed.device_mesh import init_device_mesh

import wdsllm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("opts") / "ds"
    write_dataset(root, [9, 8], max_len=20, seed=1)
    return root


@pytest.fixture(scope="module")
def one_rank():
    """A process group of this process alone (gloo on 127.0.0.1), gone after the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_mesh_with_other_dims_needs_its_dp_dims_named(data, one_rank):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(wdsllm.ConfigError, match=r"dims \('dp', 'tp'\): say which split the data"):
        wdsllm.loader(data, batch_size=2, mesh=mesh)
    with pytest.raises(wdsllm.ConfigError, match="names no dim of the mesh"):
        wdsllm.loader(data, batch_size=2, mesh=mesh, dp="data")
    with pytest.raises(wdsllm.ConfigError, match="cp='dp' must name a non-data-parallel dim"):
        wdsllm.loader(data, batch_size=2, mesh=mesh, dp="dp", cp="dp")
    ld = wdsllm.loader(data, batch_size=2, mesh=mesh, dp="dp")
    assert (ld.rank, ld.world_size) == (0, 1)
    assert ld.layout.where() == "dp=0 tp=0"
    assert sum(len(b["docs"]) for b in ld) == 17
    pipe = wdsllm.dataset(data, batch_size=2, mesh=mesh, dp="dp")  # the DP coordinates alone
    assert sum(len(b["docs"]) for b in pipe) == 17


def test_the_global_rank_is_refused_under_a_current_mesh_with_other_dims(data, one_rank):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with mesh, pytest.raises(wdsllm.ConfigError, match="pass mesh= and dp="):
        wdsllm.loader(data, batch_size=2)
    assert wdsllm.loader(data, batch_size=2).world_size == 1  # outside it, the global rank


def test_contradictory_layouts_are_refused(data):
    with pytest.raises(wdsllm.ConfigError, match="rank= and mesh= both say"):
        wdsllm.loader(data, batch_size=2, rank=0, world_size=1, mesh=object())
    with pytest.raises(wdsllm.ConfigError, match="pass mesh= as well"):
        wdsllm.loader(data, batch_size=2, dp="dp")
    with pytest.raises(wdsllm.ConfigError, match="go with dp_group="):
        wdsllm.loader(data, batch_size=2, replica_group=object())
    with pytest.raises(wdsllm.ConfigError, match="pp_stage 2 is outside pp_stages 2"):
        wdsllm.loader(data, batch_size=2, pp_stage=2, pp_stages=2)
    with pytest.raises(wdsllm.ConfigError, match="replicas must be one of"):
        wdsllm.loader(data, batch_size=2, replicas="scatter")
    with pytest.raises(wdsllm.ConfigError, match="are wdsllm.loader's"):
        wdsllm.dataset(data, batch_size=2, cp_rank=0, cp_size=2)


def test_the_data_wait_is_reduced_over_the_mesh_data_parallel_group(data, one_rank):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    ld = wdsllm.loader(data, batch_size=2, mesh=mesh, dp="dp", reduce_every=2)
    assert ld.observer.group is mesh.get_group("dp")
    assert sum(len(b["docs"]) for b in ld) == 17
    metrics = ld.metrics()
    assert metrics["data_wait_ranks"] == 1 and metrics["data_wait_slowest_rank"] == 0  # gathered over dp
