"""GPU kernels that zerokv's engines compile in (Triton, as torch.library operators)."""
