"""``foscar bench --serve`` on a random-weight Llama with head_dim 128 (no checkpoint needed on a
GPU machine without network): the engine's BF16 paged cache beside foscar INT4 and INT2 in the
same KV memory, one process.

    python benchmarks/tools/serve_random_llama.py --out DIR [--layers 4] [--requests 24]

The model has Llama-3/Qwen3-8B's attention shape (32 query / 8 KV heads, head_dim 128) and
hidden size, with fewer layers and a narrow MLP so that a step's time is mostly attention and the
engine; its tokens are meaningless, its memory and timing are not.
"""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from foscar.serving import bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for serve_bench.{json,md,png}")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (4)")
    p.add_argument("--requests", type=int, default=24, help="requests, all arriving at once (24)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[1024, 3072],
                   help="prompt lengths, uniform in [MIN, MAX] (1024 3072)")
    p.add_argument("--output-tokens", type=int, nargs=2, default=[32, 64],
                   help="answer lengths, uniform in [MIN, MAX] (32 64)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="per method (60)")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=2048,
                      num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    spec = bench.TraceSpec(num_requests=a.requests, rate=0.0, prompt_tokens=tuple(a.prompt_tokens),
                           output_tokens=tuple(a.output_tokens), seed=0)
    os.makedirs(a.out, exist_ok=True)
    bench.run_benchmark(model, ["bf16", "int4", "int2"], spec, out=a.out,
                        model_name=f"random-llama-{a.layers}L-d128", max_seconds=a.max_seconds)


if __name__ == "__main__":
    main()
