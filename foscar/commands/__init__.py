"""The ``foscar`` command line (argparse front ends); nothing in the package imports it."""
