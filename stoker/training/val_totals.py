"""Validation totals of one model on one replica, summed on the device and all-reduced once per pass: the loss,
top-1 and top-5 hits, and the confusion matrix (rows: true class, columns: predicted), from which per-class
accuracy follows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stoker.training import recovery

TOP_K = 5


@dataclass(frozen=True)
class ValResult:
    loss: float
    accuracy: float
    top5: float
    count: int
    confusion: list[list[int]]  # [true][predicted]

    @property
    def per_class(self) -> list[float | None]:
        return per_class_accuracy(self.confusion)


def per_class_accuracy(confusion: list[list[int]]) -> list[float | None]:
    """Each class's top-1 accuracy, its recall: the share of its samples predicted right (None for a class absent
    from validation). The one formula: summary.json's and `stoker eval`'s per class use it too."""
    return [row[i] / sum(row) if sum(row) else None for i, row in enumerate(confusion)]


class ValTotals:
    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.num_classes = num_classes
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-5 hits, count
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits = logits.float()
        self.sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        k = min(TOP_K, self.num_classes)
        self.sums[1] += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
        self.sums[2] += len(labels)
        # Not torch.bincount: its output's size depends on the values, which on a GPU is a host sync per batch.
        cells = labels * self.num_classes + logits.argmax(1)
        self.confusion.index_add_(0, cells, torch.ones_like(cells))

    def reduce(self) -> ValResult | None:
        """All replicas' totals (a collective: every rank calls it); None when validation held no sample."""
        sums, confusion = self.sums.clone(), self.confusion.clone()
        if dist.is_initialized():
            recovery.all_reduce(sums)
            recovery.all_reduce(confusion)
        self.sums.zero_()
        self.confusion.zero_()
        loss_sum, top5, count = sums.tolist()
        if not count:
            return None
        matrix = confusion.view(self.num_classes, self.num_classes).tolist()
        correct = sum(matrix[i][i] for i in range(self.num_classes))
        return ValResult(loss_sum / count, correct / count, top5 / count, int(count), matrix)


class ReplicaTotals:
    """A replica's validation totals: of its model and, with an EMA, of the average too (started afresh when the
    group changes: a pass's sums are all-reduced over the group that summed them)."""

    def __init__(self, num_classes: int, device: torch.device, with_ema: bool) -> None:
        self.num_classes, self.device, self.with_ema = num_classes, device, with_ema
        self.reset()

    def reset(self) -> None:
        self.model = ValTotals(self.num_classes, self.device)
        self.ema = ValTotals(self.num_classes, self.device) if self.with_ema else None

    def add(self, logits: torch.Tensor, labels: torch.Tensor, ema_logits: torch.Tensor | None) -> None:
        self.model.add(logits, labels)
        if self.ema is not None and ema_logits is not None:
            self.ema.add(ema_logits, labels)

    def reduce(self) -> tuple[ValResult | None, ValResult | None]:
        """(the model's, the EMA's) over the group, None where the group validated no sample."""
        return self.model.reduce(), self.ema.reduce() if self.ema is not None else None
