//! What a merge writes: the shards of the merged model (each tensor the base's, merged, cast or
//! dequantized), its index and config, into a temporary directory renamed into place.

use super::*;
use crate::util::fs::sync_dir_files;

/// Shards of at most `max` bytes, greedy in checkpoint order (a larger tensor alone).
pub(super) fn shard_plan(items: &[Item], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut used = 0u64;
    for (i, it) in items.iter().enumerate() {
        if shards.is_empty() || (used + it.size > max && used > 0) {
            shards.push(Vec::new());
            used = 0;
        }
        used += it.size;
        if let Some(s) = shards.last_mut() {
            s.push(i);
        }
    }
    shards
}

/// A checked merge, ready to write.
pub(super) struct Job<'a> {
    pub(super) ckpt: &'a Base<'a>,
    pub(super) items: Vec<Item>,
    pub(super) adapted: Adapted,
    /// Per item, its slot among the experts' adapters (`check_adapter`).
    pub(super) slots: Vec<Option<experts::Slot>>,
    pub(super) shards: Vec<Vec<usize>>,
    pub(super) scale: f64,
    pub(super) opts: &'a MergeOptions,
}

impl Job<'_> {
    /// What the adapter goes into: "base" or "dequantized-nf4".
    pub(super) fn merged_into(&self) -> &'static str {
        match self.ckpt.packed.is_some() || self.opts.merge_into == MergeInto::Dequantized {
            true => "dequantized-nf4",
            false => "base",
        }
    }

    pub(super) fn shard_name(&self, k: usize) -> String {
        match self.shards.len() {
            1 => "model.safetensors".to_string(),
            n => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
        }
    }

    /// The merged model into `tmp`: shards, index, config.json and the copied files.
    pub(super) fn write(&self, tmp: &Path, out: &Path) -> Result<MergeReport> {
        let mut weight_map = BTreeMap::new();
        let (mut total_size, mut merged, mut dequantized) = (0u64, 0, 0);
        let bar = crate::export::progress::ShardBar::new(self.shards.len());
        for (k, shard) in self.shards.iter().enumerate() {
            // Owned bytes for what we compute; views into the base maps for what we copy.
            let mut owned = HashMap::new();
            for &i in shard {
                let (bytes, m, d) = self.item_bytes(i)?;
                (merged, dequantized) = (merged + m as usize, dequantized + d as usize);
                if let Some(bytes) = bytes {
                    owned.insert(i, bytes);
                }
            }
            let mut views = Vec::with_capacity(shard.len());
            for &i in shard {
                let it = &self.items[i];
                let view = match owned.get(&i) {
                    Some(bytes) => TensorView::new(it.dtype, it.shape.clone(), bytes)?,
                    None => self.ckpt.sts[it.shard].tensor(&it.name)?,
                };
                total_size += it.size;
                weight_map.insert(it.name.clone(), self.shard_name(k));
                views.push((it.name.clone(), view));
            }
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            let path = tmp.join(self.shard_name(k));
            safetensors::serialize_to_file(views, Some(meta), &path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            bar.written(&path, shard.iter().map(|&i| self.items[i].size).sum());
        }
        let n = self.shards.len();
        if n > 1 {
            let index = json!({
                "metadata": {"total_size": total_size},
                "weight_map": weight_map,
            });
            std::fs::write(
                tmp.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index)?,
            )?;
        }
        std::fs::write(tmp.join("config.json"), self.config_out()?)?;
        // safetensors writes through a private temporary file (mode 0600): give the shards
        // the mode of an ordinary new file, as config.json has.
        let mode = std::fs::metadata(tmp.join("config.json"))?.permissions();
        for k in 0..n {
            std::fs::set_permissions(tmp.join(self.shard_name(k)), mode.clone())?;
        }
        for f in COPIED {
            let src = self.ckpt.dir.join(f);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(f))
                    .with_context(|| format!("cannot copy {}", src.display()))?;
            }
        }
        sync_dir_files(tmp)?;
        Ok(MergeReport {
            out: out.to_owned(),
            tensors: self.items.len(),
            merged,
            shards: n,
            total_size,
            merged_into: self.merged_into(),
            dequantized,
        })
    }

    /// One tensor's bytes where they are not the base's stored ones (None: copied as is), and
    /// whether an adapter was merged into it and whether it was dequantized.
    pub(super) fn item_bytes(&self, i: usize) -> Result<(Option<Vec<u8>>, bool, bool)> {
        let it = &self.items[i];
        let out_dtype = candle_dtype(it.dtype).unwrap_or(DType::F32);
        let stored = || self.ckpt.sts[it.shard].tensor(&it.name);
        let computed = self.computed(it)?;
        let dequantized = computed.is_some();
        let slot = self.slots.get(i).and_then(Option::as_ref);
        let module = match slot {
            Some(s) => s.module.as_str(),
            None => it.name.strip_suffix(".weight").unwrap_or(""),
        };
        if let Some(adapter) = self.adapted.get(module) {
            let w = match computed {
                Some(w) => w,
                None => view_tensor(&stored()?)?.to_dtype(DType::F32)?,
            };
            // W' = W + scale · B A in f32 (DoRA: rows scaled to m / ‖·‖), then the output dtype.
            let w = match (adapter, slot) {
                (Adapter::Linear(a, b, m), None) => {
                    let w = (w + (b.matmul(a)? * self.scale)?)?;
                    match m {
                        Some(m) => {
                            let g = crate::ops::dora::magnitude_scale(m, &row_norms(&w)?)?;
                            w.broadcast_mul(&g.unsqueeze(1)?)?
                        }
                        None => w,
                    }
                }
                (Adapter::Experts(a, b), Some(slot)) => {
                    (w + experts::delta(a, b, self.scale, slot)?)?
                }
                _ => bail!("`{}`: its adapter is not of its kind", it.name),
            };
            return Ok((
                Some(tensor_bytes(&w.to_dtype(out_dtype)?)?),
                true,
                dequantized,
            ));
        }
        let bytes = match computed {
            Some(w) => Some(tensor_bytes(&w.to_dtype(out_dtype)?)?),
            None => {
                let v = stored()?;
                match v.dtype() != it.dtype {
                    true => Some(tensor_bytes(&view_tensor(&v)?.to_dtype(out_dtype)?)?),
                    false => None,
                }
            }
        };
        Ok((bytes, false, dequantized))
    }

    /// A weight's values in f32 where they are not the stored ones: dequantized from the
    /// checkpoint's NF4 or MXFP4, or the base quantized to NF4 and back.
    pub(super) fn computed(&self, it: &Item) -> Result<Option<Tensor>> {
        let opts = self.opts;
        Ok(match it.src {
            Src::Stored => None,
            Src::Packed => {
                let q = bnb::read(self.ckpt.packed_st()?, &it.name, &it.shape)
                    .with_context(|| {
                        format!("in the 4-bit checkpoint {}", self.ckpt.dir.display())
                    })?
                    .with_context(|| format!("`{}` has no quant state", it.name))?;
                Some(dequantized_tensor(&q, opts.quantize_dtype)?)
            }
            Src::Mxfp4(requant) => {
                let st = self.ckpt.packed_st()?;
                let w =
                    crate::quant::mxfp4::read(st, &it.name, &it.shape, (DType::F32, &Device::Cpu))
                        .with_context(|| {
                            format!("in the MXFP4 checkpoint {}", self.ckpt.dir.display())
                        })?
                        .with_context(|| format!("`{}` has no MXFP4 blocks", it.name))?
                        .contiguous()?;
                match requant {
                    true => Some(self.requant(it, &w)?),
                    false => Some(w),
                }
            }
            Src::Requant => {
                let w = view_tensor(&self.ckpt.sts[it.shard].tensor(&it.name)?)?;
                Some(self.requant(it, &w)?)
            }
        })
    }

    /// A weight `w` as training held it under NF4: quantized and dequantized (an expert's
    /// matrices one by one, `experts::requant`), in f32.
    fn requant(&self, it: &Item, w: &Tensor) -> Result<Tensor> {
        let opts = self.opts;
        // Quantized from the weight as training held it: in the run's dtype, else the
        // output's, else as stored.
        let held = opts
            .quantize_dtype
            .or(opts.dtype)
            .or_else(|| to_recipe_dtype(w.dtype()));
        let d = held.map_or(DType::F32, |d| {
            candle_dtype(st_dtype(d)).unwrap_or(DType::F32)
        });
        let host = w
            .to_dtype(d)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let double_quant = self.ckpt.packed.unwrap_or(opts.double_quant);
        if experts::is_tensor(&it.name) {
            let dq = (double_quant, self.ckpt.xw);
            let v = experts::requant(&it.name, &host, &it.shape, dq)?;
            let w = Tensor::from_vec(v, it.shape.as_slice(), &Device::Cpu)?;
            return rounded(w, held);
        }
        let q = Nf4::quantize(&host, &it.shape, double_quant);
        dequantized_tensor(&q, held)
    }

    /// config.json: the base's bytes for a plain merge that casts nothing (a rewrite would
    /// reorder its keys and reformat its numbers); otherwise its dtype field naming the dtype
    /// written (when cast, or a 4-bit checkpoint's linears), and for a merge into NF4 weights
    /// no quantization_config and `lora_train_merged_into`.
    pub(super) fn config_out(&self) -> Result<String> {
        let nf4 = self.merged_into() != "base";
        let written = match (self.opts.dtype, self.ckpt.packed) {
            (Some(d), _) => Some(st_dtype(d)),
            (None, Some(_)) => Some(checkpoint_dtype(&self.ckpt.cfg)),
            (None, None) => None,
        };
        let mxfp4 = self.ckpt.mxfp4;
        if written.is_none() && !nf4 && !mxfp4 {
            return Ok(self.ckpt.cfg_text.clone());
        }
        let mut cfg = self.ckpt.cfg.clone();
        if let Some(o) = cfg.as_object_mut() {
            if let Some(d) = written {
                let mut keys: Vec<&str> = ["torch_dtype", "dtype"]
                    .into_iter()
                    .filter(|k| o.contains_key(*k))
                    .collect();
                if keys.is_empty() {
                    keys.push("torch_dtype");
                }
                for k in keys {
                    o.insert(k.to_string(), Value::from(torch_name(d)));
                }
            }
            if nf4 || mxfp4 {
                // transformers loads a gpt-oss without quantization_config as plain bf16 experts
                o.remove("quantization_config");
            }
            if nf4 {
                o.insert(MERGED_INTO_KEY.to_string(), Value::from(self.merged_into()));
            }
        }
        Ok(serde_json::to_string_pretty(&cfg)? + "\n")
    }
}
