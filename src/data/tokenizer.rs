//! How text becomes tokens: the model's tokenizer.json, tokenizer_config.json's flags and
//! special tokens, and the configs' stop tokens.

use super::{chat, Span, IGNORE};
use anyhow::{Context, Result};
use std::path::Path;

/// How text becomes tokens: the model's tokenizer.json plus its tokenizer_config.json flags,
/// special tokens and chat template.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// tokenizer_config.json's eos_token (whatever add_eos_token says): ends every completion.
    pub(crate) eos_token: Option<(String, u32)>,
    /// Tokens at which generation stops: eos_token, and eos_token_id of generation_config.json
    /// and config.json. A chat turn's targets end with one.
    pub stop_ids: Vec<u32>,
    /// eos_token_id of generation_config.json / config.json (what `generate` stops at).
    pub(crate) generate_stop_ids: Vec<u32>,
    /// bos_token, eos_token, unk_token, ... (those set in tokenizer_config.json): the
    /// variables transformers passes to chat templates.
    pub specials: Vec<(String, String)>,
    /// The chat template, for format "chat".
    pub chat: Option<chat::ChatTemplate>,
    /// sha256 of tokenizer.json and tokenizer_config.json (the tokenized cache's key).
    pub(super) digest: [u8; 32],
}

impl TextTokenizer {
    /// `add_bos_token` / `add_eos_token` (tokenizer_config.json) make sure the sequence starts
    /// with BOS / ends with EOS; otherwise the tokenizer's own post-processor decides.
    pub fn load(tokenizer: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let tok = tokenizers::Tokenizer::from_file(tokenizer)
            .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tokenizer.display()))?;
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        for p in std::iter::once(tokenizer).chain(tokenizer_config) {
            let bytes = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            digest.update(&(bytes.len() as u64).to_le_bytes());
            digest.update(&bytes);
        }
        let mut bos = None;
        let mut eos = None;
        let mut eos_token = None;
        let mut specials = Vec::new();
        if let Some(p) = tokenizer_config {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", p.display()))?;
            // A special token is a string or an AddedToken object {"content": ...}.
            let text_of = |k: &str| -> Option<String> {
                let t = v.get(k)?;
                t.as_str()
                    .or_else(|| t.get("content").and_then(|c| c.as_str()))
                    .map(String::from)
            };
            let token = |k: &str| -> Option<u32> { tok.token_to_id(&text_of(k)?) };
            let flag = |k: &str| v.get(k).and_then(|b| b.as_bool()).unwrap_or(false);
            if flag("add_bos_token") {
                bos = token("bos_token");
            }
            if flag("add_eos_token") {
                eos = token("eos_token");
            }
            eos_token = text_of("eos_token").and_then(|s| Some((s.clone(), tok.token_to_id(&s)?)));
            for k in [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ] {
                if let Some(s) = text_of(k) {
                    specials.push((k.to_string(), s));
                }
            }
        }
        // What `generate` stops at, from the checkpoint's configs beside tokenizer.json.
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let mut generate_stop_ids = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            let Ok(text) = std::fs::read_to_string(dir.join(name)) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => generate_stop_ids.extend(n.as_u64()),
                Some(serde_json::Value::Array(a)) => {
                    generate_stop_ids.extend(a.iter().filter_map(|x| x.as_u64()))
                }
                _ => {}
            }
        }
        let mut generate_stop_ids: Vec<u32> = generate_stop_ids
            .into_iter()
            .filter_map(|x| u32::try_from(x).ok())
            .collect();
        generate_stop_ids.sort_unstable();
        generate_stop_ids.dedup();
        if eos_token.is_none() {
            // No eos_token in tokenizer_config.json: the configs' first EOS id.
            eos_token = generate_stop_ids
                .first()
                .and_then(|&id| Some((tok.id_to_token(id)?, id)));
        }
        let mut stop_ids = generate_stop_ids.clone();
        stop_ids.extend(eos_token.as_ref().map(|e| e.1));
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(TextTokenizer {
            tok,
            bos,
            eos,
            eos_token,
            stop_ids,
            generate_stop_ids,
            specials,
            chat: None,
            digest: digest.finish().as_ref().try_into().unwrap_or([0; 32]),
        })
    }

    /// What tokenizing depends on beyond the files' bytes: the BOS / EOS added, the EOS that
    /// ends completions, the stop tokens (from generation_config.json / config.json too) and
    /// the special tokens.
    pub(super) fn identity(&self) -> impl std::fmt::Debug + '_ {
        (
            self.bos,
            self.eos,
            &self.eos_token,
            &self.stop_ids,
            &self.specials,
        )
    }

    /// `text`'s token ids, with the BOS and EOS this tokenizer is set to add (each once).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(b) = self.bos {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
        if let Some(e) = self.eos {
            if ids.last() != Some(&e) {
                ids.push(e);
            }
        }
        Ok(ids)
    }

    /// A prompt to generate from: as `encode`, with BOS as configured, but never the EOS that
    /// add_eos_token appends to training text (a prompt that ends in EOS asks for nothing).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if self.eos.is_some() && ids.len() > 1 && ids.last() == self.eos.as_ref() {
            ids.pop();
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens (BOS, EOS, chat markers) left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))
    }

    /// A token's text, e.g. "<|im_end|>".
    pub(crate) fn token_text(&self, id: u32) -> Option<String> {
        self.tok.id_to_token(id)
    }

    /// Token ids and their byte spans in `text`, with no special tokens added (as
    /// transformers tokenizes a rendered chat).
    pub fn encode_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Span>)> {
        let enc = self
            .tok
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// prompt + completion as one text (BOS as `encode` adds it), then the EOS token.
    /// Labels: every token, or (`completions_only`) the tokens overlapping the completion and
    /// the EOS; -100 elsewhere.
    pub(crate) fn encode_pair(
        &self,
        prompt: &str,
        completion: &str,
        completions_only: bool,
    ) -> Result<(Vec<u32>, Vec<i64>)> {
        let (_, eos) = self
            .eos_token
            .clone()
            .context("tokenizer_config.json names no eos_token to end completions with")?;
        let text = format!("{prompt}{completion}");
        let enc = self
            .tok
            .encode(text.as_str(), true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        let mut offsets = enc.get_offsets().to_vec();
        if let Some(b) = self.bos {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
                offsets.insert(0, (0, 0));
            }
        }
        if ids.last() != Some(&eos) {
            ids.push(eos);
            offsets.push((text.len(), text.len()));
        }
        let p = prompt.len();
        let last = ids.len() - 1;
        let labels = ids
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(j, (&id, &(a, b)))| {
                let target = !completions_only || j == last || (a < b && b > p);
                if target {
                    id as i64
                } else {
                    IGNORE
                }
            })
            .collect();
        Ok((ids, labels))
    }
}

/// The Alpaca prompt (alpaca-lora's variant of Stanford Alpaca's, ending in a newline).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}
