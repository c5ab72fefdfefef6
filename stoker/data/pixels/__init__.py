"""Pixels: decoding one image into its place in a batch, and the augmentations applied to it there."""
