"""Build FlashKDA's extension from a checkout of its public repository, for
measuring it beside the stages (issue: stage 08, FlashKDA measured live).

    git clone https://github.com/MoonshotAI/FlashKDA /path/to/FlashKDA
    python scripts/build_flashkda.py --src /path/to/FlashKDA
    python scripts/build_flashkda.py --src .flashkda --check     # also one forward (needs a GPU)

FlashKDA's code never enters this project: the script compiles the checkout's
`csrc/` (its `flash_kda.cpp` and `smxx/fwd_launch.cu`) with the CUTLASS/CuTe
headers of the nvidia-cutlass wheel (its own `cutlass` submodule is not needed)
for sm_90a, the flags of its setup.py, into build/flashkda/, and prints where
the module is. common.fla_ref finds it there (flashkda_available,
use_flashkda_build), and `scripts/gpu_run.py --flashkda` runs this script
first and measures FlashKDA beside the stages. On the lent H200 (no network) carry only what the build needs,
in a folder your .git/info/exclude ignores: `csrc/` and `flash_kda/` of the
checkout (about 200 KB), e.g. `.flashkda/`, named in the device call's carry.

The build takes about 90 s on the H200's 16 cores and several minutes on 2.
Exit code 0 built (and checked, with --check), 1 failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCES = ("csrc/flash_kda.cpp", "csrc/smxx/fwd_launch.cu")
NVCC_FLAGS = [  # FlashKDA's setup.py at 1ce47ea, less its thread count and ptxas verbosity
    "-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "-lineinfo",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="a checkout of MoonshotAI/FlashKDA (csrc/ is what is built)")
    p.add_argument("--arch", default="90a", help="CUDA arch with its suffix (FlashKDA needs 90a on Hopper)")
    p.add_argument("--check", action="store_true", help="after building, run one forward on the GPU")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    src = Path(args.src).resolve()
    missing = [s for s in SOURCES if not (src / s).exists()]
    if missing:
        print(f"build_flashkda: --src {src} is not a FlashKDA checkout: missing {', '.join(missing)}",
              file=sys.stderr)
        return 2

    from common.build import cutlass_include, setup_cuda_home
    from common.fla_ref import FLASHKDA_BUILD_DIR

    if setup_cuda_home() is None:
        print("build_flashkda: no CUDA toolkit (set CUDA_HOME)", file=sys.stderr)
        return 1
    inc = cutlass_include()
    if inc is None:
        print("build_flashkda: no CUTLASS headers (pip install nvidia-cutlass)", file=sys.stderr)
        return 1
    cutlass_root = Path(inc).parent  # the wheel's cutlass_library/source: include, examples, tools
    os.environ["TORCH_CUDA_ARCH_LIST"] = ""  # the -gencode below decides
    from torch.utils import cpp_extension

    build_dir = FLASHKDA_BUILD_DIR  # where common.fla_ref.use_flashkda_build / flashkda_available look
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[flashkda] building {src} (sm_{args.arch}) in {build_dir} ...", flush=True)
    mod = cpp_extension.load(
        name="flash_kda_C",
        sources=[str(src / s) for s in SOURCES],
        extra_include_paths=[inc, str(cutlass_root / "examples" / "common"),
                             str(cutlass_root / "tools" / "util" / "include"), str(src / "csrc")],
        extra_cflags=["-O3", "-Wno-psabi"],
        extra_cuda_cflags=NVCC_FLAGS + ["-gencode", f"arch=compute_{args.arch},code=sm_{args.arch}"],
        build_directory=str(build_dir),
        verbose=args.verbose,
    )
    print(f"[flashkda] built in {time.time() - t0:.0f} s: {mod.__file__}", flush=True)
    print(f"[flashkda] import it with: from common.fla_ref import use_flashkda_build; "
          f"use_flashkda_build({str(src)!r})  # puts {str(build_dir)!r} (flash_kda_C) and the checkout "
          f"(flash_kda) on sys.path; then: import flash_kda", flush=True)
    if not args.check:
        return 0
    import torch

    if not torch.cuda.is_available():
        print("build_flashkda: --check needs a GPU", file=sys.stderr)
        return 1
    B, T, H, D = 1, 256, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v, gate = (torch.randn(B, T, H, D, generator=g, **bf) for _ in range(4))
    beta = torch.randn(B, T, H, generator=g, **bf)
    A_log = torch.zeros(H, device="cuda")
    dt_bias = torch.zeros(H, D, device="cuda")
    out = torch.full((B, T, H, D), float("nan"), **bf)
    ws = torch.empty(mod.get_workspace_size(B * T, H, B), dtype=torch.uint8, device="cuda")
    mod.fwd(q, k, v, gate, beta, D ** -0.5, out, ws, A_log, dt_bias, -5.0,
            initial_state=None, final_state=None, cu_seqlens=None)
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(out).all())
    print(f"[flashkda] one forward at B{B} T{T} H{H} K=V={D}: output {'finite' if ok else 'NOT finite'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
