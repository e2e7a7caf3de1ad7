"""Collectives take tensors on the device their group's backend serves: the helper's choice of device, and the guard
(`device_only`, installed by conftest) that makes the multi-rank tests refuse host tensors as NCCL/RCCL would."""

import datetime

import pytest
import torch
import torch.distributed as dist

from twinplane.platform import runtime
from twinplane.train import fsdp


@pytest.mark.parametrize(("backend", "device"), [("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu")),
                                                 ("cpu:gloo,cuda:nccl", torch.device("cpu"))])
def test_collective_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the worker's device, set by `worker_device`
    assert runtime.collective_device() == device


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def from_twinplane(code: str, **names):
    """Run `code` as if it were a line of twinplane (the guard checks only the package's own calls)."""
    exec(code, {"__name__": "twinplane.example", "dist": dist, "runtime": runtime, "torch": torch, **names})


def test_placed_tensors_pass_and_sums_stay_exact(group):
    assert fsdp.all_reduce(2**40 + 1, group) == 2**40 + 1  # fp64: token counts stay exact
    assert fsdp.all_reduce(3, group, dist.ReduceOp.MAX) == 3.0
    from_twinplane("t = runtime.collective_tensor(torch.ones(3), g); dist.all_reduce(t, group=g)", g=group)


@pytest.mark.parametrize("code", [
    "dist.all_reduce(torch.tensor(1.0, dtype=torch.float64), group=g)",  # made on the host
    "runtime.collective_tensor(t, g); dist.all_reduce(t, group=g)",  # the placed copy dropped
    "dist.broadcast(runtime.collective_tensor(t, g) * 2, src=0, group=g)",  # computed from a placed tensor
    "dist.all_gather([runtime.collective_tensor(t, g)], t, group=g)",  # one of several tensors on the host
    "dist.broadcast_object_list([1], src=0, group=g)",  # an object collective not told the device
])
def test_host_tensors_from_twinplane_are_refused(group, code):
    with pytest.raises(RuntimeError, match="device-only backend"):
        from_twinplane(code, g=group, t=torch.ones(3))
    dist.all_reduce(torch.ones(3), group=group)  # the tests' own calls pass (their processes are CPU-only)
