"""What the hardware is and how twinplane runs on it; the only package that checks vendor or device names.

- `hardware`: what this machine is (`detect`: vendor, devices, memory, attention kernels, peak FLOP/s) and the
  measurements behind timers, memory reports and MFU.
- `runtime`: the device, dtype and precision of each plane, worker devices and collectives, memory, seeding.
- `backends`: which backend or kernel serves each hot path, with the self-checks behind the choices.
- `devices`: accelerator datasheets (peak FLOP/s, memory, bandwidth) by device name.

The ground floor: it imports nothing else of twinplane but `twinplane.errors`.
"""
