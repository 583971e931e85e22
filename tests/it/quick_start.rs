//! README's quick start for a real model, run as written against the loopback Hub: its three
//! lines (download, train, generate) read from README.md, with HF_ENDPOINT at a loopback server
//! that holds `meta-llama/Llama-2-7b-hf` (the tiny model we ship, under that id) and
//! `yahma/alpaca-cleaned` (our tiny Alpaca rows as one JSON array, as that data set keeps its
//! rows). The only additions to the README's commands are the CPU overrides a test needs
//! (device, dtype, a short run); the adapter must be the one the same rows and model train to
//! from local files, bit for bit (CPU f32), and generate must print what the local adapter does.

use crate::common::root;
use crate::loopback::{hub_command, Repo, Server};
use std::path::Path;

const MODEL: &str = "meta-llama/Llama-2-7b-hf";
const DATA: &str = "yahma/alpaca-cleaned";

/// The commands of README's "Quick start: a real model" block, each split into its words.
fn readme_quick_start() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let at = readme
        .find("## Quick start: a real model")
        .expect("README has the quick start");
    let block = readme[at..].split("```").nth(1).expect("its code block");
    block
        .lines()
        .filter(|l| l.starts_with("lora-train "))
        .map(words)
        .collect()
}

/// A shell line's words: "…" quotes one word, a # outside quotes starts a comment.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '"' => (quoted, any) = (!quoted, true),
            '#' if !quoted => break,
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// The tiny model's files, and the tiny Alpaca rows as one JSON array.
fn hub() -> Server {
    let tiny = root().join("recipes/assets/tiny-llama");
    let mut model = Repo::default();
    for f in std::fs::read_dir(&tiny).unwrap() {
        let f = f.unwrap();
        let name = f.file_name().to_string_lossy().into_owned();
        model = model.add(&name, std::fs::read(f.path()).unwrap());
    }
    let data = Repo::default()
        .add("README.md", b"# alpaca-cleaned\n".to_vec())
        .add("alpaca_data_cleaned.json", alpaca_json());
    Server::start(
        [
            (MODEL.to_string(), model),
            (format!("datasets/{DATA}"), data),
        ]
        .into_iter()
        .collect(),
    )
}

fn alpaca_json() -> Vec<u8> {
    let rows = std::fs::read_to_string(root().join("recipes/data/tiny-alpaca.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = rows
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    serde_json::to_vec_pretty(&rows).unwrap()
}

/// The overrides that make the 7B recipe a short CPU run of the tiny model.
const CPU: [&str; 9] = [
    "model.device=cpu",
    "model.dtype=f32",
    "data.seq_len=256",
    "train.micro_batch=2",
    "train.grad_accum=1",
    "train.max_steps=3",
    "train.warmup_steps=0",
    "train.log_every=1",
    "output.save_every=0",
];

fn run(dir: &Path, hf: &Path, endpoint: &str, args: &[String]) -> (String, String) {
    let o = hub_command(hf, endpoint)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{args:?}: {err}");
    (out, err)
}

fn with_sets(mut args: Vec<String>, sets: &[&str]) -> Vec<String> {
    for s in sets {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args
}

#[test]
fn readme_quick_start_runs_against_the_hub_as_written() {
    let cmds = readme_quick_start();
    let verbs: Vec<&str> = cmds.iter().map(|c| c[1].as_str()).collect();
    assert_eq!(verbs, ["download", "--recipe", "generate"], "three lines");
    assert_eq!(cmds[0][2], MODEL);
    let recipe = &cmds[1][2];
    assert_eq!(cmds[2][3], *recipe, "generate reads the recipe's adapter");

    let tmp = tempfile::tempdir().unwrap();
    let (work, hf) = (tmp.path().join("work"), tmp.path().join("hf"));
    std::fs::create_dir_all(work.join("recipes")).unwrap();
    std::fs::copy(root().join(recipe), work.join(recipe)).unwrap();
    let server = hub();
    let endpoint = server.endpoint();

    let (_, err) = run(&work, &hf, &endpoint, &cmds[0][1..]);
    let snap = hf.join("hub/models--meta-llama--Llama-2-7b-hf/snapshots");
    assert!(snap.is_dir(), "download fills the HF cache: {err}");
    let (_, err) = run(
        &work,
        &hf,
        &endpoint,
        &with_sets(cmds[1][1..].to_vec(), &CPU),
    );
    assert!(err.contains(DATA), "the data set comes from the Hub: {err}");
    let adapter = work.join("adapters/llama7b/adapter_model.safetensors");
    let from_hub = std::fs::read(&adapter).unwrap();
    let max_new = ["--max-new-tokens".to_string(), "12".to_string()];
    let gen = with_sets([&cmds[2][1..], &max_new[..]].concat(), &CPU[..2]);
    let (text, _) = run(&work, &hf, &endpoint, &gen);
    assert!(!text.trim().is_empty(), "generate prints its completion");

    // The same recipe on local files: the model dir, the rows as a JSON file.
    let local = tmp.path().join("local");
    std::fs::create_dir_all(&local).unwrap();
    std::fs::write(local.join("rows.json"), alpaca_json()).unwrap();
    let tiny = root().join("recipes/assets/tiny-llama");
    let rows = local.join("rows.json");
    let sets = [
        format!("model.path={}", tiny.display()),
        format!("data.train={}", rows.display()),
        format!("output.dir={}", local.join("out").display()),
    ];
    let mut sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    sets.extend(CPU);
    // model.id and model.path are one choice: the local run names the path alone
    let text_recipe = std::fs::read_to_string(work.join(recipe))
        .unwrap()
        .replace(&format!("id = \"{MODEL}\""), "");
    std::fs::write(local.join("llama7b.toml"), text_recipe).unwrap();
    let args = vec!["--recipe".to_string(), "llama7b.toml".to_string()];
    run(&local, &hf, "http://127.0.0.1:9", &with_sets(args, &sets));
    let from_files = std::fs::read(local.join("out/adapter_model.safetensors")).unwrap();
    assert!(
        from_hub == from_files,
        "the Hub's rows and model train the same adapter"
    );
    let gen = vec![
        "generate".to_string(),
        "--adapter".to_string(),
        local.join("out").display().to_string(),
        "--model".to_string(),
        tiny.display().to_string(),
        "--prompt".to_string(),
        cmds[2][5].clone(),
        "--device".to_string(),
        "cpu".to_string(),
        "--max-new-tokens".to_string(),
        "12".to_string(),
    ];
    let (local_text, _) = run(&local, &hf, "http://127.0.0.1:9", &gen);
    assert_eq!(
        text, local_text,
        "generate from the Hub's model and the recipe's adapter"
    );
}
