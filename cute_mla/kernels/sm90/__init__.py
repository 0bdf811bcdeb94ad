"""SM90 (Hopper, sm_90a) kernels: the sparse MLA decode main kernel."""
