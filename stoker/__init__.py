"""stoker: train image classifiers on several devices at once and keep every device busy.

    import stoker
    summary = stoker.train(data="photos/", devices="cpu:2", epochs=3, out="runs/photos")
    model = stoker.load("runs/photos")       # model.model (eval mode), model.classes, model.preprocess(path)

`train` takes the same settings as `stoker train` (see `stoker.TrainConfig`) and returns the run summary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from stoker.common.config import TrainConfig
    from stoker.use.inference import LoadedModel
    from stoker.use.loader import Loader

__all__ = ["Loader", "TrainConfig", "load", "train"]


def train(config: TrainConfig | None = None, *, show_progress: bool = True, quiet: bool = False,
          **settings: Any) -> dict[str, Any]:
    """Train with `config` (or the given settings, named as `stoker train`'s flags) and return the summary written
    to RUN_DIR/summary.json. `quiet=True`, as `--quiet`: no live panel, no progress or epoch lines (the same as
    `show_progress=False`).

    Raises `stoker.common.config.ConfigError` for a bad setting before any process starts. The run's own failures are
    reported in the summary (`status` "failed" with `error`), like on the command line.
    """
    import sys

    from stoker.common.main_guard import check_main_guard

    check_main_guard(sys._getframe(1))  # first: a child re-importing the script stops before it imports torch
    from stoker.common.config import make_config

    if config is None:
        config = make_config(settings)
    elif settings:
        config = config.replace(**settings)
    from stoker.run.controller import Controller  # after the settings: a bad one is reported without torch's import

    return Controller(config, show_progress=show_progress and not quiet).run()


def load(source: str | Path, device: str = "cpu",
         model: Callable[..., nn.Module] | str | None = None, accept_changed_module: bool = False) -> LoadedModel:
    """The model a run trained (RUN_DIR, or a model file: model.pt, model_best.pt, model_ema.pt) in eval mode on
    `device`, with `.classes` and `.preprocess(path or bytes or image)`: exactly the tensor validation gives that
    file. A file stoker did not write, or one modified since, is a ValueError naming it. A `module:function`
    model is imported only when you name it (`model="module:function"`, the card's own; the file alone never
    chooses code to run) and while its file hashes to what training recorded (`accept_changed_module=True`: as it is
    now, with a warning that says what differs); `model=function` builds it instead (called as
    `function(num_classes=K)`)."""
    from stoker.use.inference import load as load_model

    return load_model(source, device, model, accept_changed_module)


def __getattr__(name: str) -> Any:
    # Lazy: producers import stoker.pipeline.producer, which must not pay for torch.
    if name == "TrainConfig":
        from stoker.common.config import TrainConfig
        return TrainConfig
    if name == "Loader":  # stoker's producers feeding a training loop of one's own
        from stoker.use.loader import Loader
        return Loader
    raise AttributeError(name)
