"""plait as a torch.distributed backend (filled in by the torch-backend work)."""
