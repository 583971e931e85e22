//! FSDP's bytes: a group of tensors flat-sharded over the ranks, gathered one group at a time.
//! What the groups are (a model's layers) and how a gathered group becomes a layer is the
//! trainer's (train::shards); parallel/ moves the bytes.
//!
//! A group is one decoder layer's frozen tensors (`Layer::frozen_mut` order), or the embedding,
//! final norm and head (`Model::io_mut` order). Its tensors are flattened into one buffer per
//! dtype, padded to a multiple of N = world, and rank r keeps elements [r·s, (r+1)·s) of each,
//! s = padded / N (llm.c's `multi_gpu_get_shard_offset`, with padding instead of refusing).
//! A full-precision group is one buffer in the base dtype. A layer in NF4 (`quant`) is three:
//! its norms and biases in the base dtype, its linears' codes (and double quant's absmax codes)
//! in u8, their absmax, nested absmax and maps in f32 (two buffers when the base is f32); so it
//! crosses the wire in NF4, ~4× fewer bytes than bf16, and is dequantized after its gather
//! (`Layer::resident_in`, train::driver). An NF4 linear's 1-element W placeholder is no part of
//! the group: it stays in the skeleton as the dtype to dequantize to.
//! To use a group, the ranks all-gather their shards into fresh [N·s] buffers, and the group's
//! tensors become `narrow` + `reshape` views into them (ops accept views with a storage
//! offset); the buffers are freed when the last view is dropped.
//!
//! The model keeps the LoRA `Var`s; the skeleton layer's frozen tensors are 1-element
//! placeholders, and a gathered layer is a clone of the skeleton (same `Var`s) with the views
//! put back.
//!
//! Folded linears (`ops::fold`: CUDA, bf16) are sharded padded, W* = [W | pad] [out, in + p]:
//! before each micro-batch every rank rounds its B's into the pad columns of the W* rows its
//! own shards hold (`Shards::write_pads`), so a gathered layer arrives whole, B's included,
//! and no work follows the gather. The pads add p / in to the shards (1.5% at 7B r16).

use super::comm::Comm;
use candle_core::{DType, Result, Tensor};

/// One group's shards: one flat buffer per dtype among its tensors (one for a base in full
/// precision; a layer in NF4 adds its u8 codes and f32 absmax arrays), and where each tensor
/// lies in them.
pub struct Flat {
    /// Per dtype, in the order the group's tensors first show it (a layer's norms come first,
    /// so its base-dtype buffer leads).
    bufs: Vec<Buf>,
    /// Per tensor, in `take` order: which buffer, its offset there, its shape.
    parts: Vec<Part>,
}

/// One dtype's flat buffer of a group, sharded.
struct Buf {
    /// [s]: this rank's slice of the padded flat buffer.
    shard: Tensor,
    /// Elements before padding (the parts and their alignment gaps).
    len: usize,
    /// Where the shard starts in the flat buffer: rank · s.
    lo: usize,
}

/// A tensor's place in its group's buffers.
struct Part {
    buf: usize,
    off: usize,
    shape: Vec<usize>,
}

/// Where a tensor of `dtype` may start in a flat buffer, in elements: NF4 codes (u8) at
/// 16 bytes, as nf4.cu reads them 8 bytes at a time; the floats packed, as they always were.
fn align(dtype: DType) -> usize {
    match dtype {
        DType::U8 => 16,
        _ => 1,
    }
}

impl Flat {
    /// Flattens `tensors` by dtype, keeps this rank's 1/N of each buffer (a copy, so the full
    /// buffers are freed) and replaces each tensor with a 1-element placeholder of its dtype.
    pub fn take(tensors: Vec<&mut Tensor>, comm: &dyn Comm) -> Result<Flat> {
        let (rank, world) = (comm.rank(), comm.world());
        let Some(first) = tensors.first() else {
            candle_core::bail!("fsdp: a group with no tensors");
        };
        let dev = first.device().clone();
        // per dtype: (dtype, pieces in order, elements so far)
        let mut by: Vec<(DType, Vec<Tensor>, usize)> = Vec::new();
        let mut parts = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let dtype = t.dtype();
            let buf = match by.iter().position(|(d, _, _)| *d == dtype) {
                Some(i) => i,
                None => {
                    by.push((dtype, Vec::new(), 0));
                    by.len() - 1
                }
            };
            let (_, pieces, len) = &mut by[buf];
            let off = len.next_multiple_of(align(dtype));
            if off > *len {
                pieces.push(Tensor::zeros(off - *len, dtype, &dev)?);
            }
            parts.push(Part {
                buf,
                off,
                shape: t.dims().to_vec(),
            });
            pieces.push(t.flatten_all()?);
            *len = off + t.elem_count();
        }
        let mut bufs = Vec::with_capacity(by.len());
        for (dtype, mut pieces, len) in by {
            let s = len.div_ceil(world);
            if s * world > len {
                pieces.push(Tensor::zeros(s * world - len, dtype, &dev)?);
            }
            // force_contiguous: a real [s] buffer (`copy` of a view clones the whole storage).
            let shard = Tensor::cat(&pieces, 0)?
                .narrow(0, rank * s, s)?
                .force_contiguous()?;
            bufs.push(Buf {
                shard,
                len,
                lo: rank * s,
            });
        }
        for t in tensors {
            *t = Tensor::zeros(1, t.dtype(), &dev)?;
        }
        Ok(Flat { bufs, parts })
    }

    /// The group's tensors as views into the gathered [N·s] buffers, in `take` order.
    /// `ahead`: issued early (`Comm::all_gather_ahead`); call `Comm::gathered` before use.
    pub(crate) fn gather(&self, comm: &dyn Comm, ahead: bool) -> Result<Vec<Tensor>> {
        let full = self
            .bufs
            .iter()
            .map(|b| match ahead {
                true => comm.all_gather_ahead(&b.shard),
                false => comm.all_gather(&b.shard),
            })
            .collect::<Result<Vec<_>>>()?; // each [N·s]
        self.parts
            .iter()
            .map(|p| {
                let Some(buf) = full.get(p.buf) else {
                    candle_core::bail!("fsdp: a part in buffer {} of {}", p.buf, full.len());
                };
                let n = p.shape.iter().product();
                buf.narrow(0, p.off, n)?.reshape(p.shape.as_slice())
            })
            .collect()
    }

    /// Tensor `i`'s (offset in its flat buffer, shape), that buffer's shard and where the
    /// shard starts in it (rank · s). (`Shards::write_pads` reads it: CUDA builds.)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn part(&self, i: usize) -> Option<(usize, &[usize], &Tensor, usize)> {
        let p = self.parts.get(i)?;
        let b = self.bufs.get(p.buf)?;
        Some((p.off, p.shape.as_slice(), &b.shard, b.lo))
    }

    /// This rank's [s] slices, one per dtype (the group's base dtype first).
    pub fn shards(&self) -> impl Iterator<Item = &Tensor> {
        self.bufs.iter().map(|b| &b.shard)
    }

    /// Bytes the shards' storage really holds (not just their views' elements).
    pub(crate) fn shard_bytes(&self) -> usize {
        self.bufs.iter().map(|b| storage_bytes(&b.shard)).sum()
    }

    /// The group's bytes unsharded (no padding; alignment gaps counted).
    pub(crate) fn full_bytes(&self) -> usize {
        self.bufs
            .iter()
            .map(|b| b.len * b.shard.dtype().size_in_bytes())
            .sum()
    }
}

/// Bytes of the storage behind `t`, which may be more than its view's elements: a narrow
/// keeps its whole buffer alive. Floats and u8 (NF4 codes) on the CPU and on CUDA, u32 on the
/// CPU; else the view's size.
pub(crate) fn storage_bytes(t: &Tensor) -> usize {
    use candle_core::{CpuStorage, Storage};
    let (s, _) = t.storage_and_layout();
    let size = t.dtype().size_in_bytes();
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::BF16(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::F16(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::F64(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::U8(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::U32(v)) => v.len() * size,
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => {
            let n = match t.dtype() {
                candle_core::DType::F32 => c.as_cuda_slice::<f32>().map(|x| x.len()),
                candle_core::DType::BF16 => c.as_cuda_slice::<half::bf16>().map(|x| x.len()),
                candle_core::DType::F16 => c.as_cuda_slice::<half::f16>().map(|x| x.len()),
                candle_core::DType::U8 => c.as_cuda_slice::<u8>().map(|x| x.len()),
                _ => Ok(t.elem_count()),
            };
            n.unwrap_or(t.elem_count()) * size
        }
        _ => t.elem_count() * size,
    }
}
