"""The values some settings take, where both the settings (`config.py`) and the producer side read them: this
module imports nothing, so a producer's start does not pay for pydantic."""

from typing import Literal, get_args

Augment = Literal["standard", "noflip", "none", "trivial", "randaug"]
AUGMENTS: tuple[str, ...] = get_args(Augment)

BUILTIN_IMAGE_SIZE = 32  # the built-in dataset's side
DEFAULT_IMAGE_SIZE = 224  # a folder or shards of one's own
