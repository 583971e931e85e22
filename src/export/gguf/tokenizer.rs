//! The `tokenizer.*` keys of a GGUF file, as convert_hf_to_gguf.py writes them for each
//! family: llama.cpp's "gpt2" vocabulary (a byte-level BPE tokenizer.json: tokens, token
//! types, merges and the pre-tokenizer's name) or its "llama" one (a SentencePiece
//! tokenizer.model: tokens, scores, token types), then the special tokens and the chat
//! template (`special`).
//!
//! Token types are llama.cpp's: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
//! 6 byte. Ids the tokenizer lacks below config.json's vocab_size are `[PAD<i>]`, unused.

use super::pre_hashes::{CHKTXT, PRE_HASHES};
use super::{special, spm, Kv};
use crate::model::Family;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;
use std::path::Path;

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// A vocabulary as llama.cpp stores it.
struct Vocab {
    tokens: Vec<String>,
    /// SentencePiece scores ("llama" vocabularies only).
    scores: Option<Vec<f32>>,
    types: Vec<i32>,
}

fn json(path: &Path) -> Result<Json> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// convert_hf_to_gguf.py's `does_token_look_special`: control tokens that some tokenizers
/// forget to mark special.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Which vocabulary convert_hf_to_gguf.py writes for the family and the files at hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gpt2,
    Spm,
    /// Phi-3's own SentencePiece reading (added tokens from three files).
    Phi3Spm,
}

fn kind(dir: &Path, family: Family) -> Result<Kind> {
    let has_spm = dir.join("tokenizer.model").is_file();
    Ok(match family {
        Family::Gemma2 if !has_spm => bail!(
            "{}: Gemma 2 needs tokenizer.model (llama.cpp reads its SentencePiece vocabulary)",
            dir.display()
        ),
        Family::Gemma2 => Kind::Spm,
        Family::Qwen3Moe | Family::GptOss => Kind::Gpt2,
        Family::Phi3 => {
            let cfg = dir.join("tokenizer_config.json");
            let class = match cfg.is_file() {
                true => json(&cfg)?.get("tokenizer_class").cloned(),
                false => None,
            };
            match class.as_ref().and_then(Json::as_str) {
                Some("GPT2Tokenizer") => Kind::Gpt2,
                _ if !has_spm => bail!(
                    "{}: Phi-3 needs tokenizer.model (llama.cpp reads its SentencePiece vocabulary)",
                    dir.display()
                ),
                _ => Kind::Phi3Spm,
            }
        }
        _ if has_spm => Kind::Spm,
        Family::Llama | Family::Mistral => {
            check_not_llama_hf(dir)?;
            Kind::Gpt2
        }
        _ => Kind::Gpt2,
    })
}

/// A Llama-2-style BPE tokenizer.json (byte fallback, no tokenizer.model) is what
/// convert_hf_to_gguf.py reads with transformers' slow path; we do not.
fn check_not_llama_hf(dir: &Path) -> Result<()> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        bail!("{}: no tokenizer.json or tokenizer.model", dir.display());
    }
    let t = json(&path)?;
    let model = &t["model"];
    let bpe = model["type"] == "BPE";
    let fallback = model["byte_fallback"].as_bool().unwrap_or(false);
    if bpe && fallback && t["decoder"]["type"] == "Sequence" {
        bail!(
            "{}: a SentencePiece-style BPE tokenizer.json without tokenizer.model is not \
             supported for GGUF; put the base model's tokenizer.model beside it",
            path.display()
        );
    }
    Ok(())
}

/// A SentencePiece vocabulary (`_create_vocab_sentencepiece`, or Phi-3's reading).
fn spm_vocab(dir: &Path, vocab_size: usize, phi3: bool) -> Result<Vocab> {
    let path = dir.join("tokenizer.model");
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let pieces = spm::pieces(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if phi3 && pieces.len() > vocab_size {
        bail!(
            "{}: {} pieces, config.json's vocab_size is {vocab_size}",
            path.display(),
            pieces.len()
        );
    }
    let mut v = Vocab {
        tokens: (0..vocab_size).map(|i| format!("[PAD{i}]")).collect(),
        scores: Some(vec![-10000.0; vocab_size]),
        types: vec![UNUSED; vocab_size],
    };
    for (i, p) in pieces.iter().enumerate().take(vocab_size) {
        v.tokens[i] = p.text.clone();
        if let Some(s) = v.scores.as_mut() {
            s[i] = p.score;
        }
        v.types[i] = match p.kind {
            2 => UNKNOWN,
            3 => CONTROL,
            5 => UNUSED,
            6 => BYTE,
            _ => NORMAL,
        };
    }
    let mut set = |id: u64, text: String, ty: i32| {
        if let Some(i) = usize::try_from(id).ok().filter(|&i| i < vocab_size) {
            v.tokens[i] = text;
            if let Some(s) = v.scores.as_mut() {
                s[i] = -1000.0;
            }
            v.types[i] = ty;
        }
    };
    let added = dir.join("added_tokens.json");
    if added.is_file() {
        if let Json::Object(m) = json(&added)? {
            for (k, id) in m {
                if let Some(id) = id.as_u64() {
                    set(id, k, USER_DEFINED);
                }
            }
        }
    }
    let cfg = dir.join("tokenizer_config.json");
    if cfg.is_file() {
        let c = json(&cfg)?;
        for (id, t) in c["added_tokens_decoder"].as_object().into_iter().flatten() {
            let (Ok(id), Some(content)) = (id.parse::<u64>(), t["content"].as_str()) else {
                continue;
            };
            let special = t["special"].as_bool().unwrap_or(false);
            let ty = match special || (!phi3 && looks_special(content)) {
                true => CONTROL,
                false => USER_DEFINED,
            };
            let text = match (phi3, ty) {
                (false, USER_DEFINED) => content.replace('\u{2581}', " "),
                _ => content.to_string(),
            };
            set(id, text, ty);
        }
    }
    let tj = dir.join("tokenizer.json");
    if phi3 && tj.is_file() {
        for t in json(&tj)?["added_tokens"].as_array().into_iter().flatten() {
            let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
                continue;
            };
            let ty = match t["special"].as_bool().unwrap_or(false) {
                true => CONTROL,
                false => USER_DEFINED,
            };
            set(id, content.to_string(), ty);
        }
    }
    Ok(v)
}

/// A tokenizer.json's tokens by id: the model's vocabulary (BPE / WordPiece {token: id}, or
/// Unigram's [[token, score], …]) and the added tokens.
fn json_tokens(t: &Json, path: &Path) -> Result<Vec<(u64, String)>> {
    let mut out = Vec::new();
    match &t["model"]["vocab"] {
        Json::Object(m) => {
            for (tok, id) in m {
                let id = id.as_u64().with_context(|| {
                    format!("{}: vocab id of `{tok}` is not a number", path.display())
                })?;
                out.push((id, tok.clone()));
            }
        }
        Json::Array(a) => {
            for (i, e) in a.iter().enumerate() {
                if let Some(tok) = e.get(0).and_then(Json::as_str) {
                    out.push((i as u64, tok.to_string()));
                }
            }
        }
        _ => bail!("{}: model.vocab is missing", path.display()),
    }
    Ok(out)
}

/// A byte-level BPE vocabulary (`get_vocab_base`): model tokens normal, added tokens control
/// (special, or looking special) or user-defined.
fn gpt2_vocab(dir: &Path, vocab_size: Option<usize>) -> Result<Vocab> {
    let path = dir.join("tokenizer.json");
    let t = json(&path)?;
    let mut by_id = std::collections::BTreeMap::new();
    for (id, tok) in json_tokens(&t, &path)? {
        by_id.insert(id, (tok, None));
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) {
            by_id.insert(
                id,
                (c.to_string(), Some(a["special"].as_bool().unwrap_or(false))),
            );
        }
    }
    let max = by_id.keys().next_back().copied().unwrap_or(0);
    let n = vocab_size.unwrap_or(by_id.len());
    if max as usize >= n {
        bail!(
            "{}: token id {max} is not below config.json's vocab_size {n}",
            path.display()
        );
    }
    let mut v = Vocab {
        tokens: Vec::with_capacity(n),
        scores: None,
        types: Vec::with_capacity(n),
    };
    for i in 0..n as u64 {
        let (tok, ty) = match by_id.get(&i) {
            None => (format!("[PAD{i}]"), UNUSED),
            Some((tok, None)) => (tok.clone(), NORMAL),
            Some((tok, Some(special))) if *special || looks_special(tok) => (tok.clone(), CONTROL),
            Some((tok, Some(_))) => (tok.replace('\u{2581}', " "), USER_DEFINED),
        };
        v.tokens.push(tok);
        v.types.push(ty);
    }
    Ok(v)
}

/// Python's `str(list_of_ints)`: "[1, 2, 3]".
fn py_list(ids: &[u32]) -> String {
    let items: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// `tokenizer.ggml.pre`: llama.cpp's name for the pre-tokenizer, found as
/// convert_hf_to_gguf.py finds it (the hash of the ids of `CHKTXT`, special tokens added).
/// A tokenizer llama.cpp's table does not know, with a plain byte-level pre-tokenizer (GPT-2's
/// regex), is "gpt-2"; any other unknown one is an error naming its hash.
pub(crate) fn pre_name(dir: &Path) -> Result<String> {
    let path = dir.join("tokenizer.json");
    let tok = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
    let enc = tok
        .encode(CHKTXT, true)
        .map_err(|e| anyhow::anyhow!("{}: cannot encode: {e}", path.display()))?;
    let digest = ring::digest::digest(&ring::digest::SHA256, py_list(enc.get_ids()).as_bytes());
    let hash: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    if let Some((_, name)) = PRE_HASHES.iter().find(|(h, _)| *h == hash) {
        return Ok(name.to_string());
    }
    let t = json(&path)?;
    if plain_byte_level(&t["pre_tokenizer"]) {
        return Ok("gpt-2".into());
    }
    bail!(
        "{}: llama.cpp does not know this BPE pre-tokenizer (chkhsh {hash}); \
         convert_hf_to_gguf.py refuses it too",
        path.display()
    )
}

/// A ByteLevel pre-tokenizer that splits with its own (GPT-2) regex, alone.
fn plain_byte_level(p: &Json) -> bool {
    p["type"] == "ByteLevel" && p["use_regex"].as_bool().unwrap_or(true)
}

/// The `tokenizer.*` keys for the checkpoint in `dir` (config.json's `vocab_size`), in
/// convert_hf_to_gguf.py's order.
pub(crate) fn keys(dir: &Path, family: Family, vocab_size: usize) -> Result<Vec<Kv>> {
    let mut kv: Vec<Kv> = Vec::new();
    let s = |x: &str| Value::String(x.to_string());
    if matches!(family, Family::Llama | Family::Mistral) {
        let cfg = dir.join("tokenizer_config.json");
        if cfg.is_file() {
            if let Some(b) = json(&cfg)?["add_prefix_space"].as_bool() {
                kv.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(b)));
            }
        }
    }
    let kind = kind(dir, family)?;
    let (vocab, model, pre) = match kind {
        Kind::Gpt2 => (gpt2_vocab(dir, Some(vocab_size))?, "gpt2", pre_name(dir)?),
        Kind::Spm | Kind::Phi3Spm => (
            spm_vocab(dir, vocab_size, kind == Kind::Phi3Spm)?,
            "llama",
            "default".to_string(),
        ),
    };
    kv.push(("tokenizer.ggml.model".into(), s(model)));
    kv.push(("tokenizer.ggml.pre".into(), s(&pre)));
    let n = vocab.tokens.len();
    kv.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array(vocab.tokens.into_iter().map(Value::String).collect()),
    ));
    if let Some(sc) = vocab.scores {
        kv.push((
            "tokenizer.ggml.scores".into(),
            Value::Array(sc.into_iter().map(Value::F32).collect()),
        ));
    }
    kv.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(vocab.types.into_iter().map(Value::I32).collect()),
    ));
    let sv = match kind {
        Kind::Gpt2 => special::read(dir, true, None)?,
        _ => special::read(dir, false, Some(n))?,
    };
    kv.extend(special_keys(&sv));
    if family.gemma() && kind == Kind::Spm {
        kv.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    }
    Ok(kv)
}

/// `SpecialVocab.add_to_gguf`'s keys.
fn special_keys(sv: &special::Special) -> Vec<Kv> {
    let mut kv: Vec<Kv> = Vec::new();
    if !sv.merges.is_empty() {
        kv.push((
            "tokenizer.ggml.merges".into(),
            Value::Array(sv.merges.iter().cloned().map(Value::String).collect()),
        ));
    }
    for (typ, id) in &sv.ids {
        if let Some(k) = special::id_key(typ) {
            kv.push((k.into(), Value::U32(*id)));
        }
    }
    for (typ, add) in &sv.add {
        if let Some(k) = special::add_key(typ) {
            kv.push((k.into(), Value::Bool(*add)));
        }
    }
    match &sv.chat_template {
        Some(Json::String(t)) => {
            kv.push(("tokenizer.chat_template".into(), Value::String(t.clone())))
        }
        Some(Json::Array(named)) => kv.extend(named_templates(named)),
        _ => {}
    }
    if let Some(b) = sv.lowercase {
        kv.push(("tokenizer.ggml.normalizer.lowercase".into(), Value::Bool(b)));
    }
    if let Some(b) = sv.strip_accents {
        kv.push((
            "tokenizer.ggml.normalizer.strip_accents".into(),
            Value::Bool(b),
        ));
    }
    kv
}

/// Named chat templates: `tokenizer.chat_template.<name>` each, their names in
/// `tokenizer.chat_templates`, and "default" as `tokenizer.chat_template`.
fn named_templates(named: &[Json]) -> Vec<Kv> {
    let mut kv: Vec<Kv> = Vec::new();
    let mut names = Vec::new();
    let mut default = None;
    for c in named {
        let name: String = c["name"]
            .as_str()
            .unwrap_or("")
            .chars()
            .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
            .collect();
        let Some(t) = c["template"].as_str() else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        if name == "default" {
            default = Some(t.to_string());
        } else {
            kv.push((
                format!("tokenizer.chat_template.{name}"),
                Value::String(t.into()),
            ));
            names.push(Value::String(name));
        }
    }
    if !names.is_empty() {
        kv.push(("tokenizer.chat_templates".into(), Value::Array(names)));
    }
    if let Some(t) = default {
        kv.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    kv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_list_format() {
        assert_eq!(py_list(&[1, 22, 333]), "[1, 22, 333]");
        assert_eq!(py_list(&[]), "[]");
    }

    #[test]
    fn special_looking_tokens() {
        assert!(looks_special("<|im_start|>"));
        assert!(looks_special("<unused12>"));
        assert!(!looks_special("<s>"));
    }
}
