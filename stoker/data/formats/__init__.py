"""The formats a dataset comes in: image folders, tar shards, Parquet, a user's own dataset; and `stoker pack`."""
