"""What every role shares: the frozen config, process plumbing, fault injection, files, checkpoints, the wire format."""
