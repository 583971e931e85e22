//! Which column of a data set holds each field a format reads (`[data] columns`), and the
//! ShareGPT layout of chats (`conversations: [{from, value}]`) as chat messages.

use super::record::Field;
use super::rows::format_name;
use crate::recipe::{DataFormat, DataSection};
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// The column ShareGPT data sets keep their turns in, read when a chat row has no "messages".
pub(crate) const SHAREGPT: &str = "conversations";

/// A format's fields: (our name, required).
pub(crate) fn fields(format: DataFormat) -> &'static [(&'static str, bool)] {
    match format {
        DataFormat::Tokens => &[("input_ids", true), ("labels", false)],
        DataFormat::Text => &[("text", true)],
        DataFormat::Alpaca => &[("instruction", true), ("input", false), ("output", true)],
        DataFormat::Completion => &[("prompt", true), ("completion", true)],
        DataFormat::Chat => &[("messages", true)],
    }
}

/// Our field name → the data set's column, for one format.
#[derive(Debug, Clone)]
pub(crate) struct Columns {
    /// (our name, column, required), in the format's field order.
    cols: Vec<(&'static str, String, bool)>,
    /// "messages" was not mapped: a row without it may hold ShareGPT "conversations".
    pub(crate) sharegpt_fallback: bool,
}

impl Columns {
    /// The mapping `map` (data.columns, or a mix entry's) for `format`; completion rows take
    /// their default names from data.prompt_field / completion_field. A key the format does not
    /// read is an error naming the format's fields.
    pub(crate) fn new(
        format: DataFormat,
        cfg: &DataSection,
        map: &BTreeMap<String, String>,
    ) -> Result<Columns, String> {
        check_keys(format, map)?;
        let cols = fields(format)
            .iter()
            .map(|&(ours, required)| {
                let default = match ours {
                    "prompt" => cfg.prompt_field.clone(),
                    "completion" => cfg.completion_field.clone(),
                    _ => ours.to_string(),
                };
                let col = map.get(ours).cloned().unwrap_or(default);
                (ours, col, required)
            })
            .collect();
        Ok(Columns {
            cols,
            sharegpt_fallback: format == DataFormat::Chat && !map.contains_key("messages"),
        })
    }

    /// The column holding our field `ours` (its own name when unmapped).
    pub(crate) fn column<'a>(&'a self, ours: &'a str) -> &'a str {
        self.cols
            .iter()
            .find(|(o, ..)| *o == ours)
            .map_or(ours, |(_, c, _)| c.as_str())
    }

    /// (our name, column, required) for every field of the format.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&'static str, &str, bool)> {
        self.cols.iter().map(|(o, c, r)| (*o, c.as_str(), *r))
    }
}

/// The keys of `map` are fields of `format`, and each names a column.
pub(crate) fn check_keys(format: DataFormat, map: &BTreeMap<String, String>) -> Result<(), String> {
    let known = fields(format);
    for (k, v) in map {
        if !known.iter().any(|(f, _)| f == k) {
            let names: Vec<&str> = known.iter().map(|(f, _)| *f).collect();
            return Err(format!(
                "maps \"{k}\", which format \"{}\" does not read; its fields: {}",
                format_name(format),
                names.join(", ")
            ));
        }
        if v.is_empty() {
            return Err(format!("maps \"{k}\" to an empty column name"));
        }
    }
    Ok(())
}

/// A chat row's turns as {role, content} messages: ShareGPT's {from, value} items mapped
/// (human → user, gpt → assistant, ...); anything else as it is, for the chat template's
/// checks to judge.
pub(crate) fn chat_messages(turns: &Field, column: &str) -> Result<Field> {
    let Field::List(items) = turns else {
        return Ok(turns.clone());
    };
    let sharegpt = items
        .iter()
        .any(|m| m.get("from").is_some() && m.get("role").is_none());
    if !sharegpt {
        return Ok(turns.clone());
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let from = match m.get("from") {
            Some(Field::Str(s)) => s.as_str(),
            Some(other) => bail!(
                "column \"{column}\", turn {i}: \"from\" is {}, expected a string",
                other.kind()
            ),
            None => bail!("column \"{column}\", turn {i} has no \"from\" (ShareGPT turns are {{\"from\", \"value\"}})"),
        };
        let role = sharegpt_role(from).ok_or_else(|| {
            anyhow::anyhow!(
                "column \"{column}\", turn {i}: unknown ShareGPT speaker \"from\": \"{from}\" (known: human, user, gpt, assistant, chatgpt, bing, bard, model, system, tool, observation, function_response)"
            )
        })?;
        let value = match m.get("value") {
            Some(v @ Field::Str(_)) => v.clone(),
            Some(other) => bail!(
                "column \"{column}\", turn {i}: \"value\" is {}, expected a string",
                other.kind()
            ),
            None => bail!("column \"{column}\", turn {i} has no \"value\""),
        };
        out.push(Field::Map(vec![
            ("role".into(), Field::Str(role.into())),
            ("content".into(), value),
        ]));
    }
    Ok(Field::List(out))
}

/// ShareGPT's speaker names (as axolotl and Unsloth's standardize_sharegpt read them).
fn sharegpt_role(from: &str) -> Option<&'static str> {
    Some(match from {
        "human" | "user" => "user",
        "gpt" | "assistant" | "chatgpt" | "bing" | "bard" | "model" => "assistant",
        "system" => "system",
        "tool" | "observation" | "function_response" => "tool",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(lines: &str) -> DataSection {
        toml::from_str(&format!("train = \"x.jsonl\"\n{lines}")).unwrap()
    }

    #[test]
    fn columns_map_our_fields_and_refuse_unknown_ones() {
        let cfg = section("prompt_field = \"q\"");
        let map: BTreeMap<String, String> = [("output".to_string(), "answer".to_string())].into();
        let c = Columns::new(DataFormat::Alpaca, &cfg, &map).unwrap();
        assert_eq!(c.column("output"), "answer");
        assert_eq!(c.column("instruction"), "instruction");
        let c = Columns::new(DataFormat::Completion, &cfg, &BTreeMap::new()).unwrap();
        assert_eq!(
            (c.column("prompt"), c.column("completion")),
            ("q", "completion")
        );
        let e = Columns::new(DataFormat::Text, &cfg, &map).unwrap_err();
        assert_eq!(
            e,
            "maps \"output\", which format \"text\" does not read; its fields: text"
        );
    }

    #[test]
    fn sharegpt_turns_become_messages() {
        let turns: Field = serde_json::from_str(
            r#"[{"from": "system", "value": "s"}, {"from": "human", "value": "q", "weight": 0}, {"from": "gpt", "value": "a"}]"#,
        )
        .unwrap();
        let m = chat_messages(&turns, "conversations").unwrap();
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"[{"role":"system","content":"s"},{"role":"user","content":"q"},{"role":"assistant","content":"a"}]"#
        );
        // Messages with roles pass unchanged (extra keys and all).
        let msgs: Field =
            serde_json::from_str(r#"[{"role": "user", "content": "q", "x": 1}]"#).unwrap();
        assert_eq!(chat_messages(&msgs, "messages").unwrap(), msgs);
        let bad: Field = serde_json::from_str(r#"[{"from": "narrator", "value": "q"}]"#).unwrap();
        let e = chat_messages(&bad, "conversations")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "column \"conversations\", turn 0: unknown ShareGPT speaker \"from\": \"narrator\""
            ),
            "{e}"
        );
        let e = chat_messages(&bad_value(), "conversations")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "column \"conversations\", turn 0: \"value\" is an integer, expected a string"
        );
    }

    fn bad_value() -> Field {
        serde_json::from_str(r#"[{"from": "gpt", "value": 3}]"#).unwrap()
    }
}
