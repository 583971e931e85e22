//! One record (a row of jsonl, json or parquet) → token ids and labels, in a format.

use super::columns::{chat_messages, Columns, SHAREGPT};
use super::record::Field;
use super::{alpaca_prompt, chat, TextTokenizer, IGNORE};
use crate::recipe::DataFormat;
use anyhow::{bail, Context, Result};

/// One row as parsed: ids, labels, and how its completions ended.
pub(super) struct Row {
    pub(crate) ids: Vec<u32>,
    pub(crate) labels: Vec<i64>,
    pub(crate) eos_added: usize,
    pub(crate) turn_ends: Vec<u32>,
}

/// The format's name as a recipe writes it.
pub(crate) fn format_name(f: DataFormat) -> &'static str {
    match f {
        DataFormat::Tokens => "tokens",
        DataFormat::Text => "text",
        DataFormat::Alpaca => "alpaca",
        DataFormat::Chat => "chat",
        DataFormat::Completion => "completion",
    }
}

/// How a file's rows are read: format, columns, and what the format needs.
pub(super) struct RowSpec<'a> {
    pub(crate) format: DataFormat,
    pub(crate) completions_only: bool,
    pub(crate) columns: &'a Columns,
    pub(crate) tok: Option<&'a TextTokenizer>,
    pub(crate) chat: Option<&'a chat::ChatTemplate>,
}

/// One record (a jsonl line, a json array element, a parquet row) → tokens and labels.
pub(super) fn parse_row(rec: &Field, spec: &RowSpec) -> Result<Row> {
    let plain = |ids: Vec<u32>, labels: Vec<i64>| Row {
        ids,
        labels,
        eos_added: 0,
        turn_ends: Vec::new(),
    };
    let cols = spec.columns;
    if let (DataFormat::Chat, Some(tok), Some(chat)) = (spec.format, spec.tok, spec.chat) {
        let col = cols.column("messages");
        if !matches!(rec, Field::Map(_)) {
            bail!("expected a JSON object with \"{col}\"");
        }
        let (col, turns) = match (rec.get(col), rec.get(SHAREGPT)) {
            (Some(t), _) => (col, t),
            (None, Some(t)) if cols.sharegpt_fallback => (SHAREGPT, t),
            _ => bail!("expected \"{col}\": a list of {{\"role\", \"content\"}} objects"),
        };
        let messages = chat_messages(turns, col)?;
        if chat.generation_blocks && messages.any_str(&|s| s.contains(['\u{F8F0}', '\u{F8F1}'])) {
            bail!("the row contains U+F8F0 / U+F8F1, which mark generation blocks");
        }
        let messages = messages.to_value();
        let ex = chat.encode(tok, &messages, spec.completions_only)?;
        return Ok(Row {
            ids: ex.ids,
            labels: ex.labels,
            eos_added: ex.eos_added,
            turn_ends: ex.turn_ends,
        });
    }
    let field = |ours: &str, required: bool| -> Result<String> {
        let k = cols.column(ours);
        match rec.get(k) {
            Some(Field::Str(s)) => Ok(s.clone()),
            None | Some(Field::Null) if !required => Ok(String::new()),
            _ => bail!("expected a string field \"{k}\""),
        }
    };
    let completions_only = spec.completions_only;
    let (ids, labels) = match (spec.format, spec.tok) {
        (DataFormat::Tokens, _) => parse_tokens_row(rec, cols)?,
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
            &field("prompt", true)?,
            &field("completion", true)?,
            completions_only,
        )?,
        _ => bail!(
            "format \"{}\" needs the model's tokenizer",
            format_name(spec.format)
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

fn parse_tokens_row(row: &Field, cols: &Columns) -> Result<(Vec<u32>, Vec<i64>)> {
    let (ic, lc) = (cols.column("input_ids"), cols.column("labels"));
    let ids: Vec<u32> = match row.get(ic) {
        Some(Field::List(v)) => v
            .iter()
            .map(|x| match x {
                Field::Int(t) => u32::try_from(*t).ok(),
                _ => None,
            })
            .collect::<Option<_>>()
            .with_context(|| format!("\"{ic}\" must hold non-negative integers"))?,
        _ => bail!("expected \"{ic}\": a list of token ids"),
    };
    let labels: Vec<i64> = match row.get(lc) {
        None | Some(Field::Null) => ids.iter().map(|&t| t as i64).collect(),
        Some(Field::List(v)) => v
            .iter()
            .map(|x| match x {
                Field::Int(t) => Some(*t),
                _ => None,
            })
            .collect::<Option<_>>()
            .with_context(|| format!("\"{lc}\" must hold integers"))?,
        Some(_) => bail!("\"{lc}\" must be a list"),
    };
    if labels.len() != ids.len() {
        bail!(
            "\"{lc}\" has {} entries but \"{ic}\" has {}",
            labels.len(),
            ids.len()
        );
    }
    Ok((ids, labels))
}
