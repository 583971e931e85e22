//! The house's map held to the code: docs/design.md's module table lists src/lib.rs's modules
//! in their order, every module imports only modules listed before it (so no two import each
//! other), the nine layers of issue 62 sit there in the issue's order, the recipe imports only
//! util, and no source file outgrows 800 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The modules of docs/design.md's "The house" table, in its order: each row's first
/// backticked name, without `.rs` or `/`.
fn design_modules() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("docs/design.md")).unwrap();
    let house = text
        .split("## The house")
        .nth(1)
        .expect("a `## The house` section");
    let house = house.split("\n## ").next().unwrap_or("");
    house
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let name = l[3..].split('`').next().unwrap_or("");
            name.trim_end_matches('/')
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect()
}

/// The modules src/lib.rs declares, in its order.
fn lib_modules() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').to_string())
        })
        .collect()
}

/// Every .rs file under `dir` (or `dir` itself), recursively.
fn rust_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        for e in std::fs::read_dir(p).unwrap() {
            rust_files(&e.unwrap().path(), out);
        }
    } else if p.is_file() && p.extension().is_some_and(|e| e == "rs") {
        out.push(p.to_path_buf());
    }
}

/// The top-level modules a source file names as `crate::X` (`use crate::{X, Y}` too), outside
/// comments and its `#[cfg(test)] mod tests` (a file of tests is skipped whole).
fn imports(file: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if file.file_name().is_some_and(|n| n == "tests.rs") {
        return out;
    }
    let text = std::fs::read_to_string(file).unwrap();
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        for (i, _) in line.match_indices("crate::") {
            let rest = &line[i + "crate::".len()..];
            let names: Vec<&str> = match rest.strip_prefix('{') {
                Some(group) => group.split('}').next().unwrap_or("").split(',').collect(),
                None => vec![rest],
            };
            for n in names {
                let n: String = n
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !n.is_empty() {
                    out.insert(n);
                }
            }
        }
    }
    out
}

#[test]
fn design_md_lists_every_module_of_lib_rs_in_its_order() {
    assert_eq!(design_modules(), lib_modules());
}

#[test]
fn each_module_imports_only_modules_below_it_and_the_recipe_only_util() {
    let order = lib_modules();
    let layer: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut against = Vec::new();
    for (i, m) in order.iter().enumerate() {
        let mut files = Vec::new();
        rust_files(&root().join("src").join(m), &mut files);
        rust_files(&root().join("src").join(format!("{m}.rs")), &mut files);
        assert!(!files.is_empty(), "no source for module `{m}`");
        for f in &files {
            for to in imports(f) {
                let Some(&j) = layer.get(to.as_str()) else {
                    continue;
                };
                if j > i {
                    against.push(format!(
                        "{} imports `{to}`, listed after `{m}`",
                        f.display()
                    ));
                }
                if m == "recipe" && to != "util" && to != "recipe" {
                    against.push(format!("{}: the recipe imports `{to}`", f.display()));
                }
            }
        }
    }
    assert!(against.is_empty(), "{}", against.join("\n"));
}

/// Issue 62's layering, literally: "recipe → hub → model → lora → data → train → parallel →
/// memory → export, ops beneath". With the test above (a module imports only modules listed
/// before it) this is the issue's rule: among the nine, a module imports only those before it
/// here, with no exception (the issue allows two; none is taken).
const HALLWAY: [&str; 9] = [
    "recipe", "hub", "model", "lora", "data", "train", "parallel", "memory", "export",
];

#[test]
fn lib_rs_lists_issue_62s_nine_layers_in_its_order_with_ops_beneath() {
    let order = lib_modules();
    let at = |m: &str| {
        order
            .iter()
            .position(|x| x == m)
            .unwrap_or_else(|| panic!("`{m}` is not a module of src/lib.rs"))
    };
    let layers: Vec<usize> = HALLWAY.iter().map(|m| at(m)).collect();
    for (w, names) in layers.windows(2).zip(HALLWAY.windows(2)) {
        assert!(
            w[0] < w[1],
            "src/lib.rs lists `{}` after `{}`: issue 62's order is {}",
            names[0],
            names[1],
            HALLWAY.join(" → ")
        );
    }
    assert!(at("ops") < layers[0], "ops sits beneath the nine");
}

#[test]
fn no_source_file_is_over_800_lines() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 800).then(|| format!("{}: {n} lines", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "{}", long.join("\n"));
}
