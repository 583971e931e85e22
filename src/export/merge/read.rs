//! What a merge reads: the base checkpoint's tensors (plain or bitsandbytes NF4) and the
//! adapter's A, B (and DoRA magnitude) pairs.

use super::*;

/// A decoder-layer linear's weight (`model.layers.N.….<proj>.weight`), which training keeps
/// in NF4 under `model.quantize = "nf4"` (as it keeps a MoE's experts: `experts::is_weight`).
pub(super) fn is_decoder_linear(name: &str, shape: &[usize]) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    if experts::is_tensor(name) {
        return false;
    }
    let Some((layer, rest)) = rest.split_once('.') else {
        return false;
    };
    let leaf = rest
        .strip_suffix(".weight")
        .and_then(|m| m.rsplit('.').next());
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && leaf.is_some_and(|l| KNOWN_LINEAR.contains(&l))
        && shape.len() == 2
}

/// The weight's shape its bitsandbytes quant state records.
pub(super) fn packed_shape(state: &[u8], name: &str) -> Result<Vec<usize>> {
    let v: Value = serde_json::from_slice(state)
        .with_context(|| format!("`{name}{}` is not the JSON bitsandbytes writes", bnb::STATE))?;
    serde_json::from_value(v.get("shape").cloned().unwrap_or(Value::Null))
        .with_context(|| format!("`{name}{}` has no shape (a list of sizes)", bnb::STATE))
}

/// Where a tensor of the merged model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Src {
    /// The base tensor (cast when asked).
    Stored,
    /// A bitsandbytes 4-bit weight, dequantized.
    Packed,
    /// A full-precision decoder linear quantized to NF4 and dequantized.
    Requant,
    /// gpt-oss's MXFP4 expert weight (`P_blocks`, `P_scales`: quant::mxfp4) dequantized,
    /// then (true) quantized to NF4 and dequantized as `Requant`.
    Mxfp4(bool),
}

/// One tensor of the merged model.
pub(super) struct Item {
    pub(super) name: String,
    pub(super) shard: usize,
    pub(super) shape: Vec<usize>,
    /// The dtype written.
    pub(super) dtype: StDtype,
    /// Bytes written.
    pub(super) size: u64,
    pub(super) src: Src,
}

/// One adapted module's (A [r, in], B [out, r], DoRA's m [out]), f32.
pub(super) struct Pair {
    pub(super) a: Option<Tensor>,
    pub(super) b: Option<Tensor>,
    pub(super) m: Option<Tensor>,
}

/// Reads the adapter's tensors, grouped by module (HF name, e.g. model.layers.0.mlp.up_proj),
/// once they are checked against the base's config.json (`adapter_check::against_base`).
pub(super) fn read_adapter_tensors(
    dir: &Path,
    base: &crate::model::ModelConfig,
) -> Result<BTreeMap<String, Pair>> {
    let path = dir.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let shapes = tensors.iter().map(|(k, t)| (k.as_str(), t.dims()));
    crate::export::adapter_check::against_base(&path, shapes, base)?;
    let mut out: BTreeMap<String, Pair> = BTreeMap::new();
    for (key, t) in tensors {
        let name = key.replace(".default.weight", ".weight");
        let name = name.replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector");
        let parsed = name.strip_prefix("base_model.model.").and_then(|m| {
            m.strip_suffix(".lora_A.weight")
                .map(|m| (m, 'A'))
                .or_else(|| m.strip_suffix(".lora_B.weight").map(|m| (m, 'B')))
                .or_else(|| m.strip_suffix(".lora_magnitude_vector").map(|m| (m, 'm')))
        });
        let Some((module, which)) = parsed else {
            bail!(
                "{}: tensor `{key}` is not a LoRA A/B weight or DoRA magnitude of a linear \
                 module (embedding adapters and modules_to_save are not supported)",
                path.display()
            );
        };
        crate::export::adapter_check::tensor(&path, &key, &t)?;
        let t = t.to_dtype(DType::F32)?;
        let p = out.entry(module.to_string()).or_insert(Pair {
            a: None,
            b: None,
            m: None,
        });
        match which {
            'A' => p.a = Some(t),
            'B' => p.b = Some(t),
            _ => p.m = Some(t),
        }
    }
    if out.is_empty() {
        bail!("{} holds no LoRA tensors", path.display());
    }
    Ok(out)
}

/// The base checkpoint as a merge reads it.
pub(super) struct Base<'a> {
    pub(super) dir: &'a Path,
    pub(super) files: &'a ModelFiles,
    /// Every shard, parsed from its map.
    pub(super) sts: Vec<SafeTensors<'a>>,
    /// A bitsandbytes 4-bit checkpoint: Some(its double quant); a full-precision one: None.
    pub(super) packed: Option<bool>,
    /// The packed weights (NF4 or MXFP4) read through candle's map, as the loader reads them.
    pub(super) packed_st: Option<candle_core::safetensors::MmapedSafetensors>,
    /// gpt-oss's MXFP4 checkpoint (quantization_config.quant_method = "mxfp4").
    pub(super) mxfp4: bool,
    /// The fused experts stored x·W, [E, in, out] (gpt-oss: `experts::Slot::xw`).
    pub(super) xw: bool,
    pub(super) cfg_text: String,
    pub(super) cfg: Value,
}

impl<'a> Base<'a> {
    pub(super) fn open(
        dir: &'a Path,
        files: &'a ModelFiles,
        maps: &'a [memmap2::Mmap],
    ) -> Result<Self> {
        let sts = maps
            .iter()
            .zip(&files.weights)
            .map(|(m, p)| {
                SafeTensors::deserialize(m)
                    .with_context(|| format!("{} is not a safetensors file", p.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        let packed = bnb::nf4_config(&files.config)?;
        let cfg_text = std::fs::read_to_string(&files.config)
            .with_context(|| format!("cannot read {}", files.config.display()))?;
        let cfg: Value = serde_json::from_str(&cfg_text)
            .with_context(|| format!("{} is not valid JSON", files.config.display()))?;
        let mxfp4 = cfg["quantization_config"]["quant_method"] == "mxfp4";
        let xw = cfg["model_type"] == "gpt_oss";
        let packed_st = match packed.is_some() || mxfp4 {
            true => {
                // SAFETY: as `merge`'s maps of the same shards: read-only, and nothing of ours
                // writes the base while they are mapped (the output is another directory).
                Some(unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files.weights) }?)
            }
            false => None,
        };
        Ok(Base {
            dir,
            files,
            sts,
            packed,
            packed_st,
            mxfp4,
            xw,
            cfg_text,
            cfg,
        })
    }

    pub(super) fn packed_st(&self) -> Result<&candle_core::safetensors::MmapedSafetensors> {
        self.packed_st.as_ref().context("no 4-bit checkpoint map")
    }

    /// Every tensor of the merged model in checkpoint order: its name, shard, shape, output
    /// dtype, bytes and where its values come from.
    pub(super) fn items(&self, maps: &[memmap2::Mmap], opts: &MergeOptions) -> Result<Vec<Item>> {
        let names = maps
            .iter()
            .map(|m| Ok(SafeTensors::read_metadata(m)?.1.offset_keys()))
            .collect::<Result<Vec<_>>>()?;
        // Packed 4-bit weights: those with a quant state (in any shard: transformers may put a
        // weight and its quant tensors in different ones); their quant tensors are dropped.
        let mut packed = std::collections::HashSet::new();
        let mut dropped = std::collections::HashSet::new();
        if self.packed.is_some() {
            for w in names
                .iter()
                .flatten()
                .filter_map(|n| n.strip_suffix(bnb::STATE))
            {
                packed.insert(w.to_string());
                for s in [
                    bnb::STATE,
                    ".absmax",
                    ".quant_map",
                    ".nested_absmax",
                    ".nested_quant_map",
                ] {
                    dropped.insert(format!("{w}{s}"));
                }
            }
        }
        // MXFP4 expert weights: written dequantized under their own name, their scales dropped
        if self.mxfp4 {
            let all: std::collections::HashSet<&String> = names.iter().flatten().collect();
            for w in all.iter().filter_map(|n| n.strip_suffix("_blocks")) {
                if all.contains(&format!("{w}_scales")) {
                    dropped.insert(format!("{w}_scales"));
                }
            }
        }
        let requant = opts.merge_into == MergeInto::Dequantized;
        let mut items = Vec::new();
        let mut seen = HashMap::new();
        for (i, (st, names)) in self.sts.iter().zip(names).enumerate() {
            for name in names.into_iter().filter(|n| !dropped.contains(n)) {
                let v = st.tensor(&name)?;
                if let Some(prev) = seen.insert(name.clone(), i) {
                    bail!(
                        "tensor `{name}` is in both {} and {}",
                        self.files.weights[prev].display(),
                        self.files.weights[i].display()
                    );
                }
                let mx = match name.strip_suffix("_blocks") {
                    Some(w) if dropped.contains(&format!("{w}_scales")) => Some(w.to_string()),
                    _ => None,
                };
                let (name, src, shape, stored) = if let Some(w) = mx {
                    // [E, R, G, 16] codes → the weight [E, G·32, R] (x·W), bf16 as transformers
                    let &[e, r, g, _] = v.shape() else {
                        bail!("`{name}` in {} is not [E, R, G, 16]", self.dir.display());
                    };
                    let shape = vec![e, g * crate::quant::mxfp4::BLOCK, r];
                    let rq = requant && experts::is_weight(&w, &shape);
                    (w, Src::Mxfp4(rq), shape, StDtype::BF16)
                } else if packed.contains(&name) {
                    let state = self.packed_st()?.get(&format!("{name}{}", bnb::STATE))?;
                    let shape = packed_shape(state.data(), &name).with_context(|| {
                        format!("in the 4-bit checkpoint {}", self.dir.display())
                    })?;
                    (name, Src::Packed, shape, checkpoint_dtype(&self.cfg))
                } else {
                    let shape = v.shape().to_vec();
                    let float = candle_dtype(v.dtype()).is_some();
                    let quantized =
                        is_decoder_linear(&name, &shape) || experts::is_weight(&name, &shape);
                    let src = match requant && float && quantized {
                        true => Src::Requant,
                        false => Src::Stored,
                    };
                    (name, src, shape, v.dtype())
                };
                let dtype = match opts.dtype {
                    Some(d) if candle_dtype(stored).is_some() => st_dtype(d),
                    _ => stored,
                };
                items.push(Item {
                    size: n_bytes(&shape, dtype),
                    name,
                    shard: i,
                    shape,
                    dtype,
                    src,
                });
            }
        }
        Ok(items)
    }
}
