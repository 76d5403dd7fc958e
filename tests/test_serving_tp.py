"""Tensor parallelism: foscar caches split by KV head over 2 CPU processes (gloo) generate the
tokens of 1 process.

The test launches this file under ``torchrun --standalone --nproc-per-node 2`` (and once alone,
the reference) on a small random Llama saved to disk: 8 query / 4 KV heads of 64 channels, so
each process holds 2 KV heads' pages, and an OSCAR file with one rotation per KV head, which each
process slices to its heads. Both runs take one thread per process, so they differ only by the
split (the row-parallel ``o_proj`` sums the heads' shares in two parts).

Then ``foscar serve`` itself under torchrun: the same model with a tokenizer of single
characters, 2 processes against 1, concurrent chats (greedy and seeded sampling) over HTTP with
the same answers, and a SIGTERM to process 0 that ends every process cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32, 33, 34]]
NEW_TOKENS = 8
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8, 4, 64


def _oscar_file(path: Path) -> Path:
    """Random per-KV-head rotations with clips for INT2/INT4; INT4 keys in layer 0, short
    windows so that the prompts reach the quantized history."""
    from foscar.oscar import OscarRotations

    gen = torch.Generator().manual_seed(3)

    def orthogonal():
        a = torch.randn(LAYERS, KV_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64)
        return torch.linalg.qr(a).Q

    clips = {(b, r): torch.full((LAYERS,), 0.95, dtype=torch.float64)
             for b in (2, 4) for r in ("key", "value")}
    header = {"key_bits": [4, 2], "value_bits": [2, 2], "windows": [4, 8]}
    OscarRotations(orthogonal(), orthogonal(), clips, header).save(path)
    return path


def _worker(model_dir: str, kv: str, out: str) -> None:
    """One process of a run: load (split when launched by torchrun), serve PROMPTS greedily,
    rank 0 writes the tokens and each process whether its rotations are its heads'."""
    from transformers import AutoModelForCausalLM

    from foscar.oscar import OscarRotations
    from foscar.serving import build_manager

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    kw = {}
    if world > 1:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(tp_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    manager = build_manager(model, kv, num_blocks=16, block_size=16, max_batch_tokens=64,
                            max_new_tokens=NEW_TOKENS)
    manager.start()
    if rank == 0:
        ids = [manager.add_request(p) for p in PROMPTS]
        done = {}
        while len(done) < len(ids):
            r = manager.get_result(timeout=120)
            if r is None:
                break
            if r.is_finished():
                done[r.request_id] = r.generated_tokens
        manager.stop(block=True)
    else:  # the loop ends when rank 0 stops it
        manager.wait()
    paged = manager.cache.paged
    heads = KV_HEADS // world
    rot = OscarRotations.load(kv)
    mine = rot.key[:, rank * heads : (rank + 1) * heads]
    sliced = all(
        torch.equal(paged.cache.transforms[layer].key_rotation.cpu(), mine[layer])
        for layer in range(LAYERS)
    )
    result = {"heads": paged.cache.num_kv_heads, "sliced": sliced}
    if rank == 0:
        result["tokens"] = [done.get(i) for i in ids]
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def _launch(args: list[str], tmp_path: Path, nproc: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = str(tmp_path / f"run{nproc}")
    if nproc == 1:
        cmd = [sys.executable, __file__, *args, out]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", __file__, *args, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)]


def test_two_processes_generate_the_tokens_of_one(tmp_path):
    pytest.importorskip("safetensors")
    from conftest import tiny_llama

    model = tiny_llama(layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                                head_dim=HEAD_DIM, initializer_range=0.1)
    model.save_pretrained(tmp_path / "model")
    args = [str(tmp_path / "model"), str(_oscar_file(tmp_path / "oscar.safetensors"))]
    (one,) = _launch(args, tmp_path, 1)
    two = _launch(args, tmp_path, 2)
    assert one["heads"] == KV_HEADS and [r["heads"] for r in two] == [KV_HEADS // 2] * 2
    assert one["sliced"] and all(r["sliced"] for r in two)
    assert all(len(t) == NEW_TOKENS for t in one["tokens"])
    assert two[0]["tokens"] == one["tokens"]


# ---------------------------------------------------------------------------- foscar serve
CHATS = [
    {"content": "Hello there, how are you?"},
    {"content": "Name three colors.", "stream": True},
    {"content": "What is 2 + 2?", "temperature": 1.0, "seed": 11},
    {"content": "What is 2 + 2?", "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 12},
    # two samples of one prompt: prefilled once, forked in every process
    {"content": "Name a fruit.", "temperature": 1.0, "seed": 5, "n": 2},
]


def _char_tokenizer(folder: Path) -> None:
    """A tokenizer of single characters (93 tokens, within the model's 96) with a ChatML
    template, saved to ``folder``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127) if chr(c) not in "`^{|}~"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + chars)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


def _answers(server) -> list[str]:
    """CHATS sent at once; the answers' text (a stream's pieces joined)."""
    import threading

    answers: dict = {}

    def ask(i: int) -> None:
        chat = dict(CHATS[i])
        body = {"messages": [{"role": "user", "content": chat.pop("content")}],
                "max_tokens": NEW_TOKENS, **chat}
        if body.get("stream"):
            events = server.stream(body)
            assert events[-1] == "[DONE]"
            answers[i] = "".join(e["choices"][0]["delta"].get("content", "")
                                 for e in events[:-1] if e["choices"])
        else:
            status, answer = server.request("POST", "/v1/chat/completions", body)
            assert status == 200, answer
            answers[i] = " | ".join(c["message"]["content"] for c in answer["choices"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(CHATS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [answers.get(i) for i in range(len(CHATS))]


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (its children carrying RANK)."""
    pids = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if rank:
                pids[int(rank[0][5:])] = int(child)
    return pids


def test_foscar_serve_under_torchrun_answers_as_one_process(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    if not Path("/proc/self/task").exists():
        pytest.skip("finding torchrun's workers reads /proc")
    from conftest import tiny_llama
    from test_serving_server import ServeProcess, wait_for

    model = tiny_llama(layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       initializer_range=0.1)
    model.save_pretrained(tmp_path / "model")
    _char_tokenizer(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--oscar",
            str(_oscar_file(tmp_path / "oscar.safetensors")), "--num-blocks", "32",
            "--block-size", "16", "--max-batch-tokens", "256", "--cpu-threads", "1",
            "--host", "127.0.0.1", "--port", "0"]
    # every prompt fits one step, so each is prefilled whole whenever it arrives: a chunk's
    # logits would depend on the (quantized) history before it, and so on arrival times
    env = {"OMP_NUM_THREADS": "1"}
    one = ServeProcess(args, env=env)
    two = ServeProcess(args, env=env, launcher=[
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "foscar", "serve"])
    try:
        one.wait_ready(180)
        two.wait_ready(180)
        expected = _answers(one)
        assert all(expected), expected
        assert _answers(two) == expected
        assert _answers(two) == expected  # the seeded answers again, beside the same others
        log = two.log()
        assert "split over 2 processes" in log and "each holds 2 of the 4 KV heads" in log
        assert log.count("serving model on http://") == 1  # process 0 only
        assert "[rank 1]: process 1 of 2: KV heads 2-3 of 4" in log
        # a stream's request is counted once its handler returns, after the client read it all
        # (a choice is an engine request)
        engine_requests = sum(chat.get("n", 1) for chat in CHATS)
        wait_for(lambda: two.stats()["server"]["finished"] == 2 * engine_requests, 30,
                  "every request to be counted")
        assert two.stats()["kv"]["forks"] == 2

        # SIGTERM to process 0: it stops the engine of every process, and all exit cleanly
        workers = _worker_pids(two.proc.pid)
        assert sorted(workers) == [0, 1]
        os.kill(workers[0], signal.SIGTERM)
        assert two.proc.wait(60) == 0, two.log()[-3000:]
        assert "stopping (SIGTERM)" in two.log() and "stopped" in two.lines[-1]
    finally:
        one.stop()
        two.stop()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
