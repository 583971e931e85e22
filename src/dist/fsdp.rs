//! FSDP: the frozen base flat-sharded over the ranks, gathered one group at a time.
//!
//! A group is one decoder layer's frozen tensors (`Layer::frozen_mut` order), or the embedding,
//! final norm and head (`Model::io_mut` order). Its tensors are flattened into one buffer in the
//! base dtype, padded to a multiple of N = world, and rank r keeps elements [r·s, (r+1)·s),
//! s = padded / N (llm.c's `multi_gpu_get_shard_offset`, with padding instead of refusing).
//! To use a group, the ranks all-gather their shards into a fresh [N·s] buffer, and the group's
//! tensors become `narrow` + `reshape` views into it (ops accept views with a storage offset);
//! the buffer is freed when the last view is dropped.
//!
//! The model keeps the LoRA `Var`s; the skeleton layer's frozen tensors are 1-element
//! placeholders, and a gathered layer is a clone of the skeleton (same `Var`s) with the views
//! put back.

use super::Comm;
use crate::model::{Layer, Model};
use candle_core::{Result, Tensor, TensorId};
use std::collections::HashSet;

/// One group's shard and the layout of the full buffer.
pub struct Flat {
    /// [s] in the base dtype: this rank's slice of the padded flat buffer.
    shard: Tensor,
    /// (offset in the flat buffer, shape) of each tensor of the group, in order.
    parts: Vec<(usize, Vec<usize>)>,
    /// Elements before padding.
    len: usize,
}

impl Flat {
    /// Flattens `tensors`, keeps this rank's 1/N (a copy, so the full buffer is freed) and
    /// replaces each tensor with a 1-element placeholder.
    pub fn take(tensors: Vec<&mut Tensor>, comm: &dyn Comm) -> Result<Flat> {
        let (rank, world) = (comm.rank(), comm.world());
        let Some(first) = tensors.first() else {
            candle_core::bail!("fsdp: a group with no tensors");
        };
        let (dtype, dev) = (first.dtype(), first.device().clone());
        let mut parts = Vec::with_capacity(tensors.len());
        let mut flat = Vec::with_capacity(tensors.len() + 1);
        let mut len = 0;
        for t in &tensors {
            if t.dtype() != dtype {
                candle_core::bail!(
                    "fsdp: mixed dtypes {:?} and {:?} in a group",
                    dtype,
                    t.dtype()
                );
            }
            parts.push((len, t.dims().to_vec()));
            len += t.elem_count();
            flat.push(t.flatten_all()?);
        }
        let s = len.div_ceil(world);
        if s * world > len {
            flat.push(Tensor::zeros(s * world - len, dtype, &dev)?);
        }
        // force_contiguous: a real [s] buffer (`copy` of a view clones the whole storage).
        let shard = Tensor::cat(&flat, 0)?
            .narrow(0, rank * s, s)?
            .force_contiguous()?;
        drop(flat);
        let placeholder = Tensor::zeros(1, dtype, &dev)?;
        for t in tensors {
            *t = placeholder.clone();
        }
        Ok(Flat { shard, parts, len })
    }

    /// The group's tensors as views into the gathered [N·s] buffer, in `take` order.
    /// `ahead`: issued early (`Comm::all_gather_ahead`); call `Comm::gathered` before use.
    pub fn gather(&self, comm: &dyn Comm, ahead: bool) -> Result<Vec<Tensor>> {
        let full = match ahead {
            true => comm.all_gather_ahead(&self.shard)?,
            false => comm.all_gather(&self.shard)?,
        }; // [N·s]
        self.parts
            .iter()
            .map(|(off, shape)| {
                let n = shape.iter().product();
                full.narrow(0, *off, n)?.reshape(shape.as_slice())
            })
            .collect()
    }

    /// Bytes the shard's storage really holds (not just its view's elements).
    pub fn shard_bytes(&self) -> usize {
        storage_bytes(&self.shard)
    }

    /// The group's bytes unsharded (no padding).
    pub fn full_bytes(&self) -> usize {
        self.len * self.shard.dtype().size_in_bytes()
    }
}

/// A model's shards: one `Flat` per decoder layer, then the embedding / norm / head group.
pub struct Shards {
    pub layers: Vec<Flat>,
    pub io: Flat,
    /// The ranks copy each other's shards in (`Comm::share_static`) rather than gather them
    /// with a collective.
    pub peer_copies: bool,
}

impl Shards {
    /// Splits the groups `Model::load_with` handed over (layers in order, io last), and
    /// tells the comm that the shards are static (`Comm::share_static`: every rank calls this).
    pub fn from_groups(
        mut groups: Vec<Flat>,
        num_layers: usize,
        comm: &dyn Comm,
    ) -> Result<Shards> {
        if groups.len() != num_layers + 1 {
            candle_core::bail!(
                "fsdp: {} groups for {num_layers} layers + embedding/head",
                groups.len()
            );
        }
        let Some(io) = groups.pop() else {
            candle_core::bail!("fsdp: no embedding/head group");
        };
        let mut shards = Shards {
            layers: groups,
            io,
            peer_copies: false,
        };
        let all: Vec<&Tensor> = shards
            .layers
            .iter()
            .chain([&shards.io])
            .map(|f| &f.shard)
            .collect();
        let peer_copies = comm.share_static(&all)?;
        shards.peer_copies = peer_copies;
        Ok(shards)
    }

    /// Layer `l` with its frozen tensors gathered (its LoRA `Var`s are the model's);
    /// `ahead` as in `Flat::gather`.
    pub fn layer(&self, model: &Model, l: usize, comm: &dyn Comm, ahead: bool) -> Result<Layer> {
        let (Some(skeleton), Some(flat)) = (model.layers.get(l), self.layers.get(l)) else {
            candle_core::bail!("fsdp: no layer {l}");
        };
        let mut layer = skeleton.clone();
        let views = flat.gather(comm, ahead)?;
        let mut slots = layer.frozen_mut();
        if slots.len() != views.len() {
            candle_core::bail!(
                "fsdp: layer {l} has {} frozen tensors, its shard {}",
                slots.len(),
                views.len()
            );
        }
        for (slot, v) in slots.iter_mut().zip(views) {
            **slot = v;
        }
        drop(slots);
        Ok(layer)
    }

    /// The embedding, final norm and head gathered, as a layer-less model; `ahead` as in
    /// `Flat::gather`.
    pub fn io(&self, model: &Model, comm: &dyn Comm, ahead: bool) -> Result<Model> {
        model.io_view(self.io.gather(comm, ahead)?)
    }

    /// This rank's resident shard bytes.
    pub fn shard_bytes(&self) -> usize {
        self.layers.iter().map(Flat::shard_bytes).sum::<usize>() + self.io.shard_bytes()
    }

    /// The largest gathered group: what one materialised layer (or the head) adds.
    pub fn largest_group_bytes(&self) -> usize {
        self.layers
            .iter()
            .chain([&self.io])
            .map(Flat::full_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// Frozen base bytes resident on this rank outside any gather: the model's frozen tensors
/// (each storage counted once; FSDP placeholders are 1 element) plus its shards.
pub fn resident_base_bytes(model: &Model, shards: Option<&Shards>) -> usize {
    let mut seen: HashSet<TensorId> = HashSet::new();
    let mut bytes = 0;
    for t in model.base_tensors() {
        if seen.insert(t.id()) {
            bytes += storage_bytes(t);
        }
    }
    bytes + shards.map_or(0, Shards::shard_bytes)
}

/// Bytes of the storage behind `t`, which may be more than its view's elements: a narrow
/// keeps its whole buffer alive. Floats on the CPU and on CUDA; else the view's size.
pub fn storage_bytes(t: &Tensor) -> usize {
    use candle_core::{CpuStorage, Storage};
    let (s, _) = t.storage_and_layout();
    let size = t.dtype().size_in_bytes();
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::BF16(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::F16(v)) => v.len() * size,
        Storage::Cpu(CpuStorage::F64(v)) => v.len() * size,
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => {
            let n = match t.dtype() {
                candle_core::DType::F32 => c.as_cuda_slice::<f32>().map(|x| x.len()),
                candle_core::DType::BF16 => c.as_cuda_slice::<half::bf16>().map(|x| x.len()),
                candle_core::DType::F16 => c.as_cuda_slice::<half::f16>().map(|x| x.len()),
                _ => Ok(t.elem_count()),
            };
            n.unwrap_or(t.elem_count()) * size
        }
        _ => t.elem_count() * size,
    }
}
