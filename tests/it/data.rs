//! Data loading on the tiny model's real tokenizer: label masks token by token, the EOS that
//! ends every completion, bad rows, truncation, and chat templates that need the fallbacks.

use crate::chat::load;
use crate::common::root;
use lora_train::data::chat::ChatTemplate;
use lora_train::data::{Dataset, TextTokenizer, IGNORE};
use lora_train::recipe::{DataSection, TrainFile};
use minijinja::Value;
use std::path::PathBuf;

const X: i64 = IGNORE;

fn tiny() -> PathBuf {
    root().join("recipes/assets/tiny-llama")
}

/// A `[data]` section from TOML lines.
fn section(lines: &str) -> DataSection {
    toml::from_str(&format!("train = \"x.jsonl\"\n{lines}")).unwrap()
}

/// Loads `rows` (jsonl lines), written to a temporary rows.jsonl, as `[data]` `lines` say;
/// returns the dataset and the file's path (the directory lives as long as the dataset).
fn load_rows(rows: &[&str], lines: &str) -> anyhow::Result<(Dataset, PathBuf)> {
    let path = TMP.with(|d| d.path().join("rows.jsonl"));
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    let cfg = section(lines);
    let file = TrainFile {
        path: path.clone(),
        weight: 1.0,
        format: Some(cfg.format),
        ..TrainFile::default()
    };
    let ds = Dataset::load_files(&[file], &cfg, Some(&load(&tiny())), 512)?;
    Ok((ds, path))
}

thread_local! {
    /// One temporary directory per test thread, removed when the thread ends.
    static TMP: tempfile::TempDir = tempfile::tempdir().unwrap();
}

#[test]
fn chat_labels_token_by_token() {
    let tok = load(&tiny());
    let chat = tok.chat.as_ref().unwrap();
    let row: Value = serde_json::from_str(
        r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]"#,
    )
    .unwrap();
    let ex = chat.encode(&tok, &row, true).unwrap();
    // "<s><|im_start|>user\nHi</s>\n<|im_start|>assistant\nYes.</s>\n" (the markers are plain
    // text to this tokenizer), ids as transformers' apply_chat_template gives them.
    #[rustfmt::skip]
    let ids = vec![
        1, 30, 94, 429, 65, 332, 269, 86, 94, 32, 506, 284, 201, // <s><|im_start|>user\n
        42, 75, 2, 201,                                          // Hi</s>\n
        30, 94, 429, 65, 332, 269, 86, 94, 32, 267, 85, 299, 86, 316, 86, 201, // <|im_start|>assistant\n
        59, 302, 16, 2,                                          // Yes.</s>
        201,                                                     // \n
    ];
    #[rustfmt::skip]
    let labels = vec![
        X, X, X, X, X, X, X, X, X, X, X, X, X,
        X, X, X, X,
        X, X, X, X, X, X, X, X, X, X, X, X, X, X, X, X,
        59, 302, 16, 2,
        X,
    ];
    assert_eq!(ex.ids, ids);
    assert_eq!(ex.labels, labels);
    assert_eq!((ex.eos_added, ex.turn_ends.clone()), (0, vec![2]));
    let all = chat.encode(&tok, &row, false).unwrap();
    assert_eq!(
        all.labels,
        ids.iter().map(|&t| t as i64).collect::<Vec<_>>()
    );
}

#[test]
fn completion_labels_token_by_token_with_configurable_fields() {
    let (ds, _) = load_rows(
        &[r#"{"q": "Q: 2+3? A:", "a": " 5"}"#],
        "format = \"completion\"\nprompt_field = \"q\"\ncompletion_field = \"a\"",
    )
    .unwrap();
    let e = ds.examples.get(0);
    // <s> Q : Ġ2 + 3 ? ĠA : | Ġ 5 </s>: the space before "5" is the completion's, and the EOS
    // the tokenizer config adds ends it.
    assert_eq!(e.ids, vec![1, 51, 28, 355, 13, 21, 33, 324, 28, 223, 23, 2]);
    assert_eq!(e.labels, vec![X, X, X, X, X, X, X, X, X, 223, 23, 2]);
    let (ds, _) = load_rows(
        &[r#"{"prompt": "Q: 2+3? A:", "completion": " 5"}"#],
        "format = \"completion\"\ntrain_on = \"all\"",
    )
    .unwrap();
    let e = ds.examples.get(0);
    assert_eq!(
        e.labels,
        e.ids.iter().map(|&t| t as i64).collect::<Vec<_>>()
    );
}

#[test]
fn alpaca_trains_on_the_output_and_the_eos_only() {
    let tok = load(&tiny());
    let row = r#"{"instruction": "Add the two numbers.", "input": "38 and 17", "output": "38 + 17 = 55."}"#;
    let (ds, _) = load_rows(&[row], "format = \"alpaca\"\nseq_len = 512").unwrap();
    let e = ds.examples.get(0);
    let prompt = lora_train::data::alpaca_prompt("Add the two numbers.", "38 and 17");
    assert!(prompt.ends_with("### Input:\n38 and 17\n\n### Response:\n"));
    // The prompt alone (with its BOS) is exactly the masked part.
    let n_prompt = tok.encode(&prompt).unwrap().len() - 1; // without the EOS encode adds
    assert_eq!(
        &e.ids[..n_prompt],
        &tok.encode(&prompt).unwrap()[..n_prompt]
    );
    assert!(e.labels[..n_prompt].iter().all(|&l| l == X));
    let t = tokenizers::Tokenizer::from_file(tiny().join("tokenizer.json")).unwrap();
    let target: Vec<u32> = e.labels[n_prompt..].iter().map(|&l| l as u32).collect();
    assert_eq!(t.decode(&target, false).unwrap(), "38 + 17 = 55.</s>");
    assert_eq!(*e.ids.last().unwrap(), 2);
}

#[test]
fn bad_rows_are_skipped_and_counted_or_stop_the_run_with_file_and_line() {
    let rows = [
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}"#,
        r#"{"messages": [{"role": "user", "content": "Hi"}"#,
        r#"{"conversation": []}"#,
        r#"{"messages": [{"content": "no role"}]}"#,
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Fine."}]}"#,
    ];
    let (ds, path) = load_rows(&rows, "format = \"chat\"\non_bad_row = \"skip\"").unwrap();
    assert_eq!((ds.examples.len(), ds.skipped), (2, 3));
    let p = path.display();
    assert_eq!(
        ds.skipped_first,
        vec![
            format!("{p}:2: not valid JSON: EOF while parsing a list at line 1 column 47"),
            format!("{p}:3: expected \"messages\": a list of {{\"role\", \"content\"}} objects"),
            format!("{p}:4: message 0 has no string \"role\""),
        ]
    );
    let e = load_rows(&rows, "format = \"chat\"").unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        format!("{p}:2: not valid JSON: EOF while parsing a list at line 1 column 47")
    );
}

#[test]
fn truncation_is_counted_and_a_cut_off_completion_is_dropped_and_counted() {
    let long = format!(r#"{{"prompt": "{}", "completion": " 5"}}"#, "Q ".repeat(40));
    let rows = [
        r#"{"prompt": "Q: 2+3? A:", "completion": " 5 and then some more words"}"#,
        long.as_str(),
    ];
    let (ds, _) = load_rows(&rows, "format = \"completion\"\nseq_len = 12").unwrap();
    // Row 1 is cut to 12 tokens but keeps targets; row 2's completion is cut off entirely.
    assert_eq!((ds.examples.len(), ds.truncated, ds.no_targets), (1, 2, 1));
    assert_eq!(ds.examples.get(0).ids.len(), 12);
    assert_eq!(ds.examples.get(0).labels[9..], [223, 23, 291]); // Ġ 5 Ġand
}

/// The tiny tokenizer with `template` as its chat template.
fn with_template(template: &str) -> TextTokenizer {
    let dir = tiny();
    let cfg = dir.join("tokenizer_config.json");
    let mut tok = TextTokenizer::load(&dir.join("tokenizer.json"), Some(&cfg)).unwrap();
    tok.chat = Some(ChatTemplate::from_source("test", template, tok.specials.clone()).unwrap());
    tok
}

/// Target runs of a conversation under `template`, decoded, and the EOS insertions.
fn targets(template: &str, messages: &str) -> anyhow::Result<(Vec<String>, usize)> {
    let tok = with_template(template);
    let msgs: Value = serde_json::from_str(messages).unwrap();
    let ex = tok.chat.as_ref().unwrap().encode(&tok, &msgs, true)?;
    let t = tokenizers::Tokenizer::from_file(tiny().join("tokenizer.json")).unwrap();
    let mut runs = Vec::new();
    let mut cur = Vec::new();
    for (&id, &l) in ex.ids.iter().zip(&ex.labels).chain([(&0, &X)]) {
        if l != X {
            cur.push(id);
        } else if !cur.is_empty() {
            runs.push(t.decode(&std::mem::take(&mut cur), false).unwrap());
        }
    }
    Ok((runs, ex.eos_added))
}

const QA: &str = r#"[{"role": "user", "content": "Reply with yes: yes"}, {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Again, yes."}]"#;

#[test]
fn a_template_without_stop_tokens_gets_the_eos_appended_to_each_turn() {
    let plain = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}\
                 {% if add_generation_prompt %}assistant: {% endif %}";
    let (runs, added) = targets(plain, QA).unwrap();
    // The "\n" after each answer stays a prompt token; the EOS is inserted before it. "Ġyes"
    // straddles the prompt's space and the answer: it is the answer's.
    assert_eq!(runs, vec![" yes</s>", " Again, yes.</s>"]);
    assert_eq!(added, 2);
}

#[test]
fn templates_that_rewrite_earlier_turns_fall_back_to_finding_the_content() {
    // The header depends on the whole conversation, so no prefix of it renders the same: each
    // answer is found after its question (not inside "Reply with yes: yes").
    let counted = "{{ messages | length }} messages\n{% for m in messages %}\
                   {{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}";
    let (runs, added) = targets(counted, QA).unwrap();
    assert_eq!(runs, vec![" yes</s>", " Again, yes.</s>"]);
    assert_eq!(added, 0);
    // Content the template rewrites cannot be found: an error that names the way out.
    let upper = "{{ messages | length }}\n{% for m in messages %}{{ m.content | upper }}{{ eos_token }}{% endfor %}";
    let e = targets(upper, QA).unwrap_err().to_string();
    assert!(
        e.starts_with("message 1 (assistant): its content does not appear in the text the chat template renders")
            && e.ends_with("use train_on = \"all\", or a template with {% generation %} blocks"),
        "{e}"
    );
}

#[test]
fn chat_template_sources_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let write = |name: &str, text: &str| std::fs::write(d.join(name), text).unwrap();
    let cfg = d.join("tokenizer_config.json");
    write(
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "default", "template": "D{{ messages | length }}"},
                              {"name": "tool_use", "template": "T"}]}"#,
    );
    let render = |choice: Option<&str>| -> anyhow::Result<String> {
        let t = ChatTemplate::load(d, Some(&cfg), choice, vec![])?;
        Ok(t.render(&[], false)?.text)
    };
    assert_eq!(render(None).unwrap(), "D0");
    assert_eq!(render(Some("tool_use")).unwrap(), "T");
    let e = render(Some("rag")).unwrap_err().to_string();
    assert!(
        e.ends_with("has no chat template named \"rag\"; it has \"default\", \"tool_use\": set data.chat_template to one of them"),
        "{e}"
    );
    // chat_template.jinja beside the config wins, as in transformers; a .jinja path wins over both.
    write("chat_template.jinja", "J");
    assert_eq!(render(None).unwrap(), "J");
    write("mine.jinja", "M{{ bos_token }}");
    let mine = d.join("mine.jinja");
    let t = ChatTemplate::load(
        d,
        Some(&cfg),
        mine.to_str(),
        vec![("bos_token".into(), "<s>".into())],
    )
    .unwrap();
    assert_eq!(t.render(&[], false).unwrap().text, "M<s>");
    write("bad.jinja", "{% for %}");
    let bad = d.join("bad.jinja");
    let e = ChatTemplate::load(d, Some(&cfg), bad.to_str(), vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("bad.jinja does not compile: syntax error"),
        "{e}"
    );
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();
    write("tokenizer_config.json", "{}");
    let e = render(None).unwrap_err().to_string();
    assert!(
        e.ends_with(": set data.chat_template to a .jinja file"),
        "{e}"
    );
}

/// Long documents at seq_len 2²⁰ (#30): four token rows of 400k, 300k, 500k and 1.2M tokens,
/// packed greedily into rows of at most 1,048,576 tokens; the longest is truncated and
/// counted. Every step of the path (read, truncate, pack, batch) is linear in the tokens.
#[test]
fn long_documents_pack_into_rows_of_a_million_tokens() {
    use lora_train::data::{Batch, Sampler};
    const T: usize = 1 << 20;
    let lens = [400_000usize, 300_000, 500_000, 1_200_000];
    let rows: Vec<String> = lens
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let ids: Vec<String> = (0..n).map(|i| ((i * 7 + k) % 500).to_string()).collect();
            format!("{{\"input_ids\": [{}]}}", ids.join(","))
        })
        .collect();
    let rows: Vec<&str> = rows.iter().map(|s| s.as_str()).collect();
    let cfg = format!("format = \"tokens\"\nseq_len = {T}\npack = true\nshuffle = false");
    let (ds, _) = load_rows(&rows, &cfg).unwrap();
    let got: Vec<usize> = ds.examples.iter().map(|e| e.ids.len()).collect();
    assert_eq!(got, [400_000, 300_000, 500_000, T]);
    assert_eq!(ds.truncated, 1);
    assert_eq!(
        ds.examples.get(3).ids[T - 1] as usize,
        ((T - 1) * 7 + 3) % 500
    );

    let sampler = Sampler::new(&ds, &section(&cfg), 0);
    let packed = sampler.rows(0);
    assert_eq!(packed, vec![vec![0, 1], vec![2], vec![3]]);

    let row: Vec<_> = packed[0].iter().map(|&i| ds.examples.get(i)).collect();
    let b = Batch::from_rows(&[row], 0, true);
    assert_eq!((b.b, b.t), (1, 700_000));
    // Positions restart with the second document; its first token is no target.
    assert_eq!(b.positions[399_999], 399_999);
    assert_eq!(b.positions[400_000], 0);
    assert_eq!(b.positions[699_999], 299_999);
    let seg = b.segments.as_ref().unwrap();
    assert_eq!((seg[399_999], seg[400_000]), (0, 1));
    assert_eq!(b.n_targets(), 700_000 - 2);
    assert!(b.targets.iter().all(|&(i, _)| i != 399_999));

    let row: Vec<_> = packed[2].iter().map(|&i| ds.examples.get(i)).collect();
    let b = Batch::from_rows(&[row], 0, true);
    assert_eq!((b.t, b.n_targets(), b.tokens), (T, T - 1, T));
    assert_eq!(b.positions[T - 1] as usize, T - 1);
}
