"""Accelerator specifications: dense bf16 peak FLOP/s (no sparsity) and memory, looked up by device name.

Figures are the vendors' published datasheet numbers for the SXM/OAM parts. Lookup is by substring of the name
torch reports (`torch.cuda.get_device_name()`, e.g. "NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"), most specific
first; an unknown device has no entry (MFU is then reported as null, never 0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    key: str  # short name used on the command line (`twinplane plan --gpu mi300x`)
    vendor: str  # nvidia | amd
    bf16_tflops: float  # dense peak
    memory_gb: float
    hbm_tb_s: float  # memory bandwidth
    match: tuple[str, ...]  # substrings of torch's device name, lower case


SPECS = (
    DeviceSpec("mi355x", "amd", 2516.6, 288, 8.0, ("mi355x",)),
    DeviceSpec("mi350x", "amd", 2306.9, 288, 8.0, ("mi350x",)),
    DeviceSpec("mi325x", "amd", 1307.4, 256, 6.0, ("mi325x",)),
    DeviceSpec("mi300x", "amd", 1307.4, 192, 5.3, ("mi300x",)),
    DeviceSpec("mi300a", "amd", 980.6, 128, 5.3, ("mi300a",)),
    DeviceSpec("mi250x", "amd", 383.0, 128, 3.2, ("mi250x",)),
    DeviceSpec("mi250", "amd", 362.1, 128, 3.2, ("mi250",)),
    DeviceSpec("b200", "nvidia", 2250.0, 180, 8.0, ("b200",)),
    DeviceSpec("h200", "nvidia", 989.4, 141, 4.8, ("h200",)),
    DeviceSpec("h100", "nvidia", 989.4, 80, 3.35, ("h100",)),
    DeviceSpec("a100", "nvidia", 312.0, 80, 2.0, ("a100",)),
    DeviceSpec("l40s", "nvidia", 362.05, 48, 0.864, ("l40s",)),
)
BY_KEY = {s.key: s for s in SPECS}


def lookup(device_name: str) -> DeviceSpec | None:
    """The spec whose pattern occurs in `device_name` (case-insensitive), or None."""
    name = device_name.lower()
    for spec in SPECS:  # ordered so that "mi300x" is tried before shorter names that it contains
        if any(m in name for m in spec.match):
            return spec
    return None
