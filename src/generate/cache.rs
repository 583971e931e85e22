//! The KV cache: per layer a key and a value buffer [1, K, cap, D] in the activation dtype,
//! allocated once for the positions a generation may reach; each step writes its token's rows
//! in place (no concatenation per token). It grows (a new buffer, the old rows copied: once per
//! chat turn at most) only when a longer conversation asks for it; the rotary tables
//! [1, cap, D/2] for the same positions live beside it (`RopeTables`).

use crate::model::rope::Freqs;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// cos and sin [1, cap, D/2] f32 of one RoPE at every position < cap, × its attention factor.
///
/// LongRoPE (Phi-3) rotates a forward's tokens with the long table when the forward reaches
/// past original_max_position, else with the short one (transformers' rotary switches on
/// max(position_ids) + 1); the keys already cached keep the rotation of the call that wrote
/// them, as in transformers' forward with its cache and in vLLM. A call of several tokens
/// takes `short` or `long` by its reach; a one-token call at position p takes `step`'s row p
/// (long from original_max_position on), which a captured graph can read at every position.
pub(crate) struct RopeTables {
    freqs: Freqs,
    pub(crate) short: (Tensor, Tensor),
    /// LongRoPE only: the long table's, and the one-token calls'.
    pub(crate) long: Option<(Tensor, Tensor)>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) step: Option<(Tensor, Tensor)>,
}

impl RopeTables {
    /// The tables of positions 0..cap (none yet for cap = 0: `KvCache::reserve` makes them).
    fn new(freqs: Freqs, cap: usize, head_dim: usize, device: &Device) -> Result<RopeTables> {
        if cap == 0 {
            let none = Tensor::zeros((1, 0, head_dim / 2), DType::F32, device)?;
            return Ok(RopeTables {
                freqs,
                short: (none.clone(), none),
                long: None,
                step: None,
            });
        }
        let positions: Vec<u32> = (0..cap as u32).collect();
        let at = |long| freqs.cos_sin_of(long, &positions, 1, cap, device);
        let short = at(false)?;
        let (long, step) = match freqs.long_from() {
            None => (None, None),
            Some(orig) => {
                let long = at(true)?;
                let n = orig.min(cap);
                let join = |s: &Tensor, l: &Tensor| -> candle_core::Result<Tensor> {
                    Tensor::cat(&[s.narrow(1, 0, n)?, l.narrow(1, n, cap - n)?], 1)
                };
                let step = (join(&short.0, &long.0)?, join(&short.1, &long.1)?);
                (Some(long), Some(step))
            }
        };
        Ok(RopeTables {
            freqs,
            short,
            long,
            step,
        })
    }

    /// cos and sin [1, t, D/2] of positions p0.. in a call that reaches `reach`.
    pub(crate) fn rows(&self, p0: usize, t: usize, reach: usize) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = match (&self.long, self.freqs.is_long(reach)) {
            (Some(long), true) => long,
            _ => &self.short,
        };
        Ok((cos.narrow(1, p0, t)?, sin.narrow(1, p0, t)?))
    }

    /// The tables a one-token call reads at its position (`step`, or the only ones).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn one_token(&self) -> (&Tensor, &Tensor) {
        let (cos, sin) = self.step.as_ref().unwrap_or(&self.short);
        (cos, sin)
    }
}

pub(crate) struct KvCache {
    /// Per layer: (keys, values), each [1, K, cap, D]; positions < `len` are written.
    pub(crate) kv: Vec<(Tensor, Tensor)>,
    /// The global RoPE's tables, and the sliding layers' where they differ (Gemma 3).
    pub(crate) rope: RopeTables,
    pub(crate) rope_local: Option<RopeTables>,
    /// The token ids whose keys and values the cache holds, in position order.
    pub(crate) ids: Vec<u32>,
    cap: usize,
    /// The most positions it may ever hold (max_position_embeddings).
    limit: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl KvCache {
    /// An empty cache for `cap` positions (at most `limit`), with the tables of `rope` (the
    /// global RoPE's frequencies, and the sliding layers' where they differ).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        cap: usize,
        limit: usize,
        rope: (&Freqs, Option<&Freqs>),
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let mut c = KvCache {
            kv: Vec::new(),
            rope: RopeTables::new(rope.0.clone(), 0, head_dim, device)?,
            rope_local: match rope.1 {
                Some(f) => Some(RopeTables::new(f.clone(), 0, head_dim, device)?),
                None => None,
            },
            ids: Vec::new(),
            cap: 0,
            limit,
            layers,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        };
        c.reserve(cap)?;
        Ok(c)
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Forgets positions ≥ `n` (their rows are overwritten by the next tokens).
    pub(crate) fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
    }

    /// Room for `n` positions: grows to max(n, 2 × cap) (at most the limit), copying the rows
    /// written so far. An error past the limit.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        if n <= self.cap {
            return Ok(());
        }
        if n > self.limit {
            bail!(
                "{n} positions are past the model's max_position_embeddings {}",
                self.limit
            );
        }
        let cap = n.max(2 * self.cap).min(self.limit);
        let (k, d) = (self.kv_heads, self.head_dim);
        let mut kv = Vec::with_capacity(self.layers);
        for l in 0..self.layers {
            let kc = Tensor::zeros((1, k, cap, d), self.dtype, &self.device)?;
            let vc = Tensor::zeros((1, k, cap, d), self.dtype, &self.device)?;
            if let (Some((ko, vo)), true) = (self.kv.get(l), !self.ids.is_empty()) {
                let n = self.ids.len();
                kc.slice_set(&ko.narrow(2, 0, n)?.contiguous()?, 2, 0)?;
                vc.slice_set(&vo.narrow(2, 0, n)?.contiguous()?, 2, 0)?;
            }
            kv.push((kc, vc));
        }
        self.kv = kv;
        self.rope = RopeTables::new(self.rope.freqs.clone(), cap, d, &self.device)?;
        if let Some(local) = &self.rope_local {
            self.rope_local = Some(RopeTables::new(local.freqs.clone(), cap, d, &self.device)?);
        }
        self.cap = cap;
        Ok(())
    }

    /// The tables of a layer: the sliding layers' own when `local` and the model has them.
    pub(crate) fn tables(&self, local: bool) -> &RopeTables {
        match (&self.rope_local, local) {
            (Some(t), true) => t,
            _ => &self.rope,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::family::Rope;
    use crate::model::RopeScaling;

    /// LongRoPE's tables: a call reaching past original_max_position takes the long table for
    /// all its rows, one reaching no further the short one; a one-token call at position p
    /// takes the short row below original_max_position and the long row from there.
    #[test]
    fn longrope_tables_switch_on_the_reach_and_one_token_rows_by_position() {
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::LongRope {
                short: vec![1.0, 2.0],
                long: vec![4.0, 8.0],
                original_max_position: 3,
                attention_factor: 1.5,
            },
        };
        let dev = Device::Cpu;
        let t = RopeTables::new(Freqs::new(4, &rope), 6, 4, &dev).unwrap();
        let rows = |x: &Tensor| x.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let (short, long) = (rows(&t.short.0), rows(&t.long.as_ref().unwrap().0));
        assert_ne!(short[2], long[2]);
        assert!(
            (short[0][0] - 1.5).abs() < 1e-6,
            "cos(0) × the attention factor"
        );
        let (cos, _) = t.rows(1, 2, 3).unwrap(); // reaches 3 = original: short
        assert_eq!(rows(&cos), short[1..3].to_vec());
        let (cos, _) = t.rows(1, 2, 4).unwrap(); // reaches 4: long, the earlier rows too
        assert_eq!(rows(&cos), long[1..3].to_vec());
        let step = rows(t.one_token().0);
        assert_eq!(step[..3], short[..3]);
        assert_eq!(step[3..], long[3..]);
        // Any other RoPE has one table.
        let plain = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let t = RopeTables::new(Freqs::new(4, &plain), 6, 4, &dev).unwrap();
        assert!(t.long.is_none() && t.step.is_none());
        assert_eq!(rows(t.one_token().0), rows(&t.rows(0, 6, 100).unwrap().0));
    }
}
