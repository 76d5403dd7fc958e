"""``@triton.jit`` bodies only; launchers live in :mod:`foscar.backends`."""
