"""The kernel-authoring playground: compile any kernel for any arch on any machine and read what
came out (PTX, cubin, SASS, resources). ``cute-mla compile`` is its command line."""
