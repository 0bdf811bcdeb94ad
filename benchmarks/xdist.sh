# Sourced by the GPU check scripts: XDIST holds pytest's arguments for running the GPU tests in
# WORKERS processes (default 8 of the device machine's 16 cores) that share the GPU, when
# pytest-xdist is importable (gpu-bundle ... pytest-xdist execnet puts it in .gpu/), else nothing.
# The tests spend most of their time compiling kernels on the CPU.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
