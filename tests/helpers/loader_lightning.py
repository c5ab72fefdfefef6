"""A Lightning module fed by stoker.Loader from train_dataloader(), trained with Trainer(accelerator="cpu",
devices=2, strategy="ddp") (Lightning starts rank 1 by running this script again). Each rank writes the sample ids
it trained on, per epoch; `--save` writes Lightning's own checkpoint at the end of the first epoch, as ModelCheckpoint
would, while training goes on; `--resume` continues from one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

import stoker


class Module(L.LightningModule):
    def __init__(self, data: str, out: str) -> None:
        super().__init__()
        self.data, self.out = data, out
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1),
                                       torch.nn.Flatten(), torch.nn.Linear(4, 10))
        self.seen: dict[int, list[int]] = {}

    def train_dataloader(self):
        self.loader = stoker.Loader(self.data, batch_size=8, image_size=16, seed=3, producers=1, device="cpu")
        return self.loader

    def training_step(self, batch, index):
        images, labels = batch
        self.seen.setdefault(self.current_epoch, []).extend(self.loader.batch_ids.tolist())
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        Path(f"{self.out}.{self.global_rank}").write_text(json.dumps(self.seen))
        self.loader.close()


class SaveAfterFirstEpoch(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[SaveAfterFirstEpoch(args.save)] if args.save else [])
    trainer.fit(Module(args.data, args.out), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
