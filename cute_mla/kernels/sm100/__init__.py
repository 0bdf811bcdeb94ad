"""SM100 (Blackwell, sm_100a) kernels. Not run on hardware yet: see docs/sm100.md."""
