"""Integrations of foscar's quantized cache with model frameworks.

- :mod:`foscar.integrations.transformers`: a Hugging Face transformers ``Cache`` and attention
  function (``FoscarCache``, ``"foscar"`` attention); needs ``pip install "foscar[hf]"``.
"""
