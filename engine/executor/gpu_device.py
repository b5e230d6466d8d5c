"""DeviceInfo: what the GPU executor needs to know of its GPU, asked once at start."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """What the executor needs to know of its GPU, asked once at start."""
    name: str
    num_sms: int
    total_memory: int
    compute_capability: str

    @classmethod
    def query(cls) -> "DeviceInfo":
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return cls(name=name, num_sms=int(props["multiProcessorCount"]), total_memory=int(props["totalGlobalMem"]),
                   compute_capability=str(dev.compute_capability))
