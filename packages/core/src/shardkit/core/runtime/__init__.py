"""The collective runtime: the only code that talks to torch.distributed or to a device API."""
