//! FSDP's model side: a model's frozen base as one flat-sharded group per decoder layer plus
//! the embedding / norm / head group (train::flat holds their bytes, parallel/ moves them), a gathered group made
//! back into a layer, and the folded linears' B's written into the shards before each
//! micro-batch (see train::flat for the layout).

use super::comm::Comm;
use super::flat::{storage_bytes, Flat};
use crate::model::{Layer, Model};
use candle_core::{Result, Tensor, TensorId};
use std::collections::HashSet;

/// A model's shards: one `Flat` per decoder layer, then the embedding / norm / head group.
pub struct Shards {
    /// One `Flat` per decoder layer, bottom first.
    pub layers: Vec<Flat>,
    pub(crate) io: Flat,
    /// The ranks copy each other's shards in (`Comm::share_static`) rather than gather them
    /// with a collective.
    pub(crate) peer_copies: bool,
    /// The decoder linears' NF4 bytes, unsharded (`Layer::nf4_bytes` as they loaded; the
    /// skeleton's are placeholders): what the load line reports.
    pub nf4_bytes: usize,
}

impl Shards {
    /// Splits the groups `Model::load_with` handed over (layers in order, io last), and under
    /// the `peer_copy` experiment (`kernels.experiments`) tells the comm that the shards are
    /// static (`Comm::share_static`: every rank calls this, with the same kernels).
    pub fn from_groups(
        mut groups: Vec<Flat>,
        num_layers: usize,
        kernels: &crate::ops::Kernels,
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
            nf4_bytes: 0,
        };
        let all: Vec<&Tensor> = shards
            .layers
            .iter()
            .chain([&shards.io])
            .flat_map(Flat::shards)
            .collect();
        if kernels.experiments.peer_copy {
            shards.peer_copies = comm.share_static(&all)?;
        }
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
        layer.sync_views()?;
        Ok(layer)
    }

    /// Every folded linear's B (`ops::fold`) rounded to bf16 into the pad columns of the W*
    /// rows that lie in this rank's shards, in one launch: the skeleton's folded linears are
    /// padded, so their gathered W* must carry this batch's B's (`Model::write_pads` for an
    /// unsharded model). Whether they do: false when nothing is folded, or a B or a shard is
    /// not where the kernel takes it (then nothing runs folded).
    ///
    /// Peers read these shards in their gathers. A write lands on the compute stream before
    /// the micro-batch's first gather; the peers' last reads of the step before ended before
    /// their share of the step's gradient sums, which this rank's optimizer step waited for;
    /// within a step the B's do not change, so the bytes rewritten are the bytes there.
    pub fn write_pads(&self, model: &Model) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = &model.device {
            use crate::ops::multi_tensor::{cast_rows_bf16, f32_addr, MultiT};
            let mut table = Vec::new();
            let mut padded = false;
            for (layer, flat) in model.layers.iter().zip(&self.layers) {
                for (i, lin) in layer.frozen_linears().into_iter().enumerate() {
                    let (Some(lin), Some((off, shape, shard, lo))) = (lin, flat.part(i)) else {
                        continue;
                    };
                    let (Some(pad), Some(lora)) = (&lin.pad, &lin.lora) else {
                        continue;
                    };
                    padded = true;
                    let (&[out, ld], r) = (shape, lora.b.dim(1)?) else {
                        return Ok(false);
                    };
                    let (col0, hi) = (pad.in_f + pad.col, lo + shard.elem_count());
                    let (Some(g), Some(p)) = (f32_addr(&lora.b)?, crate::ops::cuda::addr(shard)?)
                    else {
                        return Ok(false);
                    };
                    if shard.dtype() != candle_core::DType::BF16
                        || lora.b.dim(0)? != out
                        || col0 + r > ld
                    {
                        return Ok(false);
                    }
                    for run in pad_runs(off, out, ld, col0, r, lo, hi) {
                        table.push(MultiT {
                            p: p + 2 * run.dst as u64,
                            g: g + 4 * run.src as u64,
                            m: run.width as u64,
                            v: ld as u64,
                            n: (run.width * run.rows) as i64,
                        });
                    }
                }
            }
            if !padded {
                return Ok(false);
            }
            if !table.is_empty() {
                // SAFETY: each destination is `rows` runs of `width` elements, ld apart, inside
                // this rank's live bf16 shard (pad_runs clips them to it); runs of different
                // linears are different columns or rows. The B's are live f32 [out, r].
                unsafe { cast_rows_bf16(dev, &table)? };
            }
            return Ok(true);
        }
        let _ = model;
        Ok(false)
    }

    /// The embedding, final norm and head gathered, as a layer-less model; `ahead` as in
    /// `Flat::gather`.
    pub(crate) fn io(&self, model: &Model, comm: &dyn Comm, ahead: bool) -> Result<Model> {
        model.io_view(self.io.gather(comm, ahead)?)
    }

    /// This rank's resident shard bytes.
    pub(crate) fn shard_bytes(&self) -> usize {
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

/// A run of B's elements to round into a shard (`Shards::write_pads`): `rows` rows of
/// `width` elements, the first at shard element `dst` (the next ld further) and B element
/// `src` (the next r further).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PadRun {
    pub(crate) dst: usize,
    pub(crate) src: usize,
    pub(crate) width: usize,
    pub(crate) rows: usize,
}

/// The parts of a folded linear's B columns that lie in the shard [lo, hi) of its group's flat
/// buffer: W* [out, ld] starts at flat element `off`, B [out, r] goes to columns [col0,
/// col0 + r) of each row. At most three runs: the first row in the shard (maybe clipped), the
/// whole rows after it, the last row (maybe clipped).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn pad_runs(
    off: usize,
    out: usize,
    ld: usize,
    col0: usize,
    r: usize,
    lo: usize,
    hi: usize,
) -> Vec<PadRun> {
    // row's first B element in the flat buffer
    let start = |row: usize| off + row * ld + col0;
    // rows whose B columns end after lo, and start before hi
    let first = (lo + 1).saturating_sub(off + col0 + r).div_ceil(ld.max(1));
    let Some(last) = (hi.saturating_sub(1))
        .checked_sub(off + col0)
        .map(|x| (x / ld.max(1)).min(out.saturating_sub(1)))
    else {
        return Vec::new();
    };
    if out == 0 || r == 0 || hi <= lo || first > last {
        return Vec::new();
    }
    let clipped = |row: usize| {
        let s = start(row);
        let (j0, j1) = (lo.saturating_sub(s).min(r), (hi - s.min(hi)).min(r));
        (j0 < j1).then(|| PadRun {
            dst: s + j0 - lo,
            src: row * r + j0,
            width: j1 - j0,
            rows: 1,
        })
    };
    let mut runs: Vec<PadRun> = clipped(first).into_iter().collect();
    if last > first + 1 {
        runs.push(PadRun {
            dst: start(first + 1) - lo,
            src: (first + 1) * r,
            width: r,
            rows: last - first - 1,
        });
    }
    if last > first {
        runs.extend(clipped(last));
    }
    runs
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's runs, written into its shard, put each B element where writing B into the
    /// whole flat buffer does, and nothing anywhere else, for cut points that fall before,
    /// inside and after the B columns of a row, and shards smaller than a row.
    #[test]
    fn pad_runs_tile_the_b_columns_across_the_shards() {
        let mut cases = 0;
        for (off, out, ld, col0, r) in [
            (3, 5, 12, 8, 3),
            (0, 7, 16, 10, 6),
            (10, 4, 9, 5, 4),
            (1, 1, 8, 2, 5),
        ] {
            let len = off + out * ld + 5;
            // B element k is k + 1; 0 marks "not written".
            let mut want = vec![0u32; len];
            for row in 0..out {
                for j in 0..r {
                    want[off + row * ld + col0 + j] = (row * r + j + 1) as u32;
                }
            }
            for world in [1, 2, 3, 5, 7, len] {
                let s = len.div_ceil(world);
                let mut got = vec![0u32; s * world];
                for rank in 0..world {
                    let (lo, hi) = (rank * s, rank * s + s);
                    let runs = pad_runs(off, out, ld, col0, r, lo, hi);
                    assert!(runs.len() <= 3);
                    for run in runs {
                        for row in 0..run.rows {
                            for j in 0..run.width {
                                let d = run.dst + row * ld + j;
                                assert!(d < s, "rank {rank}: {run:?} leaves the shard");
                                assert_eq!(got[lo + d], 0, "written twice");
                                got[lo + d] = (run.src + row * r + j + 1) as u32;
                            }
                        }
                    }
                }
                assert_eq!(
                    &got[..len],
                    &want[..],
                    "off {off} out {out} ld {ld} world {world}"
                );
                assert!(got[len..].iter().all(|&x| x == 0), "written in the padding");
                cases += 1;
            }
        }
        assert_eq!(cases, 24);
    }
}
