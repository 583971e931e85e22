//! Chat rows: `messages` rendered with the model's Jinja chat template the way transformers'
//! `apply_chat_template` renders it, tokenized as a whole, and labelled turn by turn.
//!
//! Rendering: minijinja with the environment transformers builds (trim_blocks, lstrip_blocks,
//! loop controls, Python string/dict methods, a json.dumps-compatible `tojson`,
//! `raise_exception`, `strftime_now`), the variables it passes (messages, tools = None,
//! documents = None, add_generation_prompt, and the special tokens bos_token, eos_token, ...),
//! and its message clean-up (keys whose value is null are dropped; reasoning_content / thinking
//! / reasoning are aliased). The text is tokenized with add_special_tokens = false, as there.
//!
//! Which tokens an assistant turn owns (targets under train_on = "completions"):
//! 1. A template with `{% generation %}` blocks marks them itself (as transformers'
//!    return_assistant_tokens_mask reads them).
//! 2. Otherwise, for the assistant message i, render messages[..i] with the generation prompt
//!    (P) and messages[..=i] without it (R). When the full text starts with R and R with P, the
//!    turn is exactly the text between: what the model has to write after the generation
//!    prompt, tool calls included.
//! 3. Otherwise (templates that rewrite earlier turns depending on later ones) the turn is the
//!    message's content, found in the text after the previous turn (as written, or stripped).
//!
//! Every turn then ends at a stop token (tokenizer_config.json eos_token, and the eos_token_id
//! of generation_config.json and config.json): the text after the last stop token of the turn
//! (e.g. ChatML's "\n") is not a target; a turn with none takes the stop token that follows it
//! after whitespace only; a turn with no stop token at all gets the EOS token inserted after it
//! (counted), so that a fine-tuned model always learns to stop. A token that straddles a turn
//! boundary counts as part of the turn.

use super::{Span, TextTokenizer};
use crate::data::IGNORE;
use anyhow::{bail, Context, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use std::path::Path;

/// Markers that stand for `{% generation %}` / `{% endgeneration %}` in the rendered text
/// (Unicode private use; rows containing them are refused).
const GEN_OPEN: char = '\u{F8F0}';
const GEN_CLOSE: char = '\u{F8F1}';

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for errors: "tokenizer_config.json", a file, ...
    pub(crate) source: String,
    /// The template marks assistant text with `{% generation %}` blocks.
    pub(crate) generation_blocks: bool,
    /// bos_token, eos_token, ... as tokenizer_config.json names them (template variables).
    specials: Vec<(String, String)>,
    /// sha256 of the template's text (the tokenized cache's key).
    pub(super) digest: [u8; 32],
}

/// One rendering: the text, and the byte spans `{% generation %}` blocks produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The rendered text.
    pub text: String,
    pub(crate) generation: Vec<Span>,
}

/// A tokenized conversation: ids, aligned labels, and how its turns ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatExample {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Aligned with `ids`: the token where it is a target (assistant turns), else `IGNORE`.
    pub labels: Vec<i64>,
    /// Assistant turns that had no stop token and got the EOS inserted.
    pub eos_added: usize,
    /// The stop token that ends each assistant turn (inserted EOS tokens last).
    pub turn_ends: Vec<u32>,
}

impl ChatTemplate {
    /// The template to use: `choice` as a .jinja path, else `model_dir/chat_template.jinja`
    /// (what transformers saves since 4.43), else tokenizer_config.json's `chat_template` (a
    /// string, or a list of {name, template}: `choice` names one, default "default").
    pub fn load(
        model_dir: &Path,
        tokenizer_config: Option<&Path>,
        choice: Option<&str>,
        specials: Vec<(String, String)>,
    ) -> Result<ChatTemplate> {
        let (source, text) = match choice {
            Some(p) if p.ends_with(".jinja") => (
                p.to_string(),
                std::fs::read_to_string(p).with_context(|| format!("cannot read {p}"))?,
            ),
            _ => {
                let file = model_dir.join("chat_template.jinja");
                if choice.is_none() && file.is_file() {
                    let text = std::fs::read_to_string(&file)
                        .with_context(|| format!("cannot read {}", file.display()))?;
                    (file.display().to_string(), text)
                } else {
                    from_tokenizer_config(model_dir, tokenizer_config, choice)?
                }
            }
        };
        Self::from_source(&source, &text, specials)
    }

    /// Compiles `text` (named `source` in errors).
    pub fn from_source(
        source: &str,
        text: &str,
        specials: Vec<(String, String)>,
    ) -> Result<ChatTemplate> {
        let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes())
            .as_ref()
            .try_into()
            .unwrap_or([0; 32]);
        let (text, generation_blocks) = rewrite_generation_tags(text);
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat_template", text).map_err(|e| {
            anyhow::anyhow!("the chat template in {source} does not compile: {e:#}")
        })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            generation_blocks,
            specials,
            digest,
        })
    }

    /// Renders `messages` (a list of message maps, already normalized).
    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<Rendered> {
        let tmpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut ctx: Vec<(String, Value)> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages".into(), Value::from(messages.to_vec())));
        ctx.push(("tools".into(), Value::from(())));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let raw = tmpl
            .render(Value::from_pairs(ctx))
            .map_err(|e| anyhow::anyhow!("chat template ({}): {}", self.source, jinja_error(&e)))?;
        if !self.generation_blocks {
            return Ok(Rendered {
                text: raw,
                generation: Vec::new(),
            });
        }
        let mut text = String::with_capacity(raw.len());
        let mut generation = Vec::new();
        let mut open = None;
        for c in raw.chars() {
            match c {
                GEN_OPEN => open = Some(text.len()),
                GEN_CLOSE => {
                    if let Some(s) = open.take() {
                        generation.push((s, text.len()));
                    }
                }
                _ => text.push(c),
            }
        }
        Ok(Rendered { text, generation })
    }

    /// Renders, tokenizes and labels one conversation (`messages` as parsed from the row).
    /// `completions_only`: only assistant turns are targets; otherwise every token is.
    pub fn encode(
        &self,
        tok: &TextTokenizer,
        messages: &Value,
        completions_only: bool,
    ) -> Result<ChatExample> {
        let msgs = normalize_messages(messages)?;
        let full = self.render(&msgs, false)?;
        let text = &full.text;
        let spans = if self.generation_blocks {
            full.generation.clone()
        } else {
            self.assistant_spans(&msgs, text)?
        };
        let (ids, offsets) = tok.encode_offsets(text)?;
        let stop = |id: u32| tok.stop_ids.contains(&id);
        let mut target = vec![!completions_only; ids.len()];
        // (position after which the EOS goes) for turns without a stop token.
        let mut insert_eos = Vec::new();
        let mut turn_ends = Vec::new();
        for &(s, e) in &spans {
            let inside: Vec<usize> = (0..ids.len())
                .filter(|&j| {
                    let (a, b) = offsets[j];
                    a < b && a < e && b > s
                })
                .collect();
            let (Some(&first), Some(&last)) = (inside.first(), inside.last()) else {
                continue;
            };
            let mut end = inside.iter().rev().find(|&&j| stop(ids[j])).copied();
            if end.is_none() {
                // The stop token that follows after whitespace only.
                let mut j = last + 1;
                while j < ids.len() && !stop(ids[j]) && is_blank(text, offsets[j]) {
                    j += 1;
                }
                end = (j < ids.len() && stop(ids[j])).then_some(j);
            }
            match end {
                Some(end) => {
                    target[first..=end].iter_mut().for_each(|t| *t = true);
                    turn_ends.push(ids[end]);
                }
                None => {
                    // No stop token: trailing whitespace is not a target, the EOS is.
                    let mut last = last;
                    while last > first && is_blank(text, offsets[last]) {
                        last -= 1;
                    }
                    target[first..=last].iter_mut().for_each(|t| *t = true);
                    insert_eos.push(last);
                }
            }
        }
        let eos_added = insert_eos.len();
        let mut labels: Vec<i64> = ids
            .iter()
            .zip(&target)
            .map(|(&id, &t)| if t { id as i64 } else { IGNORE })
            .collect();
        let mut ids = ids;
        if !insert_eos.is_empty() {
            let (_, eos) = tok.eos_token.clone().with_context(|| {
                format!(
                    "the chat template ({}) ends assistant turns with no stop token, and tokenizer_config.json names no eos_token to end them with",
                    self.source
                )
            })?;
            for &j in insert_eos.iter().rev() {
                ids.insert(j + 1, eos);
                labels.insert(j + 1, eos as i64);
                turn_ends.push(eos);
            }
        }
        Ok(ChatExample {
            ids,
            labels,
            eos_added,
            turn_ends,
        })
    }

    /// Byte spans of the assistant turns in `text` (see the module comment, steps 2 and 3).
    fn assistant_spans(&self, msgs: &[Value], text: &str) -> Result<Vec<Span>> {
        let mut spans = Vec::new();
        // End of the last assistant turn, and of the last user turn found after it.
        let (mut cursor, mut seek) = (0, 0);
        for (i, m) in msgs.iter().enumerate() {
            let role = m.get_attr("role").ok();
            let content = m.get_attr("content").ok();
            let content = content.as_ref().and_then(Value::as_str).unwrap_or("");
            match role.as_ref().and_then(Value::as_str) {
                Some("assistant") => {}
                // Step past user (and tool) turns, so that an answer quoted in the question is
                // not taken for the answer; system prompts are left alone, as templates move
                // them (into the first or last user turn).
                Some("system") | None => continue,
                Some(_) => {
                    seek = seek.max(cursor);
                    if let Some(at) = (!content.is_empty())
                        .then(|| text[seek..].find(content))
                        .flatten()
                    {
                        seek += at + content.len();
                    }
                    continue;
                }
            }
            let prompt = self.render(&msgs[..i], true)?.text;
            let upto = self.render(&msgs[..=i], false)?.text;
            if prompt.len() >= cursor
                && upto.len() >= prompt.len()
                && upto.starts_with(&prompt)
                && text.starts_with(&upto)
            {
                spans.push((prompt.len(), upto.len()));
                cursor = upto.len();
                continue;
            }
            let mut from = cursor.max(seek);
            if text.starts_with(&prompt) {
                from = from.max(prompt.len());
            }
            let found = [content, content.trim()]
                .into_iter()
                .filter(|c| !c.is_empty())
                .find_map(|c| {
                    text[from..]
                        .find(c)
                        .map(|at| (from + at, from + at + c.len()))
                });
            let Some(span) = found else {
                bail!(
                    "message {i} (assistant): its content does not appear in the text the chat template renders, so its tokens cannot be told from the prompt's; use train_on = \"all\", or a template with {{% generation %}} blocks"
                );
            };
            spans.push(span);
            cursor = span.1;
        }
        Ok(spans)
    }
}

/// The `chat_template` of tokenizer_config.json, and where it came from.
fn from_tokenizer_config(
    model_dir: &Path,
    tokenizer_config: Option<&Path>,
    choice: Option<&str>,
) -> Result<(String, String)> {
    let Some(p) = tokenizer_config else {
        bail!(
            "{} has no chat_template.jinja and no tokenizer_config.json: set data.chat_template to a .jinja file",
            model_dir.display()
        );
    };
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
    )
    .with_context(|| format!("{} is not valid JSON", p.display()))?;
    let source = p.display().to_string();
    match v.get("chat_template") {
        Some(serde_json::Value::String(t)) => match choice {
            Some(name) if name != "default" => bail!(
                "{source} has a single chat_template, not one named \"{name}\": leave data.chat_template unset, or set it to a .jinja file"
            ),
            _ => Ok((source, t.clone())),
        },
        Some(serde_json::Value::Array(list)) => {
            let want = choice.unwrap_or("default");
            let mut names = Vec::new();
            for t in list {
                let name = t.get("name").and_then(|n| n.as_str()).unwrap_or("");
                if name == want {
                    let text = t.get("template").and_then(|n| n.as_str()).with_context(|| {
                        format!("{source}: chat_template \"{name}\" has no \"template\" string")
                    })?;
                    return Ok((format!("{source} (\"{name}\")"), text.to_string()));
                }
                names.push(format!("\"{name}\""));
            }
            bail!(
                "{source} has no chat template named \"{want}\"; it has {}: set data.chat_template to one of them",
                names.join(", ")
            )
        }
        _ => bail!(
            "{} has no chat template (no chat_template.jinja, no chat_template in {source}): set data.chat_template to a .jinja file",
            model_dir.display()
        ),
    }
}

/// transformers' clean-up of each message: keys whose value is null are dropped, and the
/// reasoning (reasoning_content / thinking / reasoning) is also given as `thinking` (first)
/// and `reasoning_content` (last), the names templates read.
pub fn normalize_messages(messages: &Value) -> Result<Vec<Value>> {
    if messages.kind() != ValueKind::Seq {
        bail!("\"messages\" must be a list of {{\"role\", \"content\"}} objects");
    }
    let mut out = Vec::new();
    for (i, m) in messages
        .try_iter()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .enumerate()
    {
        if m.kind() != ValueKind::Map {
            bail!("message {i} is not an object");
        }
        let mut pairs: Vec<(Value, Value)> = Vec::new();
        for k in m.try_iter().map_err(|e| anyhow::anyhow!("{e}"))? {
            let v = m.get_item(&k).map_err(|e| anyhow::anyhow!("{e}"))?;
            if !v.is_none() && !v.is_undefined() {
                pairs.push((k, v));
            }
        }
        let get = |k: &str| pairs.iter().find(|(n, _)| n.as_str() == Some(k));
        if get("role").and_then(|(_, v)| v.as_str()).is_none() {
            bail!("message {i} has no string \"role\"");
        }
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| get(k).map(|(_, v)| v.clone()));
        if let Some(r) = reasoning {
            if get("thinking").is_none() {
                pairs.insert(0, (Value::from("thinking"), r.clone()));
            }
            match pairs
                .iter_mut()
                .find(|(n, _)| n.as_str() == Some("reasoning_content"))
            {
                Some(p) => p.1 = r,
                None => pairs.push((Value::from("reasoning_content"), r)),
            }
        }
        out.push(Value::from_pairs(pairs));
    }
    Ok(out)
}

fn is_blank(text: &str, (a, b): (usize, usize)) -> bool {
    text.get(a..b).is_some_and(|s| s.trim().is_empty())
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' AssistantTracker tags) become
/// no-op `if` blocks that print a marker, keeping each tag's whitespace control:
/// `{%L generation R%}` → `{%L if true %}{% endif %}OPEN{% if true R%}` and
/// `{%L endgeneration R%}` → `{%L endif %}CLOSE{% if true %}{% endif R%}`.
fn rewrite_generation_tags(src: &str) -> (String, bool) {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..close];
        let left = inner
            .chars()
            .next()
            .filter(|c| *c == '-' || *c == '+')
            .map(String::from)
            .unwrap_or_default();
        let right = inner
            .chars()
            .last()
            .filter(|c| (*c == '-' || *c == '+') && inner.len() > left.len())
            .map(String::from)
            .unwrap_or_default();
        let word = inner[left.len()..inner.len() - right.len()].trim();
        let replacement = match word {
            "generation" => Some(format!(
                "{{%{left} if true %}}{{% endif %}}{{{{ \"{GEN_OPEN}\" }}}}{{% if true {right}%}}"
            )),
            "endgeneration" => Some(format!(
                "{{%{left} endif %}}{{{{ \"{GEN_CLOSE}\" }}}}{{% if true %}}{{% endif {right}%}}"
            )),
            _ => None,
        };
        match replacement {
            Some(r) => {
                found = true;
                out.push_str(&r);
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// A template error with its cause (raise_exception's message).
fn jinja_error(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time, Python strftime codes
/// %d %m %Y %y %b %B %a %A %H %M %S %j %%.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(secs, &format)))
}

/// Python's `strftime` for a UTC unix time (the codes of `strftime_now`).
pub(crate) fn strftime(secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, with those keyword arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item, key)",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = PyJson {
        indent,
        item,
        key,
        ascii: ensure_ascii.unwrap_or(false),
        sort: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// The layout of Python's json.dumps.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

impl PyJson {
    fn write(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        let bad = |what: &str| {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: {what} is not JSON serializable"),
            ))
        };
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    out.push_str(&py_float(f64::try_from(v.clone())?));
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort();
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    match k.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.write(&v.get_item(k)?, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            ValueKind::Undefined => return bad("Undefined"),
            _ => return bad(&v.kind().to_string()),
        }
        Ok(())
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for u in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's repr of a float: shortest round-trip digits, exponent form below 1e-4 and from
/// 1e16 on (with a sign and at least two exponent digits), "NaN" / "Infinity" as json.dumps.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = x.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{x:e}"); // e.g. 1.5e-7
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    format!("{x:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_309;
        assert_eq!(
            strftime(t, "%d %b %Y|%B %m %y|%a %A|%H:%M:%S|%j|%%"),
            "26 Jul 2024|July 07 24|Fri Friday|13:25:09|208|%"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = ChatTemplate::from_source(
            "test",
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 'é\"<' | tojson(ensure_ascii=true) }}",
            vec![],
        )
        .unwrap();
        let x: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, 1e-7, true, null], "a": {}, "c": "<x>"}"#)
                .unwrap();
        let env = &t.env;
        let out = env
            .get_template("chat_template")
            .unwrap()
            .render(Value::from_pairs([("x", x)]))
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, 1e-07, true, null], \"a\": {}, \"c\": \"<x>\"}|{\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    true,\n    null\n  ],\n  \"a\": {},\n  \"c\": \"<x>\"\n}|\"\\u00e9\\\"<\""
        );
    }

    #[test]
    fn generation_tags_become_markers_with_their_whitespace_control() {
        let (src, found) = rewrite_generation_tags("a{%- generation -%} b {% endgeneration %}c");
        assert!(found);
        assert!(src.starts_with("a{%- if true %}{% endif %}"), "{src}");
        // As Jinja: `{%-` / `-%}` strip the spaces, trim_blocks the newline after a tag.
        let t = ChatTemplate::from_source(
            "t",
            "a  {%- generation -%}  b  {%- endgeneration %}\nc{% generation %}d{% endgeneration %}",
            vec![],
        )
        .unwrap();
        let r = t.render(&[], false).unwrap();
        assert_eq!(r.text, "abcd");
        assert_eq!(r.generation, vec![(1, 2), (3, 4)]);
    }
}
