//! The KV cache: per layer a key and a value buffer [1, K, cap, D] in the activation dtype,
//! allocated once for the positions a generation may reach; each step writes its token's rows
//! in place (no concatenation per token). It grows (a new buffer, the old rows copied: once per
//! chat turn at most) only when a longer conversation asks for it; the rotary tables
//! [1, cap, D/2] for the same positions live beside it.

use crate::model::rope;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub struct KvCache {
    /// Per layer: (keys, values), each [1, K, cap, D]; positions < `len` are written.
    pub kv: Vec<(Tensor, Tensor)>,
    /// cos and sin of every position < cap: [1, cap, D/2] f32.
    pub cos: Tensor,
    pub sin: Tensor,
    /// The token ids whose keys and values the cache holds, in position order.
    pub ids: Vec<u32>,
    cap: usize,
    /// The most positions it may ever hold (max_position_embeddings).
    limit: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    inv_freq: Vec<f32>,
}

impl KvCache {
    /// An empty cache for `cap` positions (at most `limit`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        cap: usize,
        limit: usize,
        inv_freq: Vec<f32>,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let mut c = KvCache {
            kv: Vec::new(),
            cos: Tensor::zeros((1, 0, head_dim / 2), DType::F32, device)?,
            sin: Tensor::zeros((1, 0, head_dim / 2), DType::F32, device)?,
            ids: Vec::new(),
            cap: 0,
            limit,
            layers,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
            inv_freq,
        };
        c.reserve(cap)?;
        Ok(c)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes the buffers hold.
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.kv_heads * self.cap * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Forgets positions ≥ `n` (their rows are overwritten by the next tokens).
    pub fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
    }

    /// Room for `n` positions: grows to max(n, 2 × cap) (at most the limit), copying the rows
    /// written so far. An error past the limit.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
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
        let positions: Vec<u32> = (0..cap as u32).collect();
        let (cos, sin) = rope::cos_sin(&self.inv_freq, &positions, 1, cap, &self.device)?;
        (self.cos, self.sin) = (cos, sin);
        self.cap = cap;
        Ok(())
    }
}
