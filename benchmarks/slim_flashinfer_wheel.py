"""Copy .whl/ (../shared/tools/device-wheels.sh) to .whl_slim/ with FlashInfer's JIT sources of
MoE, KDA and DeepSeek-V4 kernels and CUTLASS's examples left out, so that the wheels and the
working tree fit the device's 64 MiB carry limit.

    python benchmarks/slim_flashinfer_wheel.py     # then carry [".whl_slim"] instead of .whl
"""

import glob
import os
import shutil
import zipfile

DROP = (  # JIT sources of features foscar never calls (FlashInfer imports no .py from here)
    "flashinfer/data/cutlass/examples/",
    "flashinfer/data/csrc/kda/",
    "flashinfer/data/csrc/cake_dsv4/",
    "flashinfer/data/csrc/fused_moe/",
)


def main(src_dir=".whl", dst_dir=".whl_slim"):
    os.makedirs(dst_dir, exist_ok=True)
    for path in glob.glob(os.path.join(src_dir, "*.whl")):
        dst = os.path.join(dst_dir, os.path.basename(path))
        if not os.path.basename(path).startswith("flashinfer_python"):
            shutil.copy(path, dst)
            continue
        removed = set()
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():  # RECORD comes last, after every removal is known
                if info.filename.startswith(DROP):
                    removed.add(info.filename)
                    continue
                data = zin.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    keep = [ln for ln in lines if ln.split(",")[0] not in removed]
                    data = ("\n".join(keep) + "\n").encode()
                zout.writestr(info, data)
        print(f"{dst}: {len(removed)} files left out, {os.path.getsize(dst) >> 20} MiB")


if __name__ == "__main__":
    main()
