"""Test configuration: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` wraps the kernels (at import), so it is set
here, before any test module imports foscar's kernels.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: device every kernel test runs on: the GPU, or the CPU through the Triton interpreter
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def tiny_llama(*, layers: int, q_heads: int, kv_heads: int, head_dim: int, **config):
    """A random Llama of ``layers`` layers (seed 0, 96-token vocabulary, 256 positions unless
    ``config`` says otherwise): the OSCAR calibration tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=q_heads * head_dim,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        **{"max_position_embeddings": 256, **config},
    )
    return LlamaForCausalLM(cfg).eval()
