"""What the hardware is and can do: device, dtype and kernel choices (`platform`), accelerator datasheets
(`devices`). The ground floor: it imports nothing else of twinplane."""
