"""tgserve.kernels: Triton attention kernels, each with a torch reference twin."""
