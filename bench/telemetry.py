"""GPU telemetry through NVML (``nvidia-ml-py``): clocks, throttle reasons, power, the total
energy counter and memory, read before and after each case. Without a GPU or NVML the suite
says so once and rows carry ``telemetry: null``.

A case's record: ``{"device", "driver", "before": snap, "after": snap, "seconds",
"energy_j", "avg_power_w"}``, where a snap is ``{"sm_clock_mhz", "mem_clock_mhz",
"power_w", "energy_mj", "memory_used_bytes", "temperature_c", "throttle": [names]}`` (a field
is None where the device does not report it). ``energy_j`` is the difference of the total
energy counter over the span. A suite row's record spans its whole case (warm-up and
captures included); the throughput suite's joules per token come from a span around one
timed pass (``pass_energy_j``), not from the row's record.
"""

from __future__ import annotations

import contextlib
import time

import torch

try:
    import pynvml
except ImportError:  # nvidia-ml-py is optional at run time
    pynvml = None

THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def driver_version() -> str:
    try:
        pynvml.nvmlInit()
        try:
            return _str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (CPU machine, or the library is missing): not an error here
        return ""


class Telemetry:
    """``Telemetry.open(device)`` once per run, then ``with tele.span() as rec:`` per case."""

    def __init__(self, handle=None, reason: str = "") -> None:
        self.handle, self.reason = handle, reason
        self.device = self.driver = ""
        if handle is not None:
            self.device = _str(pynvml.nvmlDeviceGetName(handle))
            self.driver = _str(pynvml.nvmlSystemGetDriverVersion())

    @staticmethod
    def open(device: torch.device) -> Telemetry:
        if device.type != "cuda":
            return Telemetry(reason="no GPU")
        if pynvml is None:
            return Telemetry(reason="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
            return Telemetry(_handle(device))
        except Exception as e:  # NVML missing from the driver install, or no permission
            return Telemetry(reason=f"NVML unavailable: {e}")

    @property
    def available(self) -> bool:
        return self.handle is not None

    def snapshot(self) -> dict | None:
        if self.handle is None:
            return None
        h = pynvml
        reasons = _read(lambda: _throttle_mask(self.handle))
        mem = _read(lambda: h.nvmlDeviceGetMemoryInfo(self.handle).used)
        power = _read(lambda: h.nvmlDeviceGetPowerUsage(self.handle))
        return {
            "sm_clock_mhz": _read(lambda: h.nvmlDeviceGetClockInfo(self.handle, h.NVML_CLOCK_SM)),
            "mem_clock_mhz": _read(
                lambda: h.nvmlDeviceGetClockInfo(self.handle, h.NVML_CLOCK_MEM)),
            "power_w": None if power is None else power / 1e3,
            "energy_mj": _read(lambda: h.nvmlDeviceGetTotalEnergyConsumption(self.handle)),
            "memory_used_bytes": mem,
            "temperature_c": _read(
                lambda: h.nvmlDeviceGetTemperature(self.handle, h.NVML_TEMPERATURE_GPU)),
            "throttle": None if reasons is None else
            [n for bit, n in THROTTLE_REASONS.items() if reasons & bit],
        }

    @contextlib.contextmanager
    def span(self):
        """Yields a dict filled on exit with the record described in the module docstring
        (left empty without NVML: store ``rec or None``)."""
        rec: dict = {}
        if self.handle is None:
            yield rec
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        before, t0 = self.snapshot(), time.perf_counter()
        yield rec
        torch.cuda.synchronize()
        after, dt = self.snapshot(), time.perf_counter() - t0
        e0, e1 = before["energy_mj"], after["energy_mj"]
        energy = None if e0 is None or e1 is None else (e1 - e0) / 1e3
        rec.update(device=self.device, driver=self.driver, before=before, after=after,
                   seconds=dt, energy_j=energy,
                   avg_power_w=None if energy is None or dt <= 0 else energy / dt)


def _handle(device: torch.device):
    """The NVML handle of the torch device: by PCI bus id (CUDA_VISIBLE_DEVICES renumbers
    devices), else by index."""
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{props.pci_device_id:02x}.0"
        with contextlib.suppress(Exception):
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _throttle_mask(handle) -> int:
    get = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
           or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    return int(get(handle))


def _read(fn):
    try:
        return fn()
    except Exception:  # a field this device or driver does not report
        return None
