"""Cases of DistributedDataParallel's constructor refusals."""

from __future__ import annotations

from dataclasses import dataclass

CPU_DEVICE = "cpu"
"""How a case spells ``torch.device("cpu")`` in ``device_ids`` or ``output_device``."""


def _spelled(device: int | str | None) -> str:
    return "torch.device('cpu')" if device == CPU_DEVICE else str(device)


@dataclass(frozen=True)
class CpuDeviceCase:
    """A seeded float64 MLP of ``dims`` on the CPU wrapped with ``device_ids`` (a list of
    one, or None) and ``output_device`` (None or one): a device index, or ``CPU_DEVICE``."""

    dims: tuple[int, ...]
    seed: int
    device_ids: tuple[int | str, ...] | None
    output_device: int | str | None
    bias: bool = True
    dtype: str = "float64"

    def call(self) -> str:
        ids = (
            "None" if self.device_ids is None else f"[{', '.join(map(_spelled, self.device_ids))}]"
        )
        return (
            f"DistributedDataParallel(MLP{self.dims} on the CPU, device_ids={ids}, "
            f"output_device={_spelled(self.output_device)})"
        )
