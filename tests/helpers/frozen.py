"""A model whose first layer is frozen, as a fine-tuned backbone's often is (loaded through
--model frozen:frozen_stem_cnn): its optimizer holds fewer parameters than the model has."""

from nobn import small_cnn
from torch import nn


def frozen_stem_cnn(num_classes: int) -> nn.Module:
    model = small_cnn(num_classes)
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    return model
