"""GPU health from NVML: temperature and ECC error counts of the GPU behind each slot, read
by the worker's heartbeat thread (never the training thread) and judged by the
orchestrator, which taints a slot past its thresholds so its rank moves pre-emptively.

Slot `n2/3` is GPU 3 of node n2 (as CUDA_VISIBLE_DEVICES lists them, when it is set). Where
there is no NVIDIA driver, or no nvidia-ml-py, `GpuReader.read()` returns None and says
why once (`reason`): nothing is tainted, nothing fails.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("baton.health")


class GpuReading(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temp_c: float | None = Field(default=None, ge=-50, le=200)
    ecc_uncorrected: int | None = Field(default=None, ge=0)  # volatile: since the driver loaded
    ecc_corrected: int | None = Field(default=None, ge=0)


class GpuReader:
    """NVML for one slot's GPU; every call is cheap (tens of µs), made once per heartbeat."""

    def __init__(self, slot: str | None = None):
        self.reason: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._device(pynvml, slot or os.environ.get("BATON_SLOT", ""))
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, NotFound, ...
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
        if self.reason:
            log.info("GPU health readings off: %s", self.reason)

    @staticmethod
    def _device(pynvml: Any, slot: str) -> Any:
        index = slot.rsplit("/", 1)[-1]
        i = int(index) if index.isdigit() else 0
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible:
            chosen = visible[min(i, len(visible) - 1)]
            if not chosen.isdigit():
                return pynvml.nvmlDeviceGetHandleByUUID(chosen)
            i = int(chosen)
        return pynvml.nvmlDeviceGetHandleByIndex(i)

    def read(self) -> GpuReading | None:
        if self._handle is None:
            return None
        nvml, h = self._nvml, self._handle

        def get(fn: Any, *args: Any) -> Any:
            try:
                return fn(h, *args)
            except Exception:  # not supported on this GPU (no ECC on consumer cards, say)
                return None

        return GpuReading(
            temp_c=get(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
            ecc_uncorrected=get(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                nvml.NVML_VOLATILE_ECC),
            ecc_corrected=get(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                              nvml.NVML_VOLATILE_ECC))


@dataclass(frozen=True)
class GpuThresholds:
    """Past any of these a slot is tainted (0 or None: that check is off)."""

    temp_c: float = 90.0
    ecc_uncorrected: int = 1
    ecc_corrected: int = 0

    def judge(self, r: GpuReading) -> str | None:
        if self.ecc_uncorrected and r.ecc_uncorrected is not None and r.ecc_uncorrected >= self.ecc_uncorrected:
            return f"ecc: {r.ecc_uncorrected} uncorrected memory error(s) since the driver loaded"
        if self.ecc_corrected and r.ecc_corrected is not None and r.ecc_corrected >= self.ecc_corrected:
            return f"ecc: {r.ecc_corrected} corrected memory errors (threshold {self.ecc_corrected})"
        if self.temp_c and r.temp_c is not None and r.temp_c >= self.temp_c:
            return f"thermal: GPU at {r.temp_c:g} C (threshold {self.temp_c:g} C)"
        return None
