//! An Ollama Modelfile beside a GGUF export: `FROM` the file (or, for a LoRA GGUF, the base
//! model it goes on, with `ADAPTER` the file), `TEMPLATE` the chat template translated to
//! Ollama's Go template over `.Messages`, and a `PARAMETER stop` for each token that ends a
//! turn.
//!
//! The translation renders the Jinja template on marker messages and reads off what each role
//! puts before and after its content (a system / user / assistant turn, the generation
//! prompt); the Go template repeats those pieces. A template whose pieces depend on more than
//! the role (a message's position besides the first BOS, tools, …) is refused rather than
//! translated wrong: the check renders a three-turn conversation both ways and compares.
//! The BOS the template writes first is left out when llama.cpp adds it (add_bos_token).

use crate::data::chat::ChatTemplate;
use anyhow::{bail, Context, Result};
use minijinja::Value;
use std::path::Path;

/// What each role's turn is made of: (before the content, after it).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Turns {
    pub(crate) system: Option<(String, String)>,
    pub(crate) user: (String, String),
    pub(crate) assistant: (String, String),
    /// The text that opens the assistant's reply (add_generation_prompt).
    pub(crate) generation: String,
    /// The text the first turn starts with (a BOS the template writes, when llama.cpp does
    /// not add it).
    pub(crate) start: String,
}

const MARK: &str = "\u{F8F7}";

fn msg(role: &str, content: &str) -> Value {
    Value::from_pairs([
        ("role", Value::from(role)),
        ("content", Value::from(content)),
    ])
}

fn render(t: &ChatTemplate, msgs: &[Value], gen: bool) -> Result<String> {
    Ok(t.render(msgs, gen)?.text)
}

/// Splits `s` at the markers: the pieces between them.
fn pieces(s: &str) -> Vec<String> {
    s.split(MARK).map(String::from).collect()
}

/// Reads the turns off the template; `bos`: the BOS text llama.cpp adds itself (None when it
/// does not).
pub(crate) fn turns(t: &ChatTemplate, bos: Option<&str>) -> Result<Turns> {
    let u = |i: usize| format!("{MARK}U{i}{MARK}");
    let a = |i: usize| format!("{MARK}A{i}{MARK}");
    // [user U0] + generation prompt: start+user_pre | U0 | user_suf + gen
    let one = render(t, &[msg("user", &u(0))], true)?;
    let p = pieces(&one);
    if p.len() != 3 {
        bail!("the chat template does not write the user's message once");
    }
    let (lead, after_user_gen) = (p[0].clone(), p[2].clone());
    // [user U0, assistant A0, user U1] no prompt: lead | U0 | user_suf + asst_pre | A0 | asst_suf + user_pre | U1 | user_suf
    let three = render(
        t,
        &[
            msg("user", &u(0)),
            msg("assistant", &a(0)),
            msg("user", &u(1)),
        ],
        false,
    )?;
    let p3 = pieces(&three);
    if p3.len() != 7 {
        bail!("the chat template does not write each message once");
    }
    let user_suf = p3[6].clone();
    let Some(gen) = after_user_gen.strip_prefix(&user_suf) else {
        bail!("the chat template's generation prompt does not follow the user's turn");
    };
    let Some(asst_pre) = p3[2].strip_prefix(&user_suf) else {
        bail!("the chat template's assistant turn does not follow the user's turn");
    };
    // asst_suf + user_pre = p3[4]; user_pre is lead minus the start
    let (start, user_pre) = split_start(&lead, &p3[4])?;
    let asst_suf = p3[4].strip_suffix(&user_pre).unwrap_or(&p3[4]).to_string();
    let mut start = start;
    if let Some(b) = bos {
        if let Some(rest) = start.strip_prefix(b) {
            start = rest.to_string();
        }
    }
    let system = system_turn(t, &lead, &user_pre).ok();
    Ok(Turns {
        system,
        user: (user_pre, user_suf),
        assistant: (asst_pre.to_string(), asst_suf),
        generation: gen.to_string(),
        start,
    })
}

/// The first turn's lead is start + user_pre; a later user turn's is asst_suf + user_pre: the
/// longest common suffix is user_pre.
fn split_start(lead: &str, later: &str) -> Result<(String, String)> {
    let common = lead
        .chars()
        .rev()
        .zip(later.chars().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let cut = lead.len()
        - lead
            .chars()
            .rev()
            .take(common)
            .map(char::len_utf8)
            .sum::<usize>();
    Ok((lead[..cut].to_string(), lead[cut..].to_string()))
}

/// A system turn: [system S, user U] renders start + sys_pre | S | sys_suf + user_pre | U | …
fn system_turn(t: &ChatTemplate, lead: &str, user_pre: &str) -> Result<(String, String)> {
    let s = render(
        t,
        &[
            msg("system", &format!("{MARK}S{MARK}")),
            msg("user", &format!("{MARK}U{MARK}")),
        ],
        false,
    )?;
    let p = pieces(&s);
    if p.len() != 5 {
        bail!("no system turn");
    }
    let start = lead.strip_suffix(user_pre).unwrap_or("");
    let pre = p[0].strip_prefix(start).unwrap_or(&p[0]).to_string();
    let suf = p[2].strip_suffix(user_pre).unwrap_or(&p[2]).to_string();
    Ok((pre, suf))
}

/// Go template text: literal text with `{{` written as a Go string.
fn lit(s: &str) -> String {
    s.replace("{{", "{{ \"{{\" }}")
}

/// The Go template over `.Messages` that writes the same text as the turns: one line of
/// actions with no whitespace trimming, so that the literal pieces stay exact.
pub(crate) fn go_template(t: &Turns) -> String {
    let mut g = lit(&t.start);
    g.push_str("{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}");
    if let Some((pre, suf)) = &t.system {
        g.push_str(&format!(
            "{{{{ if eq .Role \"system\" }}}}{}{{{{ .Content }}}}{}{{{{ else if eq .Role \"user\" }}}}",
            lit(pre),
            lit(suf)
        ));
    } else {
        g.push_str("{{ if eq .Role \"user\" }}");
    }
    g.push_str(&format!(
        "{}{{{{ .Content }}}}{}{{{{ if $last }}}}{}{{{{ end }}}}",
        lit(&t.user.0),
        lit(&t.user.1),
        lit(&t.generation)
    ));
    g.push_str(&format!(
        "{{{{ else if eq .Role \"assistant\" }}}}{}{{{{ .Content }}}}{{{{ if not $last }}}}{}{{{{ end }}}}{{{{ end }}}}{{{{ end }}}}",
        lit(&t.assistant.0),
        lit(&t.assistant.1)
    ));
    g
}

/// The Modelfile: `from` (a GGUF path or an Ollama model), `adapter` (a LoRA GGUF), the
/// template, the stop strings.
pub(crate) fn modelfile(
    from: &str,
    adapter: Option<&str>,
    template: Option<&str>,
    stops: &[String],
) -> Result<String> {
    let mut m = format!("FROM {from}\n");
    if let Some(a) = adapter {
        m.push_str(&format!("ADAPTER {a}\n"));
    }
    if let Some(t) = template {
        if t.contains("\"\"\"") {
            bail!("the chat template contains \"\"\", which a Modelfile cannot quote");
        }
        m.push_str(&format!("TEMPLATE \"\"\"{t}\"\"\"\n"));
    }
    for s in stops {
        m.push_str(&format!("PARAMETER stop {}\n", serde_json::to_string(s)?));
    }
    Ok(m)
}

/// tokenizer_config.json's special tokens as strings (a string, or {"content": …}).
fn config_specials(cfg: Option<&Path>) -> Result<Vec<(String, String)>> {
    let Some(p) = cfg else { return Ok(Vec::new()) };
    let text =
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", p.display()))?;
    let mut out = Vec::new();
    for k in [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
    ] {
        let t = &v[k];
        if let Some(s) = t.as_str().or_else(|| t["content"].as_str()) {
            out.push((k.to_string(), s.to_string()));
        }
    }
    Ok(out)
}

/// The Modelfile of the checkpoint whose tokenizer is in `dir`: FROM `from`, the chat template
/// (when the tokenizer has one), stops at its stop tokens (tokenizer_config.json's eos_token,
/// and with a tokenizer.json the configs' eos ids and an EOT).
pub fn for_checkpoint(dir: &Path, from: &str, adapter: Option<&str>) -> Result<String> {
    let tok_path = dir.join("tokenizer.json");
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = cfg_path.is_file().then_some(cfg_path.as_path());
    let specials = config_specials(cfg)?;
    let special = |k: &str| {
        specials
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, s)| s.clone())
    };
    let sv = super::special::read(dir, false, None)?;
    let tok = match tok_path.is_file() {
        true => Some(crate::data::TextTokenizer::load(&tok_path, cfg)?),
        false => None,
    };
    let bos_text = match sv.adds("bos") {
        Some(true) => special("bos_token"),
        _ => None,
    };
    let template = match sv.chat_template {
        Some(_) => {
            let t = ChatTemplate::load(dir, cfg, None, specials.clone())?;
            Some(go_template(&turns(&t, bos_text.as_deref())?))
        }
        None => None,
    };
    let mut stops: Vec<String> = special("eos_token").into_iter().collect();
    if let Some(tok) = &tok {
        let ids = tok.stop_ids.iter().copied().chain(sv.id("eot"));
        for s in ids.filter_map(|id| tok.token_text(id)) {
            if !stops.contains(&s) {
                stops.push(s);
            }
        }
    }
    modelfile(from, adapter, template.as_deref(), &stops)
}
