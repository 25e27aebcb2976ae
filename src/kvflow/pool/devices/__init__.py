"""Device registry. Adding a device type = one new module implementing ``Device`` + one line here."""

from kvflow.pool.devices.base import ALIGN, Device, aligned_empty
from kvflow.pool.devices.extent import ExtentDevice, odirect_supported
from kvflow.pool.devices.files import FilesDevice
from kvflow.pool.devices.memory import MemoryDevice
from kvflow.pool.devices.remote import RemoteDevice
from kvflow.pool.devices.throttle import Throttled, TokenBucket

DEVICE_TYPES: dict[str, type[Device]] = {
    "memory": MemoryDevice,
    "extent": ExtentDevice,
    "files": FilesDevice,
    "remote": RemoteDevice,
}


def open_device(cfg, readonly: bool = False) -> Device:
    return DEVICE_TYPES[cfg.type](cfg, readonly=readonly)


__all__ = ["ALIGN", "DEVICE_TYPES", "Device", "ExtentDevice", "FilesDevice", "MemoryDevice", "RemoteDevice",
           "Throttled", "TokenBucket", "aligned_empty", "odirect_supported", "open_device"]
