//! The 8-bit dynamic map of bitsandbytes (`create_dynamic_map(signed=True)`) and its blockwise
//! quantization as the CUDA kernel does it (`kQuantizeBlockwise`, `dQuantize<0>` in
//! bitsandbytes' csrc/kernels.cu): double quant stores NF4's per-block absmax this way.
//!
//! The map: 256 sorted f32 values in [-0.99297, 1], a dynamic exponent and a shrinking
//! fraction (Dettmers, "8-bit approximations for parallelism in deep learning"); the bits below
//! are bitsandbytes' own values, so that a code means the same here and there.

/// `create_dynamic_map()`'s 256 values, as f32 bits.
const MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The dynamic map (index → value), sorted ascending.
pub fn map() -> [f32; 256] {
    MAP_BITS.map(f32::from_bits)
}

/// The code of x (already divided by its block's absmax) in the sorted `code`, as
/// `dQuantize<0>` finds it: seven halvings from index 127, then the nearer of the last two
/// pivots by their midpoint (x above the value: a tie goes down; below: up).
pub(crate) fn quantize_one(code: &[f32; 256], x: f32) -> u8 {
    let (mut pivot, mut upper_pivot, mut lower_pivot) = (127usize, 255usize, 0usize);
    let (mut lower, mut upper) = (-1.0f32, 1.0f32);
    let mut val = code[pivot];
    let mut i = 64;
    while i > 0 {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = code[pivot];
        i >>= 1;
    }
    if upper_pivot == 255 {
        upper = code[upper_pivot];
    }
    if lower_pivot == 0 {
        lower = code[lower_pivot];
    }
    let pick = if x > val {
        match x > (upper + val) * 0.5 {
            true => upper_pivot,
            false => pivot,
        }
    } else {
        match x < (lower + val) * 0.5 {
            true => lower_pivot,
            false => pivot,
        }
    };
    pick as u8
}

/// Blockwise 8-bit quantization of `x` in blocks of `block`: (codes [n], absmax [⌈n / block⌉]).
/// Each block's absmax is max |x|; each value is quantized as x · (1 / absmax). An all-zero
/// block has absmax 0 and codes of NaN (as on CUDA: no comparison holds).
pub(crate) fn quantize_blockwise(
    code: &[f32; 256],
    x: &[f32],
    block: usize,
) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut absmax = Vec::with_capacity(x.len().div_ceil(block));
    for chunk in x.chunks(block) {
        let m = chunk.iter().fold(0f32, |m, v| m.max(ftz(*v).abs()));
        let r = 1.0 / m;
        absmax.push(m);
        q.extend(chunk.iter().map(|v| quantize_one(code, ftz(ftz(*v) * r))));
    }
    (q, absmax)
}

/// `kDequantizeBlockwise` (General8bit): code[q] · absmax of q's block, in f32.
pub(crate) fn dequantize_blockwise(
    code: &[f32],
    q: &[u8],
    absmax: &[f32],
    block: usize,
) -> Vec<f32> {
    q.iter()
        .enumerate()
        .map(|(i, &c)| {
            let a = absmax.get(i / block).copied().unwrap_or(0.0);
            ftz(code.get(c as usize).copied().unwrap_or(0.0) * a)
        })
        .collect()
}

/// Flush to zero, keeping the sign: bitsandbytes' kernels are built with --use_fast_math, so
/// their f32 arithmetic treats a subnormal operand or result as a signed zero.
pub(crate) fn ftz(x: f32) -> f32 {
    match x.is_subnormal() {
        true => 0f32.copysign(x),
        false => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next f32 above x (x finite).
    fn up(x: f32) -> f32 {
        match x {
            0.0 => f32::from_bits(1),
            x if x > 0.0 => f32::from_bits(x.to_bits() + 1),
            x => f32::from_bits(x.to_bits() - 1),
        }
    }

    /// The next f32 below x (x finite).
    fn down(x: f32) -> f32 {
        -up(-x)
    }

    /// The binary search lands on every code value, and on the nearer code just either side
    /// of every midpoint (the map is strictly increasing).
    #[test]
    fn the_search_finds_the_nearest_code() {
        let code = map();
        assert!(code.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((code[0], code[127], code[255]), (-0.99296875, 0.0, 1.0));
        for (i, &c) in code.iter().enumerate() {
            assert_eq!(quantize_one(&code, c) as usize, i);
        }
        for i in 0..255 {
            let mid = (code[i] + code[i + 1]) * 0.5;
            assert_eq!(
                quantize_one(&code, down(mid)) as usize,
                i,
                "below midpoint {i}"
            );
            assert_eq!(
                quantize_one(&code, up(mid)) as usize,
                i + 1,
                "above midpoint {i}"
            );
        }
        assert_eq!(quantize_one(&code, -1.0), 0);
        assert_eq!(quantize_one(&code, f32::NAN), 0);
    }
}
