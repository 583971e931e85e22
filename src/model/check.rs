//! What a checkpoint must be before the model is built from it, checked where it is cheap:
//! config.json's values (each bounded by what it can mean), the safetensors headers (complete
//! files, floating-point tensors, a layer count and sizes that match config.json), and every
//! base tensor finite as it loads.
//!
//! A value of config.json that is out of range or does not match the tensors is a
//! `ConfigError` naming the file and the key (exit code 2, like a recipe error); a damaged or
//! unsupported weights file is an error naming the file and the tensor (exit code 1).

use super::config::{ConfigError, ModelConfig, RopeScaling};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Upper bounds of config.json's sizes: far above any released model (hidden 16384, 126
/// layers, vocabulary 256k), low enough that a memory plan's products cannot overflow.
const MAX_HIDDEN: usize = 1 << 17;
const MAX_INTERMEDIATE: usize = 1 << 19;
const MAX_LAYERS: usize = 1 << 12;
const MAX_HEADS: usize = 1 << 12;
const MAX_HEAD_DIM: usize = 1 << 12;
const MAX_VOCAB: usize = 1 << 22;
const MAX_POSITIONS: usize = 1 << 30;
/// The safetensors format's own bound on the header (safetensors::MAX_HEADER_SIZE).
const MAX_HEADER: u64 = 100_000_000;

/// num_hidden_layers within its bound, before anything per layer is sized by it.
pub(crate) fn layers(n: usize, path: &Path) -> Result<(), ConfigError> {
    match n <= MAX_LAYERS {
        true => Ok(()),
        false => Err(ConfigError::Invalid {
            path: path.to_owned(),
            msg: format!(
                "`num_hidden_layers` = {n} is out of range: it must be in 1..={MAX_LAYERS}"
            ),
        }),
    }
}

/// config.json's values, each within what it can mean; called by `ModelConfig::from_json`.
pub(crate) fn config(c: &ModelConfig, path: &Path) -> Result<(), ConfigError> {
    let err = |key: &str, msg: String| ConfigError::Invalid {
        path: path.to_owned(),
        msg: format!("`{key}` {msg}"),
    };
    for (key, v, max) in [
        ("hidden_size", c.hidden_size, MAX_HIDDEN),
        ("intermediate_size", c.intermediate_size, MAX_INTERMEDIATE),
        ("num_hidden_layers", c.num_layers, MAX_LAYERS),
        ("num_attention_heads", c.num_heads, MAX_HEADS),
        ("num_key_value_heads", c.num_kv_heads, MAX_HEADS),
        ("head_dim", c.head_dim, MAX_HEAD_DIM),
        ("vocab_size", c.vocab_size, MAX_VOCAB),
        (
            "max_position_embeddings",
            c.max_position_embeddings,
            MAX_POSITIONS,
        ),
    ] {
        if v == 0 || v > max {
            return Err(err(
                key,
                format!("= {v} is out of range: it must be in 1..={max}"),
            ));
        }
    }
    if c.num_kv_heads > c.num_heads {
        return Err(err(
            "num_key_value_heads",
            format!(
                "= {} is more than num_attention_heads = {}",
                c.num_kv_heads, c.num_heads
            ),
        ));
    }
    if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
        return Err(err(
            "rope_theta",
            format!(
                "= {} must be a positive number (10000.0 for Llama 2, 500000.0 for Llama 3)",
                c.rope_theta
            ),
        ));
    }
    if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0 && c.rms_norm_eps < 1.0) {
        return Err(err(
            "rms_norm_eps",
            format!("= {} must be in (0, 1), e.g. 1e-5", c.rms_norm_eps),
        ));
    }
    rope_scaling(&c.rope_scaling, &err)?;
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let a = &c.arch;
    let caps = [
        ("attn_logit_softcapping", a.attn_softcap),
        ("final_logit_softcapping", a.final_softcap),
        ("query_pre_attn_scalar", a.query_pre_attn_scalar),
    ];
    for (key, v) in caps {
        if let Some(v) = v.filter(|v| !positive(*v)) {
            return Err(err(
                key,
                format!("= {v} must be a positive number (or null, for none)"),
            ));
        }
    }
    if let Some(w) = c.sliding_window.filter(|&w| w > MAX_POSITIONS) {
        return Err(err(
            "sliding_window",
            format!("= {w} is out of range: it must be in 1..={MAX_POSITIONS}"),
        ));
    }
    if let Some(r) = &a.local_rope {
        if !(r.theta.is_finite() && r.theta > 0.0) {
            return Err(err(
                "rope_local_base_freq",
                format!("= {} must be a positive number (Gemma 3: 10000.0)", r.theta),
            ));
        }
    }
    let ids = c.bos_token_id.iter().map(|&i| ("bos_token_id", i));
    let ids = ids
        .chain(c.eos_token_ids.iter().map(|&i| ("eos_token_id", i)))
        .chain(c.pad_token_id.iter().map(|&i| ("pad_token_id", i)));
    for (key, id) in ids {
        if id as usize >= c.vocab_size {
            return Err(err(
                key,
                format!("= {id} is not a token: vocab_size is {}", c.vocab_size),
            ));
        }
    }
    Ok(())
}

/// `rope_scaling`'s factors and lengths (Llama 3's, LongRoPE's, linear), each within what it
/// can mean.
fn rope_scaling(
    scaling: &RopeScaling,
    err: &impl Fn(&str, String) -> ConfigError,
) -> Result<(), ConfigError> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    match scaling {
        RopeScaling::None | RopeScaling::LongRope { .. } => {}
        RopeScaling::Yarn {
            original_max_position,
            ..
        } => {
            // the factors are checked as they are read (model/yarn.rs)
            if *original_max_position > MAX_POSITIONS {
                return Err(err(
                    "rope_scaling.original_max_position_embeddings",
                    format!("= {original_max_position} must be in 1..={MAX_POSITIONS}"),
                ));
            }
        }
        RopeScaling::Linear { factor } => {
            if !positive(*factor) {
                return Err(err(
                    "rope_scaling.factor",
                    format!("= {factor} must be a positive number"),
                ));
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            if !positive(*factor) {
                return Err(err(
                    "rope_scaling.factor",
                    format!("= {factor} must be a positive number"),
                ));
            }
            // high > low also rules out NaN (the smoothing divides by high - low).
            let ordered = high_freq_factor.partial_cmp(low_freq_factor);
            if !positive(*low_freq_factor) || ordered != Some(std::cmp::Ordering::Greater) {
                return Err(err(
                    "rope_scaling.high_freq_factor",
                    format!(
                        "= {high_freq_factor} must be above low_freq_factor = {low_freq_factor}, which must be positive (Llama 3: 4.0 and 1.0)"
                    ),
                ));
            }
            if *original_max_position == 0 || *original_max_position > MAX_POSITIONS {
                return Err(err(
                    "rope_scaling.original_max_position_embeddings",
                    format!("= {original_max_position} must be in 1..={MAX_POSITIONS}"),
                ));
            }
        }
    }
    if let RopeScaling::LongRope {
        short,
        long,
        original_max_position,
        attention_factor,
    } = scaling
    {
        for (key, list) in [("short_factor", short), ("long_factor", long)] {
            if let Some(f) = list.iter().find(|f| !positive(**f)) {
                return Err(err(
                    &format!("rope_scaling.{key}"),
                    format!("holds {f}: every factor must be a positive number"),
                ));
            }
        }
        if *original_max_position == 0 || *original_max_position > MAX_POSITIONS {
            return Err(err(
                "original_max_position_embeddings",
                format!("= {original_max_position} must be in 1..={MAX_POSITIONS}"),
            ));
        }
        if !positive(*attention_factor) {
            return Err(err(
                "rope_scaling.attention_factor",
                format!("= {attention_factor} must be a positive number"),
            ));
        }
    }
    Ok(())
}

/// One tensor of a safetensors header.
#[derive(Debug, Clone)]
pub(crate) struct HeaderTensor {
    /// As written: "BF16", "F32", "I64", "F8_E4M3", ...
    pub(crate) dtype: String,
    pub(crate) shape: Vec<usize>,
    /// Byte range in the data section.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// Bytes per element of a safetensors dtype (None: sub-byte or unknown).
fn dtype_bytes(d: &str) -> Option<u64> {
    Some(match d {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// The header of one safetensors file, checked against the file: offsets inside the data
/// section, byte counts matching dtype × shape, and the data section complete (a truncated,
/// half-copied file is named here instead of failing somewhere inside a reader).
pub(crate) fn read_header(path: &Path) -> Result<Vec<(String, HeaderTensor)>> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = f
        .metadata()
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    let bad = |msg: String| incomplete(path, msg);
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        bad(format!(
            "it has {len} bytes, fewer than the 8 of a header length"
        ))
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n > len - 8 {
        return Err(bad(format!(
            "the header length says {n} bytes and the file has {len} (truncated, or not safetensors)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text)
        .map_err(|e| bad(format!("cannot read its header: {e}")))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("its header is not JSON: {e}")))?;
    let serde_json::Value::Object(map) = v else {
        return Err(bad("its header is not a JSON object".into()));
    };
    let data = len - 8 - n;
    let mut out = Vec::with_capacity(map.len());
    for (name, t) in map {
        if name != "__metadata__" {
            let t = header_tensor(path, &name, &t, data)?;
            out.push((name, t));
        }
    }
    let covered = out.iter().map(|(_, t)| t.end).max().unwrap_or(0);
    if covered != data {
        return Err(bad(format!(
            "its tensors end at byte {covered} of a data section of {data} bytes"
        )));
    }
    Ok(out)
}

/// "`path` is not a complete safetensors file: `msg`".
fn incomplete(path: &Path, msg: String) -> anyhow::Error {
    anyhow::anyhow!(
        "{} is not a complete safetensors file: {msg}",
        path.display()
    )
}

/// Tensor `name`'s entry `t` of `path`'s header, checked: dtype a string, shape and offsets
/// lists of non-negative integers, the bytes inside the data section of `data` bytes and as
/// many as dtype × shape gives (any count for a dtype we do not know).
fn header_tensor(
    path: &Path,
    name: &str,
    t: &serde_json::Value,
    data: u64,
) -> Result<HeaderTensor> {
    let field = |k: &str| {
        t.get(k)
            .with_context(|| format!("{}: tensor `{name}` has no `{k}`", path.display()))
    };
    let dtype = field("dtype")?
        .as_str()
        .with_context(|| {
            format!(
                "{}: tensor `{name}`: `dtype` is not a string",
                path.display()
            )
        })?
        .to_string();
    let nums = |k: &str| -> Result<Vec<u64>> {
        field(k)?
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
            .with_context(|| {
                format!(
                    "{}: tensor `{name}`: `{k}` is not a list of non-negative integers",
                    path.display()
                )
            })
    };
    let shape = nums("shape")?;
    let offsets = nums("data_offsets")?;
    let [start, end] = offsets[..] else {
        bail!(
            "{}: tensor `{name}`: `data_offsets` must hold 2 numbers",
            path.display()
        );
    };
    if start > end || end > data {
        return Err(incomplete(path, format!(
            "tensor `{name}` lies at bytes {start}..{end} of a data section of {data} bytes (truncated?)"
        )));
    }
    let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let want = match (elems, dtype_bytes(&dtype)) {
        (Some(e), Some(b)) => e.checked_mul(b),
        (Some(_), None) => Some(end - start),
        (None, _) => None,
    };
    if want != Some(end - start) {
        return Err(incomplete(
            path,
            format!(
                "tensor `{name}` ({dtype} {shape:?}) holds {} bytes, which its shape does not give",
                end - start
            ),
        ));
    }
    Ok(HeaderTensor {
        dtype,
        shape: shape.into_iter().map(|d| d as usize).collect(),
        start,
        end,
    })
}

/// The weights files, before anything is read from them: every tensor the model may read is
/// floating point, the decoder layers present are config.json's num_hidden_layers, and the
/// embedding and layer 0's projections have config.json's sizes.
pub(crate) fn weights(cfg: &ModelConfig, config_path: &Path, files: &[PathBuf]) -> Result<()> {
    let (shapes, layers) = header_shapes(cfg.bnb_nf4.is_some(), files)?;
    check_layers(cfg, config_path, &layers)?;
    check_sizes(cfg, config_path, &shapes)
}

/// Tensor shapes by name.
type Shapes = BTreeMap<String, Vec<usize>>;

/// The shape of every tensor in `files` by name (a packed NF4 one's empty: its shape is in its
/// quant state) and the decoder layers present; an error for a tensor the model may read
/// that is not floating point.
fn header_shapes(nf4: bool, files: &[PathBuf]) -> Result<(Shapes, BTreeSet<usize>)> {
    let mut shapes: Shapes = BTreeMap::new();
    let mut layers = BTreeSet::new();
    // A bitsandbytes 4-bit checkpoint stores its layers' linears as bytes (quant::bnb):
    // `nf4`, as its config.json says (`ModelConfig::bnb_nf4`).
    for file in files {
        for (name, t) in read_header(file)? {
            let ours = name.starts_with("model.") || name.starts_with("lm_head.");
            let packed = (nf4 || crate::quant::mxfp4::is_packed(&name))
                && t.dtype == "U8"
                && name.starts_with("model.layers.");
            if packed {
                shapes.insert(name, Vec::new()); // its shape is in its quant state
                continue;
            }
            if ours && !["F32", "F16", "BF16", "F64"].contains(&t.dtype.as_str()) {
                let what = match dtype_bytes(&t.dtype) {
                    Some(_) if t.dtype.starts_with('I') || t.dtype.starts_with('U') => {
                        "an integer dtype: a quantized checkpoint (GPTQ, AWQ, bitsandbytes 8-bit) needs its full-precision original"
                    }
                    Some(_) => "a dtype lora-train does not train on",
                    None => "a dtype lora-train cannot read",
                };
                bail!(
                    "tensor `{name}` in {} has dtype {}, {what}; base weights must be F32, F16, BF16 or F64",
                    file.display(),
                    t.dtype
                );
            }
            if let Some(l) = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
            {
                layers.insert(l);
            }
            shapes.insert(name, t.shape);
        }
    }
    Ok((shapes, layers))
}

/// config.json's `key` found invalid: `msg` says against what.
fn invalid(config_path: &Path, key: &str, msg: String) -> anyhow::Error {
    ConfigError::Invalid {
        path: config_path.to_owned(),
        msg: format!("`{key}` {msg}"),
    }
    .into()
}

/// The decoder layers present (`layers`) are model.layers.0 to N − 1, N config.json's
/// num_hidden_layers.
fn check_layers(cfg: &ModelConfig, config_path: &Path, layers: &BTreeSet<usize>) -> Result<()> {
    let found = layers.len();
    let contiguous = layers.last().is_none_or(|&l| l + 1 == found);
    if found != cfg.num_layers || !contiguous {
        let have = match (layers.first(), layers.last()) {
            (Some(a), Some(b)) if contiguous => {
                format!("{found} decoder layers (model.layers.{a} to model.layers.{b})")
            }
            (Some(_), Some(_)) => {
                let v: Vec<String> = layers.iter().take(8).map(|l| l.to_string()).collect();
                format!(
                    "{found} decoder layers with gaps (model.layers.N for N in {}, ...)",
                    v.join(", ")
                )
            }
            _ => "no decoder layer (no model.layers.N tensor)".into(),
        };
        return Err(invalid(
            config_path,
            "num_hidden_layers",
            format!("= {}, but the weights hold {have}", cfg.num_layers),
        ));
    }
    Ok(())
}

/// The embedding and layer 0's projections (those present in `shapes`) have config.json's
/// sizes.
fn check_sizes(cfg: &ModelConfig, config_path: &Path, shapes: &Shapes) -> Result<()> {
    let (c, d) = (cfg.hidden_size, cfg.head_dim);
    let expect = [
        ("model.embed_tokens.weight", 0, cfg.vocab_size, "vocab_size"),
        ("model.embed_tokens.weight", 1, c, "hidden_size"),
        (
            "model.layers.0.self_attn.q_proj.weight",
            0,
            cfg.num_heads * d,
            "num_attention_heads",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            0,
            cfg.num_kv_heads * d,
            "num_key_value_heads",
        ),
        (
            "model.layers.0.mlp.gate_proj.weight",
            0,
            cfg.intermediate_size,
            "intermediate_size",
        ),
    ];
    for (name, dim, want, key) in expect {
        let Some(&got) = shapes.get(name).and_then(|s| s.get(dim)) else {
            continue; // a missing tensor is named when the model reads it
        };
        if got != want {
            let what = match key {
                "num_attention_heads" => format!("= {} (× head_dim {d} = {want})", cfg.num_heads),
                "num_key_value_heads" => {
                    format!("= {} (× head_dim {d} = {want})", cfg.num_kv_heads)
                }
                _ => format!("= {want}"),
            };
            return Err(invalid(
                config_path,
                key,
                format!(
                    "{what}, but `{name}` has shape {:?} in the weights",
                    shapes[name]
                ),
            ));
        }
    }
    Ok(())
}

/// Elements reduced per launch by `Finite`: bounds its temporary (64 MiB in f32).
const FINITE_CHUNK: usize = 1 << 24;

/// The base tensors' finiteness, checked as they load: each tensor's `0 · x` summed where it
/// lies (NaN for a NaN or an infinity, 0 otherwise: no overflow, whatever the dtype), the sums
/// read once, at `verify`, so loading never waits for the device.
#[derive(Default)]
pub(crate) struct Finite {
    sums: RefCell<Vec<(String, Tensor)>>,
}

impl Finite {
    /// Queues the check of `t` (named `name`) and hands it back.
    pub(crate) fn watch(&self, name: &str, t: Tensor) -> Result<Tensor> {
        let flat = t.flatten_all()?;
        let n = flat.elem_count();
        let mut acc: Option<Tensor> = None;
        let mut at = 0;
        while at < n {
            let len = FINITE_CHUNK.min(n - at);
            let s = flat.narrow(0, at, len)?.affine(0.0, 0.0)?.sum_all()?;
            acc = Some(match acc {
                None => s,
                Some(a) => (a + s)?,
            });
            at += len;
        }
        if let Some(a) = acc {
            self.sums.borrow_mut().push((name.to_string(), a));
        }
        Ok(t)
    }

    /// The first tensor (in load order) holding a NaN or an infinity, named with `dir`.
    pub(crate) fn verify(&self, dir: &Path, dtype: DType) -> Result<()> {
        let sums = self.sums.borrow();
        if sums.is_empty() {
            return Ok(());
        }
        let all: Vec<Tensor> = sums.iter().map(|(_, t)| t.clone()).collect();
        let vals: Vec<f32> = Tensor::stack(&all, 0)?.to_dtype(DType::F32)?.to_vec1()?;
        match vals.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(i) => bail!(
                "tensor `{}` in {} holds NaN or infinite values (as {dtype:?}): the checkpoint is damaged{}; training on it would only give a NaN loss",
                sums[i].0,
                dir.display(),
                if dtype == DType::F16 { ", or its values overflow f16 (try model.dtype = \"bf16\" or \"f32\")" } else { "" }
            ),
        }
    }
}

/// A host tensor (an adapter's A or B, an optimiser moment) holding a NaN or an infinity:
/// the index of its first such entry.
pub(crate) fn first_non_finite(t: &Tensor) -> Result<Option<usize>> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().position(|x| !x.is_finite()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `header` (JSON) and `data` bytes of tensor data, in a fresh
    /// directory (kept alive by the returned guard).
    fn file(header: &str, data: usize) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(vec![0u8; data]);
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    fn error(header: &str, data: usize) -> String {
        let (_dir, path) = file(header, data);
        format!("{:#}", read_header(&path).unwrap_err())
    }

    /// Each tensor entry is checked against the data section: inside it, as many bytes as
    /// dtype × shape, the section covered to its end; `__metadata__` is not a tensor.
    #[test]
    fn a_header_is_checked_against_its_data_section() {
        let ok = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#;
        let (_dir, path) = file(ok, 20);
        let got = read_header(&path).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            (got[1].1.shape.clone(), got[1].1.start, got[1].1.end),
            (vec![2], 12, 20)
        );

        let outside = r#"{"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}"#;
        let e = error(outside, 8);
        assert!(e.contains("not a complete safetensors file: tensor `a` lies at bytes 0..12 of a data section of 8 bytes"), "{e}");
        let e = error(outside, 16);
        assert!(
            e.contains("its tensors end at byte 12 of a data section of 16 bytes"),
            "{e}"
        );
        let wrong = r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,12]}}"#;
        let e = error(wrong, 12);
        assert!(
            e.contains("tensor `a` (F32 [2, 3]) holds 12 bytes, which its shape does not give"),
            "{e}"
        );
        let three = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,6,12]}}"#;
        assert!(error(three, 12).contains("tensor `a`: `data_offsets` must hold 2 numbers"));
        let no_dtype = r#"{"a":{"shape":[3],"data_offsets":[0,12]}}"#;
        assert!(error(no_dtype, 12).contains("tensor `a` has no `dtype`"));
    }
}
