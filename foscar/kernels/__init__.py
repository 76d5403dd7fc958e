"""Kernel bodies only (``@triton.jit`` and ``@gluon.jit``); the launchers live in
:mod:`foscar.backends`, the launch configs in :mod:`foscar.configs`.

- :mod:`.triton_decode`: the Triton split kernel (quantized history and BF16 windows) and the LSE
  merge of the splits; :mod:`.triton_operands` and :mod:`.triton_loads` its operand programs
  and paged loads
- :mod:`.cache_write`: the fused cache write of a decode step
- :mod:`.gluon`: the warp-specialized Hopper kernel (layouts, operands, tiles, kernel)
"""
