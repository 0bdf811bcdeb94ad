"""The CuTe DSL plumbing: the compile seam, version-sensitive DSL names, PTX helpers both archs use."""
