//! Preference data, read as TRL 1.16 reads it: records → pair examples (prompt, chosen and
//! rejected token ids) or unpaired KTO examples (prompt, completion, desirable).
//!
//! Columns (TRL's names):
//! - pre-tokenized: `prompt_input_ids`, `chosen_input_ids`, `rejected_input_ids` (KTO:
//!   `prompt_input_ids`, `completion_input_ids`, `label`), used as they are: no template, no
//!   BOS or EOS added;
//! - strings: `prompt`, `chosen`, `rejected` (KTO: `prompt`, `completion`, `label`). The EOS
//!   text is appended to each completion that does not end with it; prompt and prompt +
//!   completion are tokenized as the tokenizer's `__call__` does (special tokens added);
//! - conversations: the same columns as message lists. The prompt is rendered with the
//!   generation prompt, prompt + completion without, both tokenized without special tokens;
//! - an implicit prompt: `chosen` and `rejected` without `prompt` share their prompt as a
//!   prefix (TRL's `extract_prompt`: the longest common prefix of the two strings or message
//!   lists).
//!
//! The completion starts where the tokenized prompt and the tokenized prompt + completion
//! part (TRL's `common_prefix_length`, the smaller over chosen and rejected), so a token merged
//! across the boundary belongs to the completion.
//!
//! Truncation (TRL's `max_length`, keep_start): a row whose prompt alone has `max_len` tokens or
//! more is dropped (counted); a sequence is cut to `max_len` tokens when a batch is laid out
//! (see [`super::pref_batch`]), so each completion is cut against its own prompt.
//! `max_prompt_len` (TRL 0.x's `max_prompt_length`, gone from 1.x) keeps a prompt's last
//! tokens. A prompt with no tokens is refused: nothing would predict the first completion
//! token.

use super::chat::normalize_messages;
use super::reader::{read_all, Loc};
use super::record::Field;
use super::TextTokenizer;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// One preference pair: a prompt and two completions, untruncated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairExample {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The chosen completion's ids (at least one).
    pub chosen: Vec<u32>,
    /// The rejected completion's ids (at least one).
    pub rejected: Vec<u32>,
}

/// One KTO example: a prompt, a completion and whether it is desirable, untruncated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpairedExample {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The completion's ids (at least one).
    pub completion: Vec<u32>,
    /// TRL's `label`: true for a desirable completion.
    pub desirable: bool,
}

/// How preference rows become examples.
#[derive(Clone, Copy)]
pub struct PrefSpec<'a> {
    /// The model's tokenizer (and chat template) for string and conversation rows; None
    /// reads pre-tokenized rows only.
    pub tok: Option<&'a TextTokenizer>,
    /// Tokens a sequence (prompt + completion) keeps: TRL's `max_length` (data.seq_len).
    pub max_len: usize,
    /// A prompt keeps its last `max_prompt_len` tokens (data.max_prompt_len), when set.
    pub max_prompt_len: Option<usize>,
    /// Token ids must be below it.
    pub vocab_size: usize,
}

/// A file's examples and what reading them dropped or cut.
#[derive(Debug, Clone, Default)]
pub struct PrefData<E> {
    /// The examples, in file order.
    pub examples: Vec<E>,
    /// Rows dropped because their prompt alone reaches max_len (TRL's filter), and the first.
    pub long_prompts: usize,
    /// `file:line` of the first row dropped for a long prompt.
    pub long_prompts_first: Option<String>,
    /// Prompts cut to max_prompt_len.
    pub prompts_cut: usize,
}

/// A preference row's text side: strings or message lists.
enum Part<'a> {
    Text(String),
    Chat(Vec<&'a Field>),
}

/// Reads every record of `path` (jsonl, json or parquet) as a pair.
pub fn load_pairs(path: &Path, spec: &PrefSpec) -> Result<PrefData<PairExample>> {
    load(path, spec, parse_pair, |e| &e.prompt)
}

/// Reads every record of `path` as an unpaired KTO example.
pub fn load_unpaired(path: &Path, spec: &PrefSpec) -> Result<PrefData<UnpairedExample>> {
    load(path, spec, parse_unpaired, |e| &e.prompt)
}

fn load<E>(
    path: &Path,
    spec: &PrefSpec,
    parse: impl Fn(&Field, &PrefSpec) -> Result<(E, bool)>,
    prompt: impl Fn(&E) -> &Vec<u32>,
) -> Result<PrefData<E>> {
    let name = path.display().to_string();
    let mut data = PrefData {
        examples: Vec::new(),
        long_prompts: 0,
        long_prompts_first: None,
        prompts_cut: 0,
    };
    for (at, rec) in read_all(path, &[])? {
        let (ex, cut) = parse(&rec, spec).with_context(|| at.at(&name))?;
        data.prompts_cut += usize::from(cut);
        if prompt(&ex).len() >= spec.max_len {
            data.long_prompts += 1;
            data.long_prompts_first
                .get_or_insert_with(|| Loc::at(at, &name));
            continue;
        }
        data.examples.push(ex);
    }
    if data.examples.is_empty() {
        match &data.long_prompts_first {
            Some(first) => bail!(
                "{name} has no preference rows left: every prompt has seq_len ({}) tokens or more (first: {first}); raise data.seq_len or set data.max_prompt_len",
                spec.max_len
            ),
            None => bail!("{name} has no rows"),
        }
    }
    Ok(data)
}

/// One record → a pair (and whether its prompt was cut to max_prompt_len).
pub fn parse_pair(rec: &Field, spec: &PrefSpec) -> Result<(PairExample, bool)> {
    if !matches!(rec, Field::Map(_)) {
        bail!("expected a JSON object with \"chosen\" and \"rejected\" (or their _input_ids)");
    }
    let (prompt, chosen, rejected) = if rec.get("chosen_input_ids").is_some() {
        let ids = |k: &str| ids_of(rec, k, spec.vocab_size);
        (
            ids("prompt_input_ids")?,
            ids("chosen_input_ids")?,
            ids("rejected_input_ids")?,
        )
    } else {
        let (c, r) = (part(rec, "chosen")?, part(rec, "rejected")?);
        let (p, c, r) = match rec.get("prompt") {
            Some(_) => (part(rec, "prompt")?, c, r),
            None => extract_prompt(c, r)?,
        };
        let tok = need_tok(spec)?;
        let p_ids = prompt_ids(tok, &p)?;
        let pc = full_ids(tok, &p, c)?;
        let pr = full_ids(tok, &p, r)?;
        let n = common_prefix(&p_ids, &pc).min(common_prefix(&p_ids, &pr));
        let ex = (p_ids[..n].to_vec(), pc[n..].to_vec(), pr[n..].to_vec());
        for (k, ids) in [("chosen", &ex.1), ("rejected", &ex.2)] {
            check_vocab(ids, k, spec.vocab_size)?;
        }
        ex
    };
    let (prompt, cut) = check_prompt(prompt, spec)?;
    for (k, ids) in [("chosen", &chosen), ("rejected", &rejected)] {
        if ids.is_empty() {
            bail!("the {k} completion has no tokens");
        }
    }
    Ok((
        PairExample {
            prompt,
            chosen,
            rejected,
        },
        cut,
    ))
}

/// One record → a KTO example (and whether its prompt was cut to max_prompt_len).
pub fn parse_unpaired(rec: &Field, spec: &PrefSpec) -> Result<(UnpairedExample, bool)> {
    let desirable = match rec.get("label") {
        Some(Field::Bool(b)) => *b,
        Some(Field::Int(i @ (0 | 1))) => *i == 1,
        _ => bail!("expected \"label\": true (desirable) or false"),
    };
    let (prompt, completion) = if rec.get("completion_input_ids").is_some() {
        let ids = |k: &str| ids_of(rec, k, spec.vocab_size);
        (ids("prompt_input_ids")?, ids("completion_input_ids")?)
    } else {
        let (p, c) = (part(rec, "prompt")?, part(rec, "completion")?);
        let tok = need_tok(spec)?;
        let p_ids = prompt_ids(tok, &p)?;
        let pc = full_ids(tok, &p, c)?;
        let n = common_prefix(&p_ids, &pc);
        check_vocab(&pc, "completion", spec.vocab_size)?;
        (p_ids[..n].to_vec(), pc[n..].to_vec())
    };
    let (prompt, cut) = check_prompt(prompt, spec)?;
    if completion.is_empty() {
        bail!("the completion has no tokens");
    }
    Ok((
        UnpairedExample {
            prompt,
            completion,
            desirable,
        },
        cut,
    ))
}

fn need_tok<'a>(spec: &PrefSpec<'a>) -> Result<&'a TextTokenizer> {
    spec.tok.context(
        "string or conversation rows need the model's tokenizer.json (or give prompt_input_ids / chosen_input_ids / rejected_input_ids)",
    )
}

/// A prompt cut to max_prompt_len (its last tokens), refused when empty.
fn check_prompt(mut prompt: Vec<u32>, spec: &PrefSpec) -> Result<(Vec<u32>, bool)> {
    if prompt.is_empty() {
        bail!("the prompt has no tokens, so nothing predicts the completion's first token: give every row a prompt");
    }
    check_vocab(&prompt, "prompt", spec.vocab_size)?;
    let cut = spec.max_prompt_len.filter(|&m| prompt.len() > m.max(1));
    if let Some(m) = cut {
        prompt.drain(..prompt.len() - m.max(1));
    }
    Ok((prompt, cut.is_some()))
}

fn check_vocab(ids: &[u32], what: &str, vocab_size: usize) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
        bail!("{what}: token id {bad} is outside the model's vocabulary of {vocab_size}");
    }
    Ok(())
}

/// A list of token ids in column `k`.
fn ids_of(rec: &Field, k: &str, vocab_size: usize) -> Result<Vec<u32>> {
    let Some(Field::List(v)) = rec.get(k) else {
        bail!("expected \"{k}\": a list of token ids (pre-tokenized rows have prompt_input_ids, chosen_input_ids and rejected_input_ids)");
    };
    let ids: Vec<u32> = v
        .iter()
        .map(|x| match x {
            Field::Int(t) => u32::try_from(*t).ok(),
            _ => None,
        })
        .collect::<Option<_>>()
        .with_context(|| format!("\"{k}\" must hold non-negative integers"))?;
    check_vocab(&ids, k, vocab_size)?;
    Ok(ids)
}

/// Column `k` as a string or a message list.
fn part<'a>(rec: &'a Field, k: &str) -> Result<Part<'a>> {
    match rec.get(k) {
        Some(Field::Str(s)) => Ok(Part::Text(s.clone())),
        Some(Field::List(m)) if m.iter().all(|x| x.get("role").is_some()) => {
            Ok(Part::Chat(m.iter().collect()))
        }
        Some(other) => bail!(
            "\"{k}\" is {}: expected a string or a list of {{\"role\", \"content\"}} messages",
            other.kind()
        ),
        None => bail!("expected \"{k}\": a string or a list of messages"),
    }
}

/// TRL's `extract_prompt`: the longest common prefix of chosen and rejected (characters or
/// messages) is the prompt; a space just before the first difference stays with the answers.
/// Python's quirks kept: when one is a prefix of the other the loop ends on the last common
/// index, which goes to the answers; a difference at 0 looks at chosen[-1] for the space.
fn extract_prompt<'a>(c: Part<'a>, r: Part<'a>) -> Result<(Part<'a>, Part<'a>, Part<'a>)> {
    Ok(match (c, r) {
        (Part::Text(c), Part::Text(r)) => {
            let (cc, rc): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let last = cc.last().copied();
            let at = split_at(
                cc.len(),
                rc.len(),
                |i| cc[i] == rc[i],
                |i| match i {
                    0 => last == Some(' '),
                    _ => cc[i - 1] == ' ',
                },
            )?;
            let s = |v: &[char]| v.iter().collect::<String>();
            let (pc, pr) = (py_index(cc.len(), at), py_index(rc.len(), at));
            (
                Part::Text(s(&cc[..pc])),
                Part::Text(s(&cc[pc..])),
                Part::Text(s(&rc[pr..])),
            )
        }
        (Part::Chat(c), Part::Chat(r)) => {
            let at = split_at(c.len(), r.len(), |i| same(c[i], r[i]), |_| false)?;
            let (pc, pr) = (py_index(c.len(), at), py_index(r.len(), at));
            (
                Part::Chat(c[..pc].to_vec()),
                Part::Chat(c[pc..].to_vec()),
                Part::Chat(r[pr..].to_vec()),
            )
        }
        _ => bail!("\"chosen\" and \"rejected\" must both be strings or both message lists"),
    })
}

/// Python's `for idx in range(min(n, m)): if differ(idx): if space_before(idx): idx -= 1;
/// break`, with `idx` read after the loop.
fn split_at(
    n: usize,
    m: usize,
    same_at: impl Fn(usize) -> bool,
    space_before: impl Fn(usize) -> bool,
) -> Result<isize> {
    let len = n.min(m);
    if len == 0 {
        bail!("\"chosen\" or \"rejected\" is empty, so no prompt can be taken from them: give a \"prompt\"");
    }
    for i in 0..len {
        if !same_at(i) {
            return Ok(i as isize - isize::from(space_before(i)));
        }
    }
    Ok(len as isize - 1)
}

/// A Python slice bound: negative counts from the end.
fn py_index(len: usize, i: isize) -> usize {
    match usize::try_from(i) {
        Ok(i) => i.min(len),
        Err(_) => len.saturating_sub(i.unsigned_abs()),
    }
}

/// Message equality as Python's dict equality: the same keys and values in any order.
fn same(a: &Field, b: &Field) -> bool {
    match (a, b) {
        (Field::Map(x), Field::Map(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.iter().any(|(k2, v2)| k == k2 && same(v, v2)))
        }
        (Field::List(x), Field::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Field::Int(x), Field::Float(y)) | (Field::Float(y), Field::Int(x)) => *x as f64 == *y,
        _ => a == b,
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The prompt's ids: `tokenizer(prompt)`, or the messages rendered with the generation
/// prompt and tokenized without special tokens.
fn prompt_ids(tok: &TextTokenizer, p: &Part) -> Result<Vec<u32>> {
    match p {
        Part::Text(s) => tok.encode(s),
        Part::Chat(m) => render(tok, m, true),
    }
}

/// prompt + completion: strings joined (the completion ending in the EOS text), messages
/// concatenated and rendered without the generation prompt.
fn full_ids(tok: &TextTokenizer, p: &Part, c: Part) -> Result<Vec<u32>> {
    match (p, c) {
        (Part::Text(p), Part::Text(mut c)) => {
            let (eos, _) = tok.eos_token.as_ref().context(
                "string completions end with the EOS text, but tokenizer_config.json names no eos_token",
            )?;
            if !c.ends_with(eos.as_str()) {
                c.push_str(eos);
            }
            tok.encode(&format!("{p}{c}"))
        }
        (Part::Chat(p), Part::Chat(c)) => {
            let all: Vec<&Field> = p.iter().chain(&c).copied().collect();
            render(tok, &all, false)
        }
        _ => bail!("prompt and completions must be all strings or all message lists"),
    }
}

fn render(tok: &TextTokenizer, msgs: &[&Field], generation_prompt: bool) -> Result<Vec<u32>> {
    let chat = tok
        .chat
        .as_ref()
        .context("conversation rows need a chat template (data.chat_template)")?;
    let list = Field::List(msgs.iter().map(|&m| m.clone()).collect());
    if chat.generation_blocks && list.any_str(&|s| s.contains(['\u{F8F0}', '\u{F8F1}'])) {
        bail!("the row contains U+F8F0 / U+F8F1, which mark generation blocks");
    }
    let msgs = normalize_messages(&list.to_value())?;
    let text = chat.render(&msgs, generation_prompt)?.text;
    Ok(tok.encode_offsets(&text)?.0)
}

/// KTO's mismatched pairs for its KL estimate (TRL's `add_kl_completion_ids`): example i's
/// prompt with example i-1's completion, the first with the last's, within one micro-batch.
pub fn kl_pairs(batch: &[&UnpairedExample]) -> Vec<UnpairedExample> {
    let n = batch.len();
    (0..n)
        .map(|i| UnpairedExample {
            prompt: batch[i].prompt.clone(),
            completion: batch[(i + n - 1) % n].completion.clone(),
            desirable: batch[i].desirable,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! Against TRL's own dataset preparation and collator (tests/fixtures/pref/tokenize.json,
    //! made by scripts/reference_pref.py) and the golden fixtures' pre-tokenized rows.
    use super::super::chat::ChatTemplate;
    use super::super::pref_batch::PrefBatch;
    use super::*;
    use serde_json::Value;
    use std::path::PathBuf;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn tiny() -> TextTokenizer {
        let dir = root().join("recipes/assets/tiny-llama");
        let cfg = dir.join("tokenizer_config.json");
        let mut tok = TextTokenizer::load(&dir.join("tokenizer.json"), Some(&cfg)).unwrap();
        tok.chat = Some(ChatTemplate::load(&dir, Some(&cfg), None, tok.specials.clone()).unwrap());
        tok
    }

    fn spec(tok: Option<&TextTokenizer>) -> PrefSpec<'_> {
        PrefSpec {
            tok,
            max_len: 1 << 20,
            max_prompt_len: None,
            vocab_size: 512,
        }
    }

    fn fixture() -> Value {
        let p = root().join("tests/fixtures/pref/tokenize.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn record(v: &Value) -> Field {
        serde_json::from_value(v.clone()).unwrap()
    }

    fn ids(v: &Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn strings_and_conversations_tokenize_as_trl_prepares_them() {
        let tok = tiny();
        let fx = fixture();
        let mut seen = 0;
        for (group, g) in fx["groups"].as_object().unwrap() {
            let rows = g["rows"].as_array().unwrap();
            let want = g["expected"].as_array().unwrap();
            assert_eq!(rows.len(), want.len());
            for (row, w) in rows.iter().zip(want) {
                let at = format!("{group}: {row}");
                if group.starts_with("kto") {
                    let (e, _) = parse_unpaired(&record(row), &spec(Some(&tok))).unwrap();
                    assert_eq!(e.prompt, ids(&w["prompt_ids"]), "{at}");
                    assert_eq!(e.completion, ids(&w["completion_ids"]), "{at}");
                    assert_eq!(e.desirable, row["label"].as_bool().unwrap());
                } else {
                    let (e, _) = parse_pair(&record(row), &spec(Some(&tok))).unwrap();
                    assert_eq!(e.prompt, ids(&w["prompt_ids"]), "{at}");
                    assert_eq!(e.chosen, ids(&w["chosen_ids"]), "{at}");
                    assert_eq!(e.rejected, ids(&w["rejected_ids"]), "{at}");
                }
                seen += 1;
            }
        }
        assert_eq!(seen, 14);
    }

    /// TRL drops the rows whose prompt reaches max_length and cuts each sequence to it
    /// (DataCollatorForPreference, keep_start): the same sequences and completion masks.
    #[test]
    fn truncation_is_trls_collator() {
        let fx = fixture();
        let examples: Vec<PairExample> = ["dpo_text", "dpo_chat"]
            .iter()
            .flat_map(|g| fx["groups"][g]["expected"].as_array().unwrap().clone())
            .map(|e| PairExample {
                prompt: ids(&e["prompt_ids"]),
                chosen: ids(&e["chosen_ids"]),
                rejected: ids(&e["rejected_ids"]),
            })
            .collect();
        for case in fx["truncation"]["cases"].as_array().unwrap() {
            let max_len = case["max_length"].as_u64().unwrap() as usize;
            let dropped: Vec<usize> = (0..examples.len())
                .filter(|&i| examples[i].prompt.len() >= max_len)
                .collect();
            let want: Vec<usize> = case["dropped"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(dropped, want, "max_length {max_len}");
            let kept: Vec<&PairExample> = examples
                .iter()
                .filter(|e| e.prompt.len() < max_len)
                .collect();
            let pb = PrefBatch::pairs(&kept, 0, max_len, 1, false);
            let b = &pb.batch;
            let seg = b.segments.as_ref().unwrap();
            // a pair's tree: the prompt (id 0) with chosen (1) or rejected (2)
            for (k, kind) in [(0, "chosen"), (1, "rejected")] {
                for (i, w) in case[kind].as_array().unwrap().iter().enumerate() {
                    let row = i * b.t..(i + 1) * b.t;
                    let got: Vec<u32> = row
                        .filter(|&j| seg[j] == 0 || seg[j] == k + 1)
                        .map(|j| b.ids[j])
                        .collect();
                    assert_eq!(got, ids(&w["input_ids"]), "max_length {max_len} {kind} {i}");
                    let s = 2 * i + k as usize;
                    let mut mask = vec![0u64; pb.layout.prompt_len[s]];
                    mask.resize(pb.layout.prompt_len[s] + pb.layout.completion_len[s], 1);
                    let want: Vec<u64> = w["completion_mask"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap())
                        .collect();
                    assert_eq!(mask, want, "max_length {max_len} {kind} {i}");
                }
            }
        }
    }

    /// The golden fixtures' rows read as they are, laid out with one target a completion
    /// token: the counts the reference script scored.
    #[test]
    fn pretokenized_fixture_rows_read_as_they_are() {
        let dir = root().join("tests/fixtures/pref");
        let meta: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("dpo_sigmoid/meta.json")).unwrap(),
        )
        .unwrap();
        let data = load_pairs(&dir.join("dpo_sigmoid/train.jsonl"), &spec(None)).unwrap();
        assert_eq!(data.examples.len(), 12);
        for (s, step) in meta["steps"].as_array().unwrap().iter().enumerate() {
            let pairs: Vec<&PairExample> = data.examples[2 * s..2 * s + 2].iter().collect();
            let pb = PrefBatch::pairs(&pairs, 0, 1 << 20, 1, false);
            for (k, p) in pairs.iter().enumerate() {
                assert_eq!(
                    p.prompt.len() as f64,
                    step["prompt_len"][k].as_f64().unwrap()
                );
                assert_eq!(
                    pb.layout.completion_len[2 * k] as f64,
                    step["chosen_len"][k].as_f64().unwrap()
                );
                assert_eq!(
                    pb.layout.completion_len[2 * k + 1] as f64,
                    step["rejected_len"][k].as_f64().unwrap()
                );
            }
            let per_seq = |q: usize| {
                pb.layout
                    .target_seq
                    .iter()
                    .filter(|&&x| x as usize == q)
                    .count()
            };
            assert!((0..4).all(|q| per_seq(q) == pb.layout.completion_len[q]));
        }
        let kto = load_unpaired(&dir.join("kto/train.jsonl"), &spec(None)).unwrap();
        assert_eq!(kto.examples.len(), 24);
        assert!(
            kto.examples.iter().any(|e| e.desirable) && kto.examples.iter().any(|e| !e.desirable)
        );
    }

    fn text_pair(chosen: &str, rejected: &str) -> (String, String, String) {
        let c = Part::Text(chosen.into());
        let r = Part::Text(rejected.into());
        match extract_prompt(c, r).unwrap() {
            (Part::Text(p), Part::Text(c), Part::Text(r)) => (p, c, r),
            _ => unreachable!(),
        }
    }

    #[test]
    fn implicit_string_prompts_keep_trls_quirks() {
        let t = |p: &str, c: &str, r: &str| (p.to_string(), c.to_string(), r.to_string());
        assert_eq!(text_pair("Q: A", "Q: B"), t("Q:", " A", " B"));
        assert_eq!(text_pair("abX", "abY"), t("ab", "X", "Y"));
        // a prefix: the loop ends on the last common index, which goes to the answers
        assert_eq!(text_pair("abc", "abcd"), t("ab", "c", "cd"));
        // a difference at 0 reads chosen[-1]: a trailing space moves the split to -1
        assert_eq!(text_pair("x ", "yz"), t("x", " ", "z"));
        assert!(extract_prompt(Part::Text(String::new()), Part::Text("a".into())).is_err());
    }

    fn row(json: &str) -> Field {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn bad_rows_are_refused_with_the_reason() {
        let tok = tiny();
        let err = |r: &str| {
            parse_pair(&row(r), &spec(Some(&tok)))
                .unwrap_err()
                .to_string()
        };
        let empty =
            r#"{"prompt_input_ids": [], "chosen_input_ids": [5], "rejected_input_ids": [6]}"#;
        assert!(err(empty).contains("prompt has no tokens"));
        let big =
            r#"{"prompt_input_ids": [3], "chosen_input_ids": [512], "rejected_input_ids": [6]}"#;
        assert!(err(big).contains("outside the model's vocabulary"));
        let no_c =
            r#"{"prompt_input_ids": [3], "chosen_input_ids": [], "rejected_input_ids": [6]}"#;
        assert!(err(no_c).contains("chosen completion has no tokens"));
        let mixed = r#"{"prompt": "Hi", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"}"#;
        assert!(err(mixed).contains("all strings or all message lists"));
        assert!(err(r#"{"prompt": "Hi", "chosen": 3, "rejected": "y"}"#)
            .contains("\"chosen\" is an integer"));
        let text = r#"{"prompt": "Hi", "chosen": "a", "rejected": "b"}"#;
        let e = parse_pair(&row(text), &spec(None)).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        let kto = r#"{"prompt_input_ids": [3], "completion_input_ids": [4], "label": "yes"}"#;
        let e = parse_unpaired(&row(kto), &spec(None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"label\""), "{e}");
    }

    #[test]
    fn prompts_are_cut_to_their_end_and_long_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pairs.jsonl");
        let rows = [
            r#"{"prompt_input_ids": [3, 4, 5, 6], "chosen_input_ids": [7], "rejected_input_ids": [8]}"#,
            r#"{"prompt_input_ids": [3, 4], "chosen_input_ids": [7, 9], "rejected_input_ids": [8]}"#,
        ];
        std::fs::write(&p, rows.join("\n")).unwrap();
        let cut = PrefSpec {
            max_prompt_len: Some(3),
            ..spec(None)
        };
        let data = load_pairs(&p, &cut).unwrap();
        assert_eq!(data.examples[0].prompt, vec![4, 5, 6]);
        assert_eq!(data.prompts_cut, 1);
        let short = PrefSpec {
            max_len: 4,
            ..spec(None)
        };
        let data = load_pairs(&p, &short).unwrap();
        assert_eq!((data.examples.len(), data.long_prompts), (1, 1));
        assert!(data.long_prompts_first.unwrap().ends_with("pairs.jsonl:1"));
        let none = PrefSpec {
            max_len: 2,
            ..spec(None)
        };
        let e = load_pairs(&p, &none).unwrap_err().to_string();
        assert!(e.contains("raise data.seq_len"), "{e}");
    }

    #[test]
    fn kl_pairs_rotate_completions_by_one() {
        let ex = |p: u32, c: u32| UnpairedExample {
            prompt: vec![p],
            completion: vec![c],
            desirable: p % 2 == 0,
        };
        let (a, b, c) = (ex(1, 10), ex(2, 20), ex(3, 30));
        let kl = kl_pairs(&[&a, &b, &c]);
        let got: Vec<(u32, u32)> = kl.iter().map(|e| (e.prompt[0], e.completion[0])).collect();
        assert_eq!(got, vec![(1, 30), (2, 10), (3, 20)]);
    }
}
