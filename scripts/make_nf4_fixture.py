#!/usr/bin/env python3
"""NF4 reference values from bitsandbytes, for tests/it/nf4.rs.

    python3 scripts/make_nf4_fixture.py                 # CPU bitsandbytes -> nf4_cpu.safetensors
    python3 scripts/make_nf4_fixture.py --device cuda   # on a GPU machine -> nf4_cuda.safetensors

Each weight (bf16, the dtype a checkpoint's linears are quantized from; one f32) goes through
`bitsandbytes.functional.quantize_4bit(quant_type="nf4", blocksize=64)` without and with
`compress_statistics=True` (double quant), and back through `dequantize_4bit` to bf16 and f32.
The weights hold zeros, +-max, tiny (normal) values, an all-zero block, a block of one non-zero
value, values exactly on the NF4 midpoints, a tensor whose length is not a multiple of 64 (a
partial last block), and blocks whose absmax spread over five decades (double quant's 8-bit
codes, and a partial last nested block of 256).

The committed tests/fixtures/nf4/nf4_cpu.safetensors was made by this script with bitsandbytes
0.50.2 on its CPU backend (torch 2.11 CPU; the file's metadata names both), and
nf4_cuda.safetensors with --device cuda on an H200 (the same bitsandbytes, its wheel carried by
scripts/fetch-wheels.sh; torch 2.11+cu130): the CUDA kernels' values, which tests/it/nf4.rs
holds to the bit as well.

bitsandbytes' CPU and CUDA paths differ (their sources: csrc/kernels.cu, csrc/cpu_ops.cpp,
backends/default/ops.py): the 8-bit blockwise quantization of double quant is a 65536-bin
lookup table on the CPU and a binary search on CUDA; an all-zero block gets code 7 (0.0) on
the CPU and code 0 (-1.0 x 0 = -0.0) on CUDA; and four of the CUDA tree's thresholds are the
f32 next to the midpoint the CPU's bucketize uses. lora-train models CUDA (src/quant/nf4.rs);
tests/it/nf4.rs says where the CPU fixture differs, and holds a CUDA one to the bit.
"""
import argparse
import os

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "nf4")


def weights(gen):
    """name -> bf16 weight."""
    # [24, 704]: 264 blocks of 64, so double quant has a full nested block of 256 and one of 8.
    w = torch.randn(24, 704, generator=gen) * 0.02
    flat = w.view(-1)
    flat[0:64] = 0.0  # an all-zero block
    flat[64:128] = 0.0
    flat[100] = -0.75  # a block of one non-zero value
    flat[128:192] *= 1e-30  # tiny, still normal in bf16 and f32
    flat[192:256] = torch.linspace(-1.0, 1.0, 64)  # every level, exactly at +-max
    flat[300] = 3.0  # +max of its block
    flat[301] = -3.0  # and -max, equal magnitude
    flat[400:404] = 0.0  # zeros inside a block
    flat[5000] = -65504.0  # a block dominated by one large value
    flat[9000:9064] = torch.tensor([(-1) ** i * 2.0 ** (-i) for i in range(64)])
    small = torch.randn(3, 70, generator=gen) * 0.05  # 210 weights: a partial last block
    # [20, 960]: 300 blocks whose absmax spread over 1e-4..8 (half log-, half linearly spaced),
    # so double quant's 8-bit step meets most of the dynamic map's 256 codes, coarse and fine.
    target = torch.cat([torch.logspace(-4, 0.9, 150), torch.linspace(1e-3, 8.0, 150)])
    target = target[torch.randperm(300, generator=gen)]
    blocks = torch.randn(300, 64, generator=gen)
    blocks = blocks / blocks.abs().max(dim=1, keepdim=True).values * target[:, None]
    spread = blocks.reshape(20, 960)
    # f32: ratios exactly on the NF4 midpoints (a tie goes to the lower level), absmax 1
    code = F.get_4bit_type("nf4", device="cpu")
    ties = torch.zeros(64)
    ties[:15] = (code[:-1] + code[1:]) / 2
    ties[15] = 1.0
    ties[16:31] = -ties[:15]
    return {
        "mixed": w.to(torch.bfloat16),
        "partial": small.to(torch.bfloat16),
        "ties": ties,
        "spread": spread.to(torch.bfloat16),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(28)
    out = {"nf4.code": F.get_4bit_type("nf4", device="cpu").float().contiguous()}
    for name, w in weights(gen).items():
        x = w.to(dev)
        out[f"{name}.input"] = w.contiguous()
        q, st = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
        out[f"{name}.codes"] = q.reshape(-1).cpu().contiguous()
        out[f"{name}.absmax"] = st.absmax.float().cpu().contiguous()
        out[f"{name}.dequant"] = F.dequantize_4bit(q, st).cpu().contiguous()
        st32 = F.QuantState(absmax=st.absmax, shape=st.shape, dtype=torch.float32,
                            blocksize=64, code=st.code, quant_type="nf4")
        if w.numel() < 1000:  # (kept small: the bf16 ones are the f32 ones rounded)
            out[f"{name}.dequant_f32"] = F.dequantize_4bit(q, st32).cpu().contiguous()
        q2, st2 = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(q2, q), "double quant changes only the absmax"
        out[f"{name}.nested.absmax"] = st2.absmax.cpu().contiguous()  # uint8
        out[f"{name}.nested.absmax2"] = st2.state2.absmax.float().cpu().contiguous()
        out[f"{name}.nested.code"] = st2.state2.code.float().cpu().contiguous()
        out[f"{name}.nested.offset"] = st2.offset.reshape(1).float().cpu().contiguous()
        deq_absmax = F.dequantize_blockwise(st2.absmax, st2.state2) + st2.offset
        out[f"{name}.nested.absmax_deq"] = deq_absmax.float().cpu().contiguous()
        out[f"{name}.nested.dequant"] = F.dequantize_4bit(q2, st2).cpu().contiguous()
        # the nested quantization of bnb's own absmax values (its 8-bit path alone)
        qa, sa = F.quantize_blockwise(st.absmax.float() - st2.offset, blocksize=256)
        out[f"{name}.nested.requant"] = qa.cpu().contiguous()
    path = args.out or os.path.join(OUT, f"nf4_{dev.type}.safetensors")
    meta = {"device": dev.type, "bitsandbytes": bnb.__version__, "torch": torch.__version__}
    save_file(out, path, metadata=meta)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
