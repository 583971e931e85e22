//! One record (a row of jsonl, json or parquet) → token ids and labels, in a format.

use super::{alpaca_prompt, chat, TextTokenizer, IGNORE};
use crate::recipe::{DataFormat, DataSection};
use anyhow::{bail, Context, Result};

/// One row as parsed: ids, labels, and how its completions ended.
pub(super) struct Row {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
    pub eos_added: usize,
    pub turn_ends: Vec<u32>,
}

/// The format's name as a recipe writes it.
pub fn format_name(f: DataFormat) -> &'static str {
    match f {
        DataFormat::Tokens => "tokens",
        DataFormat::Text => "text",
        DataFormat::Alpaca => "alpaca",
        DataFormat::Chat => "chat",
        DataFormat::Completion => "completion",
    }
}

/// One jsonl line → tokens and labels, in `format`.
pub(super) fn parse_row(
    line: &str,
    format: DataFormat,
    completions_only: bool,
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    chat: Option<&chat::ChatTemplate>,
) -> Result<Row> {
    let plain = |ids: Vec<u32>, labels: Vec<i64>| Row {
        ids,
        labels,
        eos_added: 0,
        turn_ends: Vec::new(),
    };
    if let (DataFormat::Chat, Some(tok), Some(chat)) = (format, tok, chat) {
        // Parsed into template values directly, keeping each object's key order.
        let row: minijinja::Value = serde_json::from_str(line).context("not valid JSON")?;
        if row.kind() != minijinja::value::ValueKind::Map {
            bail!("expected a JSON object with \"messages\"");
        }
        let messages = row
            .get_attr("messages")
            .ok()
            .filter(|m| !m.is_undefined())
            .context("expected \"messages\": a list of {\"role\", \"content\"} objects")?;
        if chat.generation_blocks && line.contains(['\u{F8F0}', '\u{F8F1}']) {
            bail!("the row contains U+F8F0 / U+F8F1, which mark generation blocks");
        }
        let ex = chat.encode(tok, &messages, completions_only)?;
        return Ok(Row {
            ids: ex.ids,
            labels: ex.labels,
            eos_added: ex.eos_added,
            turn_ends: ex.turn_ends,
        });
    }
    let row: serde_json::Value = serde_json::from_str(line).context("not valid JSON")?;
    let field = |k: &str, required: bool| -> Result<String> {
        match row.get(k) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            None | Some(serde_json::Value::Null) if !required => Ok(String::new()),
            _ => bail!("expected a string field \"{k}\""),
        }
    };
    let (ids, labels) = match (format, tok) {
        (DataFormat::Tokens, _) => parse_tokens_row(&row)?,
        (DataFormat::Text, Some(tok)) => {
            let ids = tok.encode(&field("text", true)?)?;
            let labels = ids.iter().map(|&t| t as i64).collect();
            (ids, labels)
        }
        (DataFormat::Alpaca, Some(tok)) => {
            let prompt = alpaca_prompt(&field("instruction", true)?, &field("input", false)?);
            tok.encode_pair(&prompt, &field("output", true)?, completions_only)?
        }
        (DataFormat::Completion, Some(tok)) => tok.encode_pair(
            &field(&cfg.prompt_field, true)?,
            &field(&cfg.completion_field, true)?,
            completions_only,
        )?,
        _ => bail!(
            "format \"{}\" needs the model's tokenizer",
            format_name(format)
        ),
    };
    Ok(plain(ids, labels))
}

/// Ids inside the vocabulary, labels -100 or inside it, at least one token.
pub(super) fn check_ids(row: &Row, vocab_size: usize) -> Result<()> {
    if row.ids.is_empty() {
        bail!("the row has no tokens");
    }
    if let Some(&bad) = row.ids.iter().find(|&&t| t as usize >= vocab_size) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab_size}");
    }
    if let Some(&bad) = row
        .labels
        .iter()
        .find(|&&l| l != IGNORE && (l < 0 || l as usize >= vocab_size))
    {
        bail!("label {bad} is neither -100 nor a token id below {vocab_size}");
    }
    Ok(())
}

fn parse_tokens_row(row: &serde_json::Value) -> Result<(Vec<u32>, Vec<i64>)> {
    let ids: Vec<u32> = row
        .get("input_ids")
        .and_then(|v| v.as_array())
        .context("expected \"input_ids\": a list of token ids")?
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect::<Option<_>>()
        .context("\"input_ids\" must hold non-negative integers")?;
    let labels: Vec<i64> = match row.get("labels") {
        None | Some(serde_json::Value::Null) => ids.iter().map(|&t| t as i64).collect(),
        Some(v) => v
            .as_array()
            .context("\"labels\" must be a list")?
            .iter()
            .map(|v| v.as_i64())
            .collect::<Option<_>>()
            .context("\"labels\" must hold integers")?,
    };
    if labels.len() != ids.len() {
        bail!(
            "\"labels\" has {} entries but \"input_ids\" has {}",
            labels.len(),
            ids.len()
        );
    }
    Ok((ids, labels))
}
