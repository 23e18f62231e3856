"""The GPU's energy, power, SM clock and power-cap state over a timed region (NVML).

At 64 sequences and more the H200 runs the large 4-bit and bf16 products at its board power limit:
the driver lowers the SM clock until the draw fits ("SW Power Cap"), so a tokens/s ratio there is a
ratio of energy per token, and it moves with the board's limit (docs/engine.md, "Known limits"). The
benchmarks print these readings beside their timings so that a capped row can be seen as one.

    with PowerMeter() as pm:
        run()
    pm.reading  # {"joules": ..., "watts": ..., "sm_mhz": ..., "capped": ...} or {} without NVML

Energy comes from the board's cumulative counter (`nvmlDeviceGetTotalEnergyConsumption`), so the
mean power is exact over the region; the clock and the cap are sampled every `period_s` by a thread.
Needs `nvidia-ml-py` (`import pynvml`); without it, or without a GPU, `reading` is {} and one line
says why.
"""

from __future__ import annotations

import threading
import time

SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap (the same bit in the older ThrottleReasons API)
_warned = False


def _handle():
    """The NVML handle of torch's current CUDA device, matched by PCI bus id (CUDA_VISIBLE_DEVICES
    renumbers devices; NVML does not)."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return pynvml.nvmlDeviceGetHandleByPciBusId(f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")


class PowerMeter:
    """Measures the current CUDA device over a `with` block; see the module docstring.

    Args:
        period_s: seconds between clock and cap samples.
    """

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.reading: dict = {}
        self._nvml = self._h = None
        self._samples: list[tuple[int, bool]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            self._h, self._nvml = _handle(), pynvml
        except Exception as e:  # no pynvml, no GPU, no NVML: the benchmark runs on without the columns
            global _warned
            if not _warned:
                print(f"   (power and clock not recorded: {type(e).__name__}: {e}; `pip install nvidia-ml-py`)",
                      flush=True)
                _warned = True

    def _sample(self) -> None:
        nv, h = self._nvml, self._h
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.wait(self.period_s):
            self._samples.append((nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), bool(reasons(h) & SW_POWER_CAP)))

    def __enter__(self) -> "PowerMeter":
        if self._h is not None:
            self._mj0, self._t0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._h), time.perf_counter()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._h is None:
            return
        joules = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._h) - self._mj0) / 1e3
        secs = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        s = self._samples or [(self._nvml.nvmlDeviceGetClockInfo(self._h, self._nvml.NVML_CLOCK_SM), False)]
        self.reading = dict(joules=joules, watts=joules / secs, sm_mhz=sum(c for c, _ in s) / len(s),
                            capped=sum(cap for _, cap in s) / len(s))
