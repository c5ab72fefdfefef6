"""What `stoker eval` and `stoker predict` take besides the model and the images; torch-free, so a bad value is
reported before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stoker.common.config import DeviceSettings, FeedSettings, check_section


@dataclass(frozen=True)
class InferenceSettings:
    """How the images are read and where the model runs: `stoker train`'s settings of the same names, checked by
    the same sections (`devices` also takes 'cpu': one CPU replica)."""

    devices: str = "auto"
    batch_size: int = 64
    producers: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        try:
            check_section(DeviceSettings, {"devices": "cpu:1" if self.devices == "cpu" else self.devices})
        except ValueError as error:
            raise type(error)(f"{error} (or 'cpu': one CPU replica)") from None
        feed = check_section(FeedSettings, {"batch_size": self.batch_size, "producers": self.producers})
        object.__setattr__(self, "batch_size", feed.batch_size)  # as the section reads it: "64" is 64
        object.__setattr__(self, "producers", feed.producers)
