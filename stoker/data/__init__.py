"""What --data names: folders, shards, the packed index, decoding and augmenting one image."""
