"""Device registry: two kinds of tier. Striped devices (``base.Device``: memory, extent, files) hold a byte range
the pool's allocator carves up; keyed stores (``keyed.KeyedStore``: remote) hold records by name. Adding a type =
one new module implementing one of the two + one line here."""

from kvflow.pool.devices.base import ALIGN, Device, aligned_empty
from kvflow.pool.devices.extent import ExtentDevice, odirect_supported
from kvflow.pool.devices.files import FilesDevice
from kvflow.pool.devices.keyed import KeyedDevice, KeyedStore
from kvflow.pool.devices.memory import MemoryDevice
from kvflow.pool.devices.remote import RemoteStore
from kvflow.pool.devices.throttle import Throttled, TokenBucket

STRIPED_TYPES: dict[str, type[Device]] = {
    "memory": MemoryDevice,
    "extent": ExtentDevice,
    "files": FilesDevice,
}
KEYED_TYPES: dict[str, type[RemoteStore]] = {
    "remote": RemoteStore,
}
DEVICE_TYPES: dict[str, type] = {**STRIPED_TYPES, **KEYED_TYPES}    # every type a config may name


def open_tier(cfg, readonly: bool = False) -> tuple[Device, KeyedStore | None]:
    """The device the striper places on, and the keyed store behind it (None for a striped device)."""
    if cfg.type in KEYED_TYPES:
        device = KEYED_TYPES[cfg.type].open(cfg, readonly)
        return device, device.store
    return DEVICE_TYPES[cfg.type](cfg, readonly=readonly), None


def open_device(cfg, readonly: bool = False) -> Device:
    return open_tier(cfg, readonly)[0]


__all__ = ["ALIGN", "DEVICE_TYPES", "Device", "ExtentDevice", "FilesDevice", "KEYED_TYPES", "KeyedDevice",
           "KeyedStore", "MemoryDevice", "RemoteStore", "STRIPED_TYPES", "Throttled", "TokenBucket", "aligned_empty",
           "odirect_supported", "open_device", "open_tier"]
