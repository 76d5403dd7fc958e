"""``foscar eval``: accuracy of every KV format against BF16 on a real model (CPU or GPU)."""
