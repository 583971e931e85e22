//! The special tokens, merges and chat template of a checkpoint as gguf-py's `SpecialVocab`
//! reads them (tokenizer.json, tokenizer_config.json, chat_template.jinja / .json, then
//! config.json), and the `tokenizer.*` keys they become.
//!
//! The rules, in gguf-py's order: tokenizer.json's merges (pairs `[a, b]` joined with a space,
//! a space inside a part written as U+0120); its normalizer's lowercase / strip-accents; its
//! post-processor: ByteLevel leaves add-bos / add-eos false unless set later, a
//! TemplateProcessing whose single template starts with the BOS (or CLS) token sets add-bos,
//! one ending with a special token sets add-eos (a trailing token other than the EOS becomes
//! the EOS, the old EOS the EOT), and a pair template's separator sets add-sep; then
//! tokenizer_config.json's `add_<type>_token` where the post-processor said nothing, each
//! `<type>_token`'s id from tokenizer.json's added tokens, and config.json's `<type>_token_id`
//! for the types still unset. An id at or past `n_vocab` is skipped.

use serde_json::{Map, Value};
use std::path::Path;

/// The special-token types gguf-py looks for, in its order.
const TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

/// What `SpecialVocab` found.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Special {
    /// BPE merges ("a b"), when asked for.
    pub(crate) merges: Vec<String>,
    /// (type, id) in the order found.
    pub(crate) ids: Vec<(String, u32)>,
    /// (type, add it) in the order found.
    pub(crate) add: Vec<(String, bool)>,
    /// The chat template: one, or named ones ({"name", "template"}).
    pub(crate) chat_template: Option<Value>,
    pub(crate) lowercase: Option<bool>,
    pub(crate) strip_accents: Option<bool>,
}

fn read_json(path: &Path) -> anyhow::Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", path.display()))
}

impl Special {
    fn set_id(&mut self, typ: &str, id: Option<&Value>, n_vocab: Option<usize>) {
        let Some(id) = id.and_then(Value::as_u64) else {
            return;
        };
        if n_vocab.is_some_and(|n| id >= n as u64) || self.id(typ).is_some() {
            return;
        }
        if let Ok(id) = u32::try_from(id) {
            self.ids.push((typ.to_string(), id));
        }
    }

    /// The id of special-token type `typ`, if set.
    pub(crate) fn id(&self, typ: &str) -> Option<u32> {
        self.ids.iter().find(|(t, _)| t == typ).map(|&(_, id)| id)
    }

    /// Whether llama.cpp is told to add `typ` (None: not said).
    pub(crate) fn adds(&self, typ: &str) -> Option<bool> {
        self.add.iter().find(|(t, _)| t == typ).map(|&(_, a)| a)
    }

    fn set_add(&mut self, typ: &str, v: bool) {
        match self.add.iter_mut().find(|(t, _)| t == typ) {
            Some(e) => e.1 = v,
            None => self.add.push((typ.to_string(), v)),
        }
    }

    fn normalizer(&mut self, n: &Value) {
        match n.get("type").and_then(Value::as_str) {
            Some("Lowercase") => self.lowercase = Some(true),
            Some("StripAccents") => self.strip_accents = Some(true),
            Some("BertNormalizer") => {
                if let Some(v) = n.get("lowercase") {
                    self.lowercase = v.as_bool();
                }
                if let Some(v) = n.get("strip_accents") {
                    self.strip_accents = v.as_bool();
                }
            }
            Some("Sequence") => {
                for m in n
                    .get("normalizers")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.normalizer(m);
                }
            }
            _ => {}
        }
    }
}

/// tokenizer.json's merges as gguf-py writes them.
fn merges(tok: &Value) -> anyhow::Result<Vec<String>> {
    let Some(ms) = tok.pointer("/model/merges").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let space = |s: &str| s.replace(' ', "\u{120}");
    ms.iter()
        .map(|m| match m {
            Value::String(s) => Ok(s.clone()),
            Value::Array(p) => match (
                p.first().and_then(Value::as_str),
                p.get(1).and_then(Value::as_str),
            ) {
                (Some(a), Some(b)) if p.len() == 2 => Ok(format!("{} {}", space(a), space(b))),
                _ => anyhow::bail!("tokenizer.json: a merge is not a pair of strings: {m}"),
            },
            _ => anyhow::bail!("tokenizer.json: unknown merges format: {m}"),
        })
        .collect()
}

/// The content of a `<type>_token` entry (a string, or {"content": …}).
fn token_content(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

/// The id of a special token of the `SpecialToken` step of a template.
fn special_of(step: Option<&Value>) -> Option<String> {
    step?
        .get("SpecialToken")?
        .get("id")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// Python's truth of a JSON value (None, "", {} and [] are false).
fn truthy(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// Whether a tokenizer_config.json entry is the string `s` (gguf-py compares the raw entry:
/// an {"content": …} entry never equals a template's token).
fn is(v: &Option<Value>, s: &str) -> bool {
    matches!(v, Some(Value::String(x)) if x == s)
}

/// gguf-py's reading of a TemplateProcessing post-processor; `cfg` is tokenizer_config.json
/// (None without one), updated as gguf-py updates it; `types` may gain eot / eom.
fn template_processing(
    sv: &mut Special,
    p: &Value,
    cfg: &mut Option<Map<String, Value>>,
    types: &mut Vec<String>,
) {
    let get =
        |cfg: &Option<Map<String, Value>>, k: &str| cfg.as_ref().and_then(|c| c.get(k).cloned());
    let (mut bos, mut eos) = (get(cfg, "bos_token"), get(cfg, "eos_token"));
    let (mut cls, mut sep) = (get(cfg, "cls_token"), get(cfg, "sep_token"));
    let single = p
        .get("single")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let pair = p
        .get("pair")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let set_cfg = |cfg: &mut Option<Map<String, Value>>, k: &str, v: Value| {
        if let Some(c) = cfg.as_mut() {
            c.insert(k.into(), v);
        }
    };
    let mut first = None;
    let mut last = None;
    if single.len() > 1 {
        first = special_of(single.first());
        if let Some(f) = &first {
            let s = Value::String(f.clone());
            if cfg.is_none() {
                bos = Some(s);
            } else if !is(&bos, f) && !is(&cls, f) {
                if !truthy(&bos) {
                    bos = Some(s.clone());
                    set_cfg(cfg, "bos_token", s.clone());
                }
                if !truthy(&cls) {
                    cls = Some(s.clone());
                    set_cfg(cfg, "cls_token", s);
                }
            }
            sv.set_add("bos", is(&bos, f) || is(&cls, f));
        }
        last = special_of(single.last());
        if let Some(l) = &last {
            let s = Value::String(l.clone());
            if cfg.is_none() {
                eos = Some(s);
            } else if !is(&eos, l) {
                let old = eos.clone().unwrap_or(Value::Null);
                if !types.iter().any(|t| t == "eot") {
                    types.push("eot".into());
                    set_cfg(cfg, "eot_token", old);
                } else if !types.iter().any(|t| t == "eom") {
                    types.push("eom".into());
                    set_cfg(cfg, "eom_token", old);
                }
                eos = Some(s.clone());
                set_cfg(cfg, "eos_token", s);
            }
            sv.set_add("eos", is(&eos, l));
        }
    }
    if pair.is_empty() {
        return;
    }
    let start = usize::from(first.is_some() && special_of(pair.first()) == first);
    let stop = match last.is_some() && special_of(pair.last()) == last {
        true => pair.len().saturating_sub(1),
        false => pair.len(),
    };
    let mid = pair.get(start..stop).unwrap_or(&[]);
    if mid.is_empty() {
        return;
    }
    let seq = |s: Option<&Value>| {
        s.and_then(|s| s.pointer("/Sequence/id"))
            .and_then(Value::as_str)
            .map(String::from)
    };
    let (a, b) = (seq(mid.first()), seq(mid.last()));
    if a.as_deref() != Some("A") || b.as_deref() != Some("B") || mid.len() < 3 {
        return;
    }
    let inner = &mid[1..mid.len() - 1];
    let is_sep = |e: &Option<String>| e.as_deref().is_some_and(|e| is(&sep, e) || is(&eos, e));
    let mut add_sep = false;
    if is_sep(&special_of(inner.first())) && last.is_none() {
        add_sep = true;
    }
    if inner.len() == 2 && is_sep(&special_of(inner.get(1))) {
        add_sep = true;
    }
    sv.set_add("sep", add_sep);
    if add_sep && !truthy(&sep) {
        if let Some(e) = eos.clone() {
            set_cfg(cfg, "sep_token", e.clone());
            sep = Some(e);
        }
    }
    let _ = sep;
}

/// The chat template: tokenizer_config.json's `chat_template`, else chat_template.jinja (with
/// any additional_chat_templates/*.jinja as named ones), else chat_template.json's.
fn chat_template(dir: &Path, cfg: &Map<String, Value>) -> anyhow::Result<Option<Value>> {
    if let Some(t) = cfg.get("chat_template") {
        return Ok(match t {
            Value::String(_) | Value::Array(_) => Some(t.clone()),
            _ => None,
        });
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let t = std::fs::read_to_string(&jinja)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", jinja.display()))?;
        let mut extra = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir.join("additional_chat_templates")) {
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "jinja") {
                    let name = p.file_stem().map(|s| s.to_string_lossy().into_owned());
                    let text = std::fs::read_to_string(&p)
                        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?;
                    extra.push(serde_json::json!({"name": name, "template": text}));
                }
            }
        }
        if extra.is_empty() {
            return Ok(Some(Value::String(t)));
        }
        extra.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        extra.insert(0, serde_json::json!({"name": "default", "template": t}));
        return Ok(Some(Value::Array(extra)));
    }
    Ok(read_json(&dir.join("chat_template.json"))?.and_then(|v| v.get("chat_template").cloned()))
}

/// gguf-py's `SpecialVocab(dir, load_merges, n_vocab=n_vocab)`.
pub(crate) fn read(
    dir: &Path,
    load_merges: bool,
    n_vocab: Option<usize>,
) -> anyhow::Result<Special> {
    let mut sv = Special::default();
    let tok = read_json(&dir.join("tokenizer.json"))?;
    let mut cfg = read_json(&dir.join("tokenizer_config.json"))?.and_then(|v| match v {
        Value::Object(m) => Some(m),
        _ => None,
    });
    let mut types: Vec<String> = TYPES.iter().map(|s| s.to_string()).collect();
    let mut added: Vec<Value> = Vec::new();
    if let Some(tok) = &tok {
        if load_merges {
            sv.merges = merges(tok)?;
        }
        if let Some(n) = tok.get("normalizer").filter(|n| !n.is_null()) {
            sv.normalizer(n);
        }
        added = tok
            .get("added_tokens")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if let Some(c) = cfg.as_mut() {
            let has = |c: &Map<String, Value>, k: &str| {
                token_content(c.get(k)).is_some_and(|s| !s.is_empty())
            };
            if !has(c, "bos_token") && has(c, "cls_token") {
                let v = c["cls_token"].clone();
                c.insert("bos_token".into(), v);
            }
            if !has(c, "eos_token") && has(c, "sep_token") {
                let v = c["sep_token"].clone();
                c.insert("eos_token".into(), v);
            }
        }
        if let Some(pp) = tok.get("post_processor").filter(|p| !p.is_null()) {
            let procs = match pp.get("processors").and_then(Value::as_array) {
                Some(ps) => ps.clone(),
                None => vec![pp.clone()],
            };
            for p in &procs {
                match p.get("type").and_then(Value::as_str) {
                    Some("ByteLevel") => {
                        for t in ["bos", "eos"] {
                            if sv.adds(t).is_none() {
                                sv.set_add(t, false);
                            }
                        }
                    }
                    Some("RobertaProcessing") => {
                        for t in ["bos", "eos", "sep"] {
                            sv.set_add(t, true);
                        }
                        roberta_tokens(p, &mut cfg);
                    }
                    Some("TemplateProcessing") => {
                        template_processing(&mut sv, p, &mut cfg, &mut types)
                    }
                    _ => {}
                }
            }
        }
    }
    if let Some(cfg) = &cfg {
        sv.chat_template = chat_template(dir, cfg)?;
        for typ in &types {
            if let Some(a) = cfg
                .get(&format!("add_{typ}_token"))
                .and_then(Value::as_bool)
            {
                if sv.adds(typ).is_none() {
                    sv.set_add(typ, a);
                }
            }
            let Some(content) = token_content(cfg.get(&format!("{typ}_token"))) else {
                continue;
            };
            let id = added
                .iter()
                .find(|t| t.get("content").and_then(Value::as_str) == Some(&content))
                .and_then(|t| t.get("id"));
            sv.set_id(typ, id, n_vocab);
        }
    }
    if let Some(c) = read_json(&dir.join("config.json"))? {
        for typ in &types {
            let key = format!("{typ}_token_id");
            let id = c
                .get(&key)
                .filter(|v| !v.is_null())
                .or_else(|| c.get("text_config")?.get(&key));
            sv.set_id(typ, id, n_vocab);
        }
    }
    Ok(sv)
}

/// RobertaProcessing's cls / sep tokens fill tokenizer_config.json's where it has none.
fn roberta_tokens(p: &Value, cfg: &mut Option<Map<String, Value>>) {
    let Some(c) = cfg.as_mut() else { return };
    for (k, from, fallback) in [
        ("cls_token", "cls", "bos_token"),
        ("sep_token", "sep", "eos_token"),
    ] {
        if token_content(c.get(k)).is_some_and(|s| !s.is_empty()) {
            continue;
        }
        let v = p
            .get(from)
            .and_then(|v| v.get(0))
            .cloned()
            .or_else(|| c.get(fallback).cloned());
        if let Some(v) = v {
            c.insert(k.into(), v);
        }
    }
}

/// The GGUF key of a special-token type's id (gguf-py's `add_<type>_token_id`); None for a
/// type it has no key for (cls).
pub(crate) fn id_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.bos_token_id",
        "eos" => "tokenizer.ggml.eos_token_id",
        "unk" => "tokenizer.ggml.unknown_token_id",
        "sep" => "tokenizer.ggml.seperator_token_id",
        "pad" => "tokenizer.ggml.padding_token_id",
        "mask" => "tokenizer.ggml.mask_token_id",
        "eot" => "tokenizer.ggml.eot_token_id",
        "eom" => "tokenizer.ggml.eom_token_id",
        _ => return None,
    })
}

/// The GGUF key of an add-token flag (gguf-py's `add_add_<type>_token`).
pub(crate) fn add_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.add_bos_token",
        "eos" => "tokenizer.ggml.add_eos_token",
        "sep" => "tokenizer.ggml.add_sep_token",
        _ => return None,
    })
}
