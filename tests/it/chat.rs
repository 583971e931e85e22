//! Chat templates against transformers' apply_chat_template (references made by
//! scripts/reference_chat.py): rendered text, token ids, generation prompt, which tokens each
//! assistant turn trains on, and the template's own errors.

use crate::common::root;
use lora_train::data::chat::{normalize_messages, ChatTemplate};
use lora_train::data::{TextTokenizer, IGNORE};
use minijinja::Value;
use std::path::Path;

fn fixture(case: &str) -> std::path::PathBuf {
    root().join("tests/fixtures/chat").join(case)
}

/// The tokenizer and chat template of a model directory, as a training run loads them.
pub fn load(dir: &Path) -> TextTokenizer {
    let cfg = dir.join("tokenizer_config.json");
    let mut tok = TextTokenizer::load(&dir.join("tokenizer.json"), Some(&cfg)).unwrap();
    tok.chat = Some(ChatTemplate::load(dir, Some(&cfg), None, tok.specials.clone()).unwrap());
    tok
}

fn jsonl(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// Runs of consecutive target tokens, decoded (special tokens kept).
fn target_runs(dir: &Path, ids: &[u32], labels: &[i64]) -> Vec<String> {
    let t = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let mut runs = Vec::new();
    let mut cur: Vec<u32> = Vec::new();
    for (&id, &l) in ids.iter().zip(labels) {
        if l != IGNORE {
            assert_eq!(l, id as i64, "a target label is its own token");
            cur.push(id);
        } else if !cur.is_empty() {
            runs.push(t.decode(&std::mem::take(&mut cur), false).unwrap());
        }
    }
    if !cur.is_empty() {
        runs.push(t.decode(&cur, false).unwrap());
    }
    runs
}

fn check_case(case: &str, dir: &Path) {
    let tok = load(dir);
    let chat = tok.chat.as_ref().unwrap();
    let convs = jsonl(&root().join("tests/fixtures/chat/conversations.jsonl"));
    let expected = jsonl(&fixture(case).join("expected.jsonl"));
    let mut checked = (0, 0, 0);
    for (i, (conv, want)) in convs.iter().zip(&expected).enumerate() {
        let what = format!("{case} conversation {}", i + 1);
        let row: Value = serde_json::from_str(conv).unwrap();
        let messages = row.get_attr("messages").unwrap();
        let want: serde_json::Value = serde_json::from_str(want).unwrap();
        let msgs = normalize_messages(&messages).unwrap();
        if let Some(err) = want.get("error").and_then(|e| e.as_str()) {
            let ours = chat
                .encode(&tok, &messages, true)
                .expect_err(&format!("{what}: transformers raises {err:?}"));
            if err.contains("must alternate") {
                assert!(format!("{ours:#}").contains(err), "{what}: {ours:#}");
            }
            checked.2 += 1;
            continue;
        }
        let text = chat.render(&msgs, false).unwrap().text;
        assert_eq!(
            text,
            want["text"].as_str().unwrap(),
            "{what}: rendered text"
        );
        if let Some(gp) = want.get("generation_prompt") {
            let ours = chat.render(&msgs[..msgs.len() - 1], true).unwrap().text;
            assert_eq!(ours, gp.as_str().unwrap(), "{what}: generation prompt");
        }
        let all = chat.encode(&tok, &messages, false).unwrap();
        let ids: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
        assert_eq!(all.ids, ids, "{what}: token ids");
        assert_eq!(all.eos_added, 0, "{what}: the template ends every turn");
        assert_eq!(
            all.labels,
            ids.iter().map(|&t| t as i64).collect::<Vec<_>>(),
            "{what}: train_on all"
        );
        let ex = chat.encode(&tok, &messages, true).unwrap();
        assert_eq!(ex.ids, ids, "{what}: masking never changes the tokens");
        if let Some(mask) = want.get("assistant_masks") {
            let mask: Vec<u8> = serde_json::from_value(mask.clone()).unwrap();
            let ours: Vec<u8> = ex.labels.iter().map(|&l| (l != IGNORE) as u8).collect();
            assert_eq!(ours, mask, "{what}: transformers' assistant_masks");
        }
        if let Some(turns) = want.get("turn_targets") {
            let turns: Vec<String> = serde_json::from_value(turns.clone()).unwrap();
            assert_eq!(
                target_runs(dir, &ex.ids, &ex.labels),
                turns,
                "{what}: assistant turns"
            );
            assert_eq!(ex.turn_ends.len(), turns.len(), "{what}: one end per turn");
            checked.1 += 1;
        }
        checked.0 += 1;
    }
    assert!(checked.0 >= 6, "{case}: only {checked:?} checked");
    eprintln!("{case}: {checked:?} (rendered, turn-checked, raised)");
}

#[test]
fn chat_templates_render_and_tokenize_as_transformers() {
    for case in ["llama3", "llama31", "qwen25", "llama2", "chatml-generation"] {
        check_case(case, &fixture(case));
    }
}

#[test]
fn shipped_tiny_template_renders_as_transformers() {
    check_case("tiny-llama", &root().join("recipes/assets/tiny-llama"));
}
