"""Is racecheck's hazard at the Gluon kernel's entry Triton's own warp_specialize dispatch?

A minimal warp-specialized Gluon kernel (a default partition and one 1-warp worker, each
writing its own output, no shared memory of ours): run it under
`compute-sanitizer --tool racecheck`; hazards reported here come from Triton's partition
dispatch, not from foscar's code.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(out_ptr):
    offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(out_ptr + offs, offs.to(gl.float32))


@gluon.jit
def _worker(out_ptr):
    offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(out_ptr + 128 + offs, offs.to(gl.float32) + 1.0)


@gluon.jit
def ws_probe(out_ptr):
    gl.warp_specialize([(_default, (out_ptr,)), (_worker, (out_ptr,))], [1], [40])


if __name__ == "__main__":
    out = torch.zeros(160, device="cuda")
    ws_probe[(4,)](out, num_warps=4)
    torch.cuda.synchronize()
    ok = bool((out[:128] == torch.arange(128, device="cuda")).all()
              and (out[128:] == torch.arange(32, device="cuda") + 1).all())
    print("ws_probe output correct:", ok)
