"""Collectives as a device-only backend (NCCL, RCCL) takes them, for the multi-rank tests on CPU.

gloo reduces host tensors, so on CPU a collective handed a host tensor works where NCCL or RCCL raises. `install()`
makes every process group of the process device-only as far as twinplane's own calls go: each tensor they hand to a
collective must be one that `runtime.collective_tensor` returned (placed on the group's device), not one made on
the host or computed from a placed one; an object collective that takes a device must be given the group's. Here
`collective_tensor` returns a copy even of a tensor already in place, so a caller that drops its result is caught
too. (A placed tensor's `.cpu()` is itself on CPU, so moving one back to the host goes unseen.) torch's own
collectives (FSDP2's, DTensor's: on the mesh's device) and the tests' pass unchecked.
"""

import inspect
import sys

import torch
import torch.distributed as dist

from twinplane.platform import runtime

TENSOR_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
                      "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                      "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
_PLACED = "_placed_for_collective"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dist.P2POp):
        yield x.tensor


def _checked(name, fn):
    signature = inspect.signature(fn)
    objects, takes_device = name in OBJECT_COLLECTIVES, "device" in signature.parameters

    def collective(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "twinplane":
            where = f"{name} called from {caller}"
            if takes_device:  # the objects travel pickled into a tensor on `device`
                call = signature.bind(*args, **kwargs).arguments
                if call.get("device") != runtime.collective_device(call.get("group")):
                    raise RuntimeError(f"device-only backend: {where} without device=collective_device(group)")
            for t in () if objects else _tensors([*args, *kwargs.values()]):
                if not hasattr(t, _PLACED):
                    raise RuntimeError(f"device-only backend: {where} got a {t.device.type} tensor "
                                       f"{tuple(t.shape)} {t.dtype} not placed by runtime.collective_tensor")
        return fn(*args, **kwargs)

    collective.__wrapped__ = fn
    return collective


def _placing(fn):
    def collective_tensor(t, group=None):
        out = fn(t, group)
        out = out.clone() if out is t else out  # the caller must use the result, as when `t` is on the host
        setattr(out, _PLACED, True)
        return out

    collective_tensor.__wrapped__ = fn
    return collective_tensor


def install() -> None:
    """Make this process's collectives device-only (idempotent)."""
    if hasattr(runtime.collective_tensor, "__wrapped__"):
        return
    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name)))
    runtime.collective_tensor = _placing(runtime.collective_tensor)
