//! A MoE layer's router, as Qwen3-MoE's `Qwen3MoeTopKRouter`: logits = hn Wᵀ, a softmax over
//! all experts in f32, the top k of those probabilities (renormalised to sum to 1 with
//! `norm_topk_prob`), and the tokens grouped by expert for the experts' GEMMs. gpt-oss's
//! (`GptOssTopKRouter`): logits = hn Wᵀ + b, the top k of the logits, a softmax over those k.
//!
//! The grouping is made on the host from the [m, k] chosen experts (one small copy per layer:
//! m·k u32): the flat positions p = n·k + j of the (token n, slot j) pairs, expert 0's first,
//! then expert 1's, ..., ascending within each; their tokens n; how many each expert got; and
//! where each (token, slot) pair went. Every expert's rows are then one contiguous run of a
//! gathered [m·k, C] input, so each expert is one GEMM over its run (no loop over tokens); its
//! outputs come back to their tokens through the slot-major map (`ops::moe_rows::combine`),
//! not by index_add (candle's CUDA index_add walks all m·k rows in turn, one thread per
//! column: a serial loop of 32768 steps at 4096 tokens and top 8).
//!
//! The copy waits for every kernel queued before it: the device idles until the host has
//! grouped, uploaded and queued the experts' work. A layer's forward therefore keeps its
//! grouping (`RouteStore`, 16·k bytes a token) for its backward, which recomputes the
//! probabilities on the device and reads nothing: one read a layer a step, not two.
//!
//! Shapes: m tokens, C hidden, E experts, k experts per token.

use super::family::MoeSpec;
use candle_core::{DType, Result, Tensor, D};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Nanoseconds and count of the routing's reads of the chosen experts, process-wide: each read
/// waits for the device to finish all the work queued before it (`bench`'s `route_wait_s`).
static READS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// (seconds the routing's reads have waited, how many reads) so far in this process.
pub fn routing_reads() -> (f64, u64) {
    let ns = READS[0].load(Ordering::Relaxed);
    (ns as f64 * 1e-9, READS[1].load(Ordering::Relaxed))
}

/// One batch's routing through one layer.
pub(crate) struct Routing {
    /// Softmax of the router logits over all experts [m, E] f32.
    pub(crate) probs: Tensor,
    /// The chosen experts [m, k] u32, by descending probability.
    pub(crate) idx: Tensor,
    /// Their weights [m, k] f32: the probabilities, renormalised with `norm_topk`.
    pub(crate) weights: Tensor,
    /// The (token, slot) positions p = n·k + j grouped by expert [m·k] u32.
    pub(crate) order: Tensor,
    /// Each grouped position's token n = p / k [m·k] u32.
    pub(crate) tokens: Tensor,
    /// The grouped row of (token n, slot j) at j·m + n [k·m] u32 (slot-major), so that
    /// `grouped.index_select(slots)` is k runs of m rows, one per slot.
    pub(crate) slots: Tensor,
    /// Tokens per expert [E] (the runs of `order`, in expert order).
    pub(crate) counts: Vec<usize>,
    /// The weights are the softmax over the top-k logits (gpt-oss), not the top-k of the
    /// softmax over all experts.
    pub(crate) topk_softmax: bool,
}

/// What the host's read of the chosen experts makes of them: the grouping by expert, the
/// routing's only data-dependent sizes. A layer's forward keeps it for its backward
/// (`RouteStore`), so the backward's routing reads nothing from the device.
#[derive(Clone)]
pub(crate) struct Grouping {
    /// [m, k] u32 (`Routing::idx`)
    idx: Tensor,
    /// [m·k] u32 each (`Routing`'s fields of the same names)
    order: Tensor,
    tokens: Tensor,
    slots: Tensor,
    counts: Vec<usize>,
}

impl Grouping {
    /// Bytes it holds on the device: four [m·k] u32 tensors.
    pub(crate) fn bytes_per_token(top_k: usize) -> u64 {
        16 * top_k as u64
    }
}

/// Each MoE layer's grouping, from its forward to its backward, in one micro-batch's `Ctx`.
#[derive(Default)]
pub(crate) struct RouteStore(Mutex<HashMap<usize, Grouping>>);

impl RouteStore {
    /// Keeps layer `layer`'s grouping (a later forward of it replaces it).
    pub(crate) fn keep(&self, layer: usize, g: Grouping) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(layer, g);
        }
    }

    /// Layer `layer`'s kept grouping, taken out (None: route afresh).
    pub(crate) fn take(&self, layer: usize) -> Option<Grouping> {
        self.0.lock().ok().and_then(|mut m| m.remove(&layer))
    }
}

/// Routes hn [m, C] with the router's W [E, C] and bias [E] (gpt-oss). Differentiable in hn
/// (the reference forward's autograd graph; the indices carry no gradient). With `kept` (the
/// same hn's grouping, from the layer's forward) the device is not read.
pub(crate) fn route(
    hn: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    spec: MoeSpec,
    kept: Option<Grouping>,
) -> Result<Routing> {
    let (m, k) = (hn.dim(0)?, spec.top_k);
    let logits = hn.matmul(&w.t()?)?; // [m, E]
    let logits = match bias {
        Some(b) => logits.broadcast_add(b)?,
        None => logits,
    }
    .to_dtype(DType::F32)?;
    let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
    let topk_softmax = spec.oss.is_some();
    let g = match kept {
        Some(g) => g,
        None => {
            // the top k, by descending logit (gpt-oss) or probability (ties, measure zero on
            // real inputs, either way)
            let by = match topk_softmax {
                true => &logits,
                false => &probs,
            };
            let idx = by
                .detach()
                .arg_sort_last_dim(false)?
                .narrow(1, 0, k)?
                .contiguous()?; // [m, k]
            grouping(idx, m, spec)?
        }
    };
    let idx = &g.idx;
    let weights = match (topk_softmax, spec.norm_topk) {
        (true, _) => candle_nn::ops::softmax(&logits.gather(idx, 1)?, D::Minus1)?,
        (false, true) => {
            let top = probs.gather(idx, 1)?; // [m, k]
            top.broadcast_div(&top.sum_keepdim(1)?)?
        }
        (false, false) => probs.gather(idx, 1)?,
    };
    Ok(Routing {
        probs,
        idx: g.idx,
        weights,
        order: g.order,
        tokens: g.tokens,
        slots: g.slots,
        counts: g.counts,
        topk_softmax,
    })
}

impl Routing {
    /// Its grouping, to keep for the layer's backward (handles: no copy).
    pub(crate) fn grouping(&self) -> Grouping {
        Grouping {
            idx: self.idx.clone(),
            order: self.order.clone(),
            tokens: self.tokens.clone(),
            slots: self.slots.clone(),
            counts: self.counts.clone(),
        }
    }
}

/// The chosen experts idx [m, k] grouped on the host: one read of the device (which waits
/// for all the work queued before it), then the grouping's three uploads.
fn grouping(idx: Tensor, m: usize, spec: MoeSpec) -> Result<Grouping> {
    let k = spec.top_k;
    let t0 = Instant::now();
    let chosen: Vec<u32> = idx.flatten_all()?.to_vec1()?;
    let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    READS[0].fetch_add(ns, Ordering::Relaxed);
    READS[1].fetch_add(1, Ordering::Relaxed);
    let (order, counts) = group(&chosen, spec.experts)?;
    let tokens: Vec<u32> = order.iter().map(|&p| p / k as u32).collect();
    let slots = slot_major(&order, m, k);
    let dev = idx.device().clone();
    debug_assert_eq!(order.len(), m * k);
    Ok(Grouping {
        idx,
        order: Tensor::from_vec(order, m * k, &dev)?,
        tokens: Tensor::from_vec(tokens, m * k, &dev)?,
        slots: Tensor::from_vec(slots, m * k, &dev)?,
        counts,
    })
}

/// The flat positions of `chosen` ([m·k] expert ids) grouped by expert, ascending within an
/// expert, and each expert's count (a counting sort).
fn group(chosen: &[u32], experts: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let mut counts = vec![0usize; experts];
    for &e in chosen {
        match counts.get_mut(e as usize) {
            Some(c) => *c += 1,
            None => candle_core::bail!("router chose expert {e} of {experts}"),
        }
    }
    let mut start: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let s = *acc;
            *acc += c;
            Some(s)
        })
        .collect();
    let mut order = vec![0u32; chosen.len()];
    for (p, &e) in chosen.iter().enumerate() {
        order[start[e as usize]] = p as u32;
        start[e as usize] += 1;
    }
    Ok((order, counts))
}

/// For each (token n, slot j), at j·m + n, the grouped row q whose position `order[q]` is
/// n·k + j.
fn slot_major(order: &[u32], m: usize, k: usize) -> Vec<u32> {
    let mut slots = vec![0u32; order.len()];
    for (q, &p) in order.iter().enumerate() {
        let (n, j) = (p as usize / k, p as usize % k);
        slots[j * m + n] = q as u32;
    }
    slots
}

/// The router's backward: dL/dweights [m, k] f32 → dL/dlogits [m, E] f32, through the
/// renormalisation (with `norm_topk`), the top-k gather and the softmax. `dprobs_extra`
/// ([m, E] or [1, E] f32) is a gradient on the probabilities besides (the load-balancing
/// loss's).
pub(crate) fn route_bwd(
    r: &Routing,
    dweights: &Tensor,
    norm_topk: bool,
    dprobs_extra: Option<&Tensor>,
) -> Result<Tensor> {
    if r.topk_softmax {
        // w = softmax(z_top): dz_top = w ⊙ (dw − Σ w ⊙ dw), scattered back to the experts
        if dprobs_extra.is_some() {
            candle_core::bail!("a load-balancing loss on a top-k-softmax router (gpt-oss)");
        }
        let dot = (dweights * &r.weights)?.sum_keepdim(1)?;
        let dtop = (dweights.broadcast_sub(&dot)? * &r.weights)?;
        return r.probs.zeros_like()?.scatter_add(&r.idx, &dtop, 1);
    }
    let top = r.probs.gather(&r.idx, 1)?; // [m, k]
    let dtop = match norm_topk {
        // w = v / S, S = Σ v: dv = (dw − Σ dw ⊙ w) / S
        true => {
            let sum = top.sum_keepdim(1)?; // [m, 1]
            let w = top.broadcast_div(&sum)?;
            let dot = (dweights * &w)?.sum_keepdim(1)?;
            dweights.broadcast_sub(&dot)?.broadcast_div(&sum)?
        }
        false => dweights.clone(),
    };
    let dprobs = r.probs.zeros_like()?.scatter_add(&r.idx, &dtop, 1)?; // [m, E]
    let dprobs = match dprobs_extra {
        Some(g) => dprobs.broadcast_add(g)?,
        None => dprobs,
    };
    // softmax: dz = p ⊙ (dp − Σ p ⊙ dp)
    let dot = (&dprobs * &r.probs)?.sum_keepdim(1)?;
    dprobs.broadcast_sub(&dot)? * &r.probs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::family::OssMoe;
    use candle_core::Device;

    /// A kept grouping gives the routing a fresh read gives (Qwen3-MoE's and gpt-oss's
    /// routers); that the backward takes it, not a read: tests/it/moe.rs's route_reads.
    #[test]
    fn a_kept_grouping_routes_as_a_fresh_read() {
        let dev = Device::Cpu;
        let (m, c, e) = (6, 8, 5);
        let hn = Tensor::randn(0f32, 1.0, (m, c), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (e, c), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, e, &dev).unwrap();
        for oss in [false, true] {
            let spec = MoeSpec {
                experts: e,
                top_k: 2,
                inter: 4,
                norm_topk: !oss,
                oss: oss.then_some(OssMoe {
                    alpha: 1.702,
                    limit: 7.0,
                }),
            };
            let bias = oss.then_some(&b);
            let fresh = route(&hn, &w, bias, spec, None).unwrap();
            let kept = route(&hn, &w, bias, spec, Some(fresh.grouping())).unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let u = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u32>().unwrap();
            assert_eq!(v(&kept.weights), v(&fresh.weights));
            assert_eq!(v(&kept.probs), v(&fresh.probs));
            for (a, b) in [
                (&kept.idx, &fresh.idx),
                (&kept.order, &fresh.order),
                (&kept.tokens, &fresh.tokens),
                (&kept.slots, &fresh.slots),
            ] {
                assert_eq!(u(a), u(b));
            }
            assert_eq!(kept.counts, fresh.counts);
            assert_eq!(kept.counts.iter().sum::<usize>(), m * 2);
        }
    }

    #[test]
    fn groups_positions_by_expert() {
        // m = 3 tokens, k = 2: token 0 → (2, 0), token 1 → (1, 2), token 2 → (2, 1); expert 3
        // gets none
        let (order, counts) = group(&[2, 0, 1, 2, 2, 1], 4).unwrap();
        assert_eq!(counts, vec![1, 2, 3, 0]);
        assert_eq!(order, vec![1, 2, 5, 0, 3, 4]);
        // slot 0 of tokens 0, 1, 2 (positions 0, 2, 4), then slot 1 (1, 3, 5)
        assert_eq!(slot_major(&order, 3, 2), vec![3, 1, 5, 0, 4, 2]);
        assert!(group(&[4], 4).is_err());
    }
}
