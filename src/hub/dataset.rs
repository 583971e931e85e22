//! Hub data sets: `[data] train = "hf://datasets/ORG/NAME"` with `split`, `subset`,
//! `revision` and `files`.
//!
//! The revision's commit and file list come from the Hub's repository API through hf-hub
//! (`GET {endpoint}/api/datasets/ORG/NAME/revision/REV`); the files of the split are chosen
//! from that list as `datasets` chooses them without a README config (see [`select`]) and
//! downloaded by our client into the same cache as models (`datasets--ORG--NAME`). A run
//! online asks for the list once; HF_HUB_OFFLINE=1 (or a Hub that cannot be reached) reads the
//! files the cached snapshot holds.

use super::cache::{is_commit, RepoCache};
use super::download::{
    http_error, transient_error, transient_status, unreachable, At, Head, Hub, HubEnv, Kind,
    Unreachable,
};
use crate::util::{check_repo_id, check_revision};
use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::api::RepoInfo;
use hf_hub::{Repo, RepoType};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

pub(crate) const SCHEME: &str = "hf://datasets/";

/// The file extensions read as data (parquet, JSON lines, JSON).
const DATA_EXTENSIONS: [&str; 3] = [".parquet", ".jsonl", ".json"];

/// `hf://datasets/ORG/NAME` → `ORG/NAME`; None when `s` is not an hf:// path at all.
pub(crate) fn repo_of(s: &str) -> Option<Result<&str, String>> {
    if !s.starts_with("hf://") {
        return None;
    }
    let bad = || {
        format!("\"{s}\" is not a Hub data set: write hf://datasets/ORG/NAME, e.g. hf://datasets/yahma/alpaca-cleaned (data.split, data.subset, data.revision and data.files choose its files)")
    };
    let Some(id) = s.strip_prefix(SCHEME) else {
        return Some(Err(bad()));
    };
    let id = id.trim_end_matches('/');
    Some(match check_repo_id(id) {
        Ok(()) if id.contains('/') => Ok(id),
        _ => Err(bad()),
    })
}

/// Which files of which data set.
#[derive(Debug, Clone)]
pub struct DataRepo<'a> {
    /// The data set's Hub id (`org/name`).
    pub id: &'a str,
    /// The branch, tag or commit to read.
    pub revision: &'a str,
    /// The subset (configuration); None: the data set's default.
    pub subset: Option<&'a str>,
    /// The split ("train", "test", ...).
    pub split: &'a str,
    /// A glob of repository paths; replaces subset and split.
    pub files: Option<&'a str>,
}

/// One file of a data set: its path in the repository and in the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFile {
    /// Its path in the repository.
    pub file: String,
    pub(crate) path: PathBuf,
}

/// Data sets resolved in this process: (what was asked, its files).
static RESOLVED: Mutex<Vec<(String, Vec<DataFile>)>> = Mutex::new(Vec::new());

/// The files of `d` in the cache under `env`, downloading what the cache lacks. Once per
/// process: the ranks of a run (threads) read the files rank 0 resolved, at one commit, and
/// wait while it downloads them.
pub fn dataset_files(env: &HubEnv, d: &DataRepo) -> Result<Vec<DataFile>> {
    let key = format!(
        "{}\n{}\n{}\n{:?}",
        env.endpoint,
        env.cache.display(),
        env.offline,
        d
    );
    let mut memo = RESOLVED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, files)) = memo.iter().find(|(k, _)| *k == key) {
        return Ok(files.clone());
    }
    let files = resolve(env, d)?;
    memo.push((key, files.clone()));
    Ok(files)
}

fn resolve(env: &HubEnv, d: &DataRepo) -> Result<Vec<DataFile>> {
    check_repo_id(d.id).map_err(anyhow::Error::msg)?;
    check_revision(d.revision).map_err(anyhow::Error::msg)?;
    let cache = RepoCache::dataset(&env.cache, d.id);
    let cached = cache
        .commit_for(d.revision)
        .filter(|c| cache.snapshot(c).is_dir());
    let (id, rev) = (d.id, d.revision);
    let from_cache = |commit: &str, why: &str| -> Result<Vec<DataFile>> {
        let chosen = select(&cache.snapshot_files(commit), d).map_err(|m| {
            anyhow::anyhow!(
                "data set {id} at revision \"{rev}\" in the cache {} (commit {commit}, {why}) {m}",
                cache.dir.display()
            )
        })?;
        crate::errln!(
            "data set {id} at \"{rev}\" = commit {commit}, {why}: {}",
            chosen.join(", ")
        );
        let snap = cache.snapshot(commit);
        Ok(chosen
            .into_iter()
            .map(|file| DataFile {
                path: snap.join(&file),
                file,
            })
            .collect())
    };
    if env.offline {
        return match &cached {
            Some(c) => from_cache(c, "from the cache (HF_HUB_OFFLINE is set)"),
            None => bail!(
                "HF_HUB_OFFLINE is set and the cache {} has no snapshot of data set {id} at \
                 revision \"{rev}\": train once where the Hub is reachable (or copy that cache \
                 here), or unset HF_HUB_OFFLINE",
                cache.dir.display()
            ),
        };
    }
    let (commit, listing) = match list_remote(env, d) {
        Ok(x) => x,
        Err(e) => {
            return match (&cached, e.downcast_ref::<Unreachable>()) {
                (Some(c), Some(u)) => {
                    crate::errln!("warning: cannot reach {}: {}", u.endpoint, u.cause);
                    from_cache(c, "as last downloaded (it may have moved since)")
                }
                _ => Err(e),
            }
        }
    };
    let chosen = select(&listing, d).map_err(|m| {
        anyhow::anyhow!(
            "data set {id} at revision \"{rev}\" (commit {commit}) on {} {m}",
            env.endpoint
        )
    })?;
    cache.write_ref(rev, &commit)?;
    let hub = Hub::new(env);
    let t0 = std::time::Instant::now();
    let mut bytes = 0;
    let mut out = Vec::new();
    for file in chosen {
        let path = match cache.has(&commit, &file) {
            Some(true) => cache.snapshot(&commit).join(&file),
            _ => {
                let at = At {
                    repo: id,
                    revision: rev,
                    file: &file,
                    kind: Kind::Dataset,
                };
                let remote = match hub.head(&at, &commit)? {
                    Head::Found(r) => r,
                    Head::Missing => bail!(
                        "{} lists {file} in data set {id} at commit {commit}, but answers HTTP \
                         404 for it: run again (the data set may be changing), or pin \
                         data.revision to a commit",
                        env.endpoint
                    ),
                };
                bytes += hub.fetch(&cache, &at, &remote)?;
                cache.link(&commit, &file, &remote.etag)?
            }
        };
        out.push(DataFile { file, path });
    }
    crate::errln!(
        "data set {id} at \"{rev}\" = commit {commit}: {} ({} fetched in {:.1}s)",
        out.iter()
            .map(|f| f.file.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        indicatif::HumanBytes(bytes),
        t0.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// The commit `d.revision` is at and its files, from the Hub's repository API (hf-hub's
/// request, with our retries, time-outs and error texts).
fn list_remote(env: &HubEnv, d: &DataRepo) -> Result<(String, Vec<String>)> {
    let api = ApiBuilder::from_cache(hf_hub::Cache::new(env.cache.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.as_ref().map(|t| t.secret().to_string()))
        .with_progress(false)
        .with_user_agent("lora-train", env!("CARGO_PKG_VERSION"))
        .build()
        .context("cannot set up the Hub client")?;
    let repo = api.repo(Repo::with_revision(
        d.id.to_string(),
        RepoType::Dataset,
        d.revision.to_string(),
    ));
    let at = At {
        repo: d.id,
        revision: d.revision,
        file: "the file list",
        kind: Kind::Dataset,
    };
    let (retries, backoff) = (4u32, Duration::from_millis(500));
    let mut attempt = 0;
    let mut resp = loop {
        let res = repo
            .info_request()
            .config()
            .http_status_as_error(false)
            .timeout_connect(Some(env.etag_timeout.min(Duration::from_secs(20))))
            .timeout_recv_response(Some(env.etag_timeout))
            .timeout_recv_body(Some(env.download_timeout * 2))
            .build()
            .call();
        let why = match res {
            Ok(r) if !transient_status(r.status().as_u16()) || attempt >= retries => break r,
            Ok(r) => format!("HTTP {}", r.status().as_u16()),
            Err(e) if transient_error(&e) && attempt < retries => e.to_string(),
            Err(e) => return Err(unreachable(env, &at, e.to_string())),
        };
        crate::errln!("{at}: {why}; trying again");
        std::thread::sleep(backoff * 2u32.pow(attempt.min(5)));
        attempt += 1;
    };
    let status = resp.status().as_u16();
    if status != 200 {
        return Err(http_error(env, &at, status, &resp));
    }
    let info: RepoInfo = resp
        .body_mut()
        .with_config()
        .limit(256 << 20)
        .read_json()
        .map_err(|e| {
            anyhow::anyhow!(
                "{} answered {at} with something else than the Hub's repository JSON ({e}): is \
                 HF_ENDPOINT a Hugging Face Hub or a mirror of one?",
                env.endpoint
            )
        })?;
    if !is_commit(&info.sha) {
        bail!(
            "{} answered {at} without a commit hash in \"sha\": is HF_ENDPOINT a Hugging Face \
             Hub or a mirror of one?",
            env.endpoint
        );
    }
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    // A repository holds no such names (git has none): a listing with one is not the Hub's.
    if let Some(bad) = files
        .iter()
        .find(|f| f.split('/').any(|p| p.is_empty() || p == "." || p == "..") || f.contains('\0'))
    {
        bail!(
            "{} answered {at} with the file name \"{}\", which is not a path inside a \
             repository (absolute, empty, or with `.` / `..` parts): is HF_ENDPOINT a Hugging \
             Face Hub or a mirror of one?",
            env.endpoint,
            bad.escape_debug()
        );
    }
    Ok((info.sha.to_lowercase(), files))
}

/// Data files: .parquet, .jsonl, .json, outside hidden folders.
fn is_data_file(f: &str) -> bool {
    let lower = f.to_ascii_lowercase();
    DATA_EXTENSIONS.iter().any(|e| lower.ends_with(e))
        && !f.split('/').any(|p| p.starts_with('.'))
        && super::cache::check_repo_path(f).is_ok()
}

/// The names a split goes by in file and folder names (`datasets`' keywords).
fn split_keywords(split: &str) -> Vec<&str> {
    match split {
        "train" => vec!["train", "training"],
        "validation" => vec!["validation", "valid", "val", "dev"],
        "test" => vec!["test", "testing", "eval", "evaluation"],
        s => vec![s],
    }
}

/// A path component (a folder, or a file name up to its first '.') names `keyword`: it is the
/// keyword, or the keyword followed by '-', '.', ' ' or a digit ("train-00000-of-00002",
/// "test2"), so that "train" does not take "train_sft".
fn names(component: &str, keyword: &str) -> bool {
    let stem = component.split('.').next().unwrap_or(component);
    stem.strip_prefix(keyword).is_some_and(|rest| {
        rest.is_empty()
            || rest.starts_with(|c: char| matches!(c, '-' | '.' | ' ') || c.is_ascii_digit())
    })
}

fn split_matches(rel: &str, split: &str) -> bool {
    let kws = split_keywords(split);
    rel.split('/').any(|c| kws.iter().any(|k| names(c, k)))
}

/// The split a file's name shows: the Hub's `{split}-00000-of-00003...` shard names, or a
/// standard split keyword.
fn split_in_name(rel: &str) -> Option<String> {
    for c in rel.split('/') {
        // {split}-{5 digits}-of-{5 digits}
        if let Some(i) = c.find("-of-") {
            let head = &c[..i];
            if let Some(j) = head.rfind('-') {
                let (name, num) = (&head[..j], &head[j + 1..]);
                if !name.is_empty() && num.len() == 5 && num.bytes().all(|b| b.is_ascii_digit()) {
                    return Some(name.to_string());
                }
            }
        }
        for s in ["train", "validation", "test"] {
            if split_keywords(s).iter().any(|k| names(c, k)) {
                return Some(s.to_string());
            }
        }
    }
    None
}

/// A file's subset: its first folder, unless that folder names a split or is `data`.
fn subset_of(f: &str) -> Option<&str> {
    let (first, rest) = f.split_once('/')?;
    (!rest.is_empty() && first != "data" && split_in_name(first).is_none()).then_some(first)
}

/// The data files of `d` among a revision's `files`, sorted: those matching `d.files`, or the
/// files of the split in the subset. A file shows its split in a folder or file name
/// (`data/train-00000-of-00002.parquet`, `main/test-*.parquet`, `default/train/0000.parquet`,
/// `dev.jsonl`); when no file names a split, all of them are the "train" split (one
/// `alpaca_data_cleaned.json`). Errors say what there is to choose from.
pub(crate) fn select(files: &[String], d: &DataRepo) -> Result<Vec<String>, String> {
    let data: Vec<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| is_data_file(f))
        .collect();
    if data.is_empty() {
        return Err("has no data files (.parquet, .jsonl or .json)".into());
    }
    let shown = |v: &[&str]| {
        let mut s = v.iter().take(8).copied().collect::<Vec<_>>().join(", ");
        if v.len() > 8 {
            s.push_str(&format!(", ... ({} in all)", v.len()));
        }
        s
    };
    if let Some(g) = d.files {
        let mut m: Vec<String> = data
            .iter()
            .filter(|f| glob_match(g.as_bytes(), f.as_bytes()))
            .map(|f| f.to_string())
            .collect();
        if m.is_empty() {
            return Err(format!(
                "has no data file matching data.files = \"{g}\"; its data files: {}",
                shown(&data)
            ));
        }
        m.sort();
        return Ok(m);
    }
    let pool: Vec<(&str, &str)> = match d.subset {
        Some(s) => {
            let p: Vec<(&str, &str)> = data
                .iter()
                .filter_map(|f| f.strip_prefix(s)?.strip_prefix('/').map(|r| (*f, r)))
                .collect();
            if p.is_empty() {
                let subsets: BTreeSet<&str> = data.iter().filter_map(|f| subset_of(f)).collect();
                return Err(format!(
                    "has no subset \"{s}\" (a folder of data files); its subsets: {}",
                    if subsets.is_empty() {
                        "none (unset data.subset)".to_string()
                    } else {
                        subsets.into_iter().collect::<Vec<_>>().join(", ")
                    }
                ));
            }
            p
        }
        None => data.iter().map(|f| (*f, *f)).collect(),
    };
    let matched: Vec<(&str, &str)> = pool
        .iter()
        .copied()
        .filter(|(_, rel)| split_matches(rel, d.split))
        .collect();
    let chosen = if !matched.is_empty() {
        matched
    } else {
        let named: BTreeSet<String> = pool.iter().filter_map(|(_, r)| split_in_name(r)).collect();
        if d.split == "train" && named.is_empty() {
            pool
        } else {
            let all: Vec<&str> = pool.iter().map(|(f, _)| *f).collect();
            return Err(format!(
                "has no split \"{}\"{}: its splits: {} (data files: {}); set data.split, or \
                 data.files to a glob of the files to read",
                d.split,
                d.subset
                    .map_or(String::new(), |s| format!(" in subset \"{s}\"")),
                if named.is_empty() {
                    "train (its files name no split)".to_string()
                } else {
                    named.into_iter().collect::<Vec<_>>().join(", ")
                },
                shown(&all)
            ));
        }
    };
    if d.subset.is_none() {
        let subsets: BTreeSet<&str> = chosen.iter().filter_map(|(f, _)| subset_of(f)).collect();
        if subsets.len() > 1 {
            return Err(format!(
                "has split \"{}\" in several subsets ({}): set data.subset to one of them",
                d.split,
                subsets.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    let mut out: Vec<String> = chosen.into_iter().map(|(f, _)| f.to_string()).collect();
    out.sort();
    Ok(out)
}

/// `*` any characters but '/', `**` any characters, `**/` any folders (or none), `?` one
/// character but '/'.
pub(crate) fn glob_match(p: &[u8], s: &[u8]) -> bool {
    match p {
        [] => s.is_empty(),
        [b'*', b'*', b'/', rest @ ..] => {
            glob_match(rest, s)
                || s.iter()
                    .enumerate()
                    .any(|(i, &c)| c == b'/' && glob_match(rest, &s[i + 1..]))
        }
        [b'*', b'*', rest @ ..] => (0..=s.len()).any(|i| glob_match(rest, &s[i..])),
        [b'*', rest @ ..] => {
            let seg = s.iter().position(|&c| c == b'/').unwrap_or(s.len());
            (0..=seg).any(|i| glob_match(rest, &s[i..]))
        }
        [b'?', rest @ ..] => s.first().is_some_and(|&c| c != b'/') && glob_match(rest, &s[1..]),
        [c, rest @ ..] => s.first() == Some(c) && glob_match(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(
        files: &[&str],
        subset: Option<&str>,
        split: &str,
        glob: Option<&str>,
    ) -> Result<Vec<String>, String> {
        let files: Vec<String> = files.iter().map(|s| s.to_string()).collect();
        let d = DataRepo {
            id: "o/n",
            revision: "main",
            subset,
            split,
            files: glob,
        };
        select(&files, &d)
    }

    #[test]
    fn uris() {
        assert_eq!(
            repo_of("hf://datasets/yahma/alpaca-cleaned"),
            Some(Ok("yahma/alpaca-cleaned"))
        );
        assert_eq!(repo_of("data/x.jsonl"), None);
        for bad in [
            "hf://yahma/alpaca",
            "hf://datasets/alpaca",
            "hf://datasets/a/b/c",
            "hf://datasets/a b/c",
        ] {
            assert!(repo_of(bad).is_some_and(|r| r.is_err()), "{bad}");
        }
    }

    #[test]
    fn splits_and_subsets_as_the_hub_lays_them_out() {
        // yahma/alpaca-cleaned: one JSON file, no split in its name: the train split.
        let alpaca = [".gitattributes", "README.md", "alpaca_data_cleaned.json"];
        assert_eq!(
            pick(&alpaca, None, "train", None).unwrap(),
            ["alpaca_data_cleaned.json"]
        );
        let e = pick(&alpaca, None, "test", None).unwrap_err();
        assert!(
            e.starts_with("has no split \"test\": its splits: train (its files name no split)"),
            "{e}"
        );
        // HuggingFaceH4/ultrachat_200k: data/{split}-0000k-of-0000n-<hash>.parquet.
        let ultra = [
            "data/test_gen-00000-of-00001-3d4cd8309148a71f.parquet",
            "data/test_sft-00000-of-00001-f7dfac4afe5b93f4.parquet",
            "data/train_gen-00000-of-00003-a6c9fb894be3e50b.parquet",
            "data/train_sft-00000-of-00003-a3ecf92756993583.parquet",
            "data/train_sft-00001-of-00003-0a1804bcb6ae68c6.parquet",
            "data/train_sft-00002-of-00003-ee46ed25cfae92c6.parquet",
        ];
        let got = pick(&ultra, None, "train_sft", None).unwrap();
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|f| f.starts_with("data/train_sft-")));
        let e = pick(&ultra, None, "train", None).unwrap_err();
        assert!(
            e.starts_with(
                "has no split \"train\": its splits: test_gen, test_sft, train_gen, train_sft"
            ),
            "{e}"
        );
        // openai/gsm8k: subsets main and socratic.
        let gsm = [
            "main/test-00000-of-00001.parquet",
            "main/train-00000-of-00001.parquet",
            "socratic/test-00000-of-00001.parquet",
            "socratic/train-00000-of-00001.parquet",
        ];
        assert_eq!(
            pick(&gsm, Some("main"), "train", None).unwrap(),
            ["main/train-00000-of-00001.parquet"]
        );
        let e = pick(&gsm, None, "train", None).unwrap_err();
        assert_eq!(e, "has split \"train\" in several subsets (main, socratic): set data.subset to one of them");
        let e = pick(&gsm, Some("mian"), "train", None).unwrap_err();
        assert_eq!(
            e,
            "has no subset \"mian\" (a folder of data files); its subsets: main, socratic"
        );
        // refs/convert/parquet: {subset}/{split}/0000.parquet; validation's aliases.
        let conv = [
            "default/train/0000.parquet",
            "default/train/0001.parquet",
            "default/validation/0000.parquet",
        ];
        assert_eq!(pick(&conv, None, "train", None).unwrap().len(), 2);
        assert_eq!(
            pick(&["dev.jsonl", "train.jsonl"], None, "validation", None).unwrap(),
            ["dev.jsonl"]
        );
        // files: a glob instead.
        assert_eq!(
            pick(&gsm, None, "train", Some("*/train-*.parquet"))
                .unwrap()
                .len(),
            2
        );
        assert_eq!(pick(&gsm, None, "x", Some("**/test-*")).unwrap().len(), 2);
        let e = pick(&gsm, None, "train", Some("*.jsonl")).unwrap_err();
        assert!(
            e.starts_with(
                "has no data file matching data.files = \"*.jsonl\"; its data files: main/test-"
            ),
            "{e}"
        );
        assert_eq!(
            pick(&["README.md"], None, "train", None).unwrap_err(),
            "has no data files (.parquet, .jsonl or .json)"
        );
    }

    #[test]
    fn globs() {
        let m = |p: &str, s: &str| glob_match(p.as_bytes(), s.as_bytes());
        assert!(m(
            "data/train-*.parquet",
            "data/train-00000-of-00001.parquet"
        ));
        assert!(!m("*.parquet", "data/train.parquet"));
        assert!(m("**/*.parquet", "data/train.parquet") && m("**/*.parquet", "train.parquet"));
        assert!(m("**", "a/b/c") && m("a?c", "abc") && !m("a?c", "a/c"));
    }
}
