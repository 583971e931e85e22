//! Where a checkpoint's files are: config.json, the (sharded) safetensors, the tokenizer.
//!
//! `[model] path` is a local directory. `[model] id` (+ `revision`) is a Hub repository,
//! downloaded into the standard Hugging Face cache (shared with Python's huggingface_hub; see
//! `cache`) and read from its `snapshots/<commit>/` directory. A revision whose snapshot is
//! complete in the cache needs no network; with HF_HUB_OFFLINE=1 the network is never used.
//! Data sets (`hf://datasets/ORG/NAME`) share the client and the cache: see [`dataset`].

pub(crate) mod cache;
pub mod dataset;
pub mod download;
pub(crate) mod env;
mod fetch;
mod progress;

use anyhow::{bail, Context, Result};
use cache::{is_commit, RepoCache};
use download::{At, Head, Hub, HubEnv, Unreachable};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Files fetched besides the weights, and whether a checkpoint must have them.
pub(crate) const META_FILES: [(&str, bool); 5] = [
    ("config.json", true),
    ("generation_config.json", false),
    ("tokenizer.json", false),
    ("tokenizer_config.json", false),
    ("special_tokens_map.json", false),
];
pub(crate) const INDEX: &str = "model.safetensors.index.json";
pub(crate) const SINGLE: &str = "model.safetensors";
/// The revision a Hub id is read at when none is given.
pub const DEFAULT_REVISION: &str = "main";

/// The files of one Hugging Face checkpoint directory.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The checkpoint's directory (a local one, or the snapshot in the Hub cache).
    pub dir: PathBuf,
    /// Its config.json.
    pub config: PathBuf,
    /// One `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub(crate) weights: Vec<PathBuf>,
    /// tokenizer.json, when there is one.
    pub tokenizer: Option<PathBuf>,
    /// tokenizer_config.json (chat template, special tokens), when there is one.
    pub tokenizer_config: Option<PathBuf>,
}

impl ModelFiles {
    /// The files of the checkpoint directory `dir`; an error names what is missing and the fix.
    pub fn local(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = dir.join("config.json");
        if !config.is_file() {
            bail!(
                "{} has no config.json: is it a Hugging Face checkpoint directory?",
                dir.display()
            );
        }
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let weights = if index.is_file() {
            shards_from_index(&index)?
        } else if single.is_file() {
            vec![single]
        } else {
            bail!(
                "{} has neither model.safetensors nor model.safetensors.index.json \
                 (PyTorch .bin checkpoints are not read: convert them with safetensors first)",
                dir.display()
            );
        };
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(ModelFiles {
            dir: dir.to_owned(),
            config,
            weights,
            tokenizer: opt("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
        })
    }
}

/// The distinct shard names of `model.safetensors.index.json`'s `weight_map`, in name order.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
    let files: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
    for f in &files {
        // A downloaded index decides which paths are read: none may leave the directory.
        cache::check_repo_path(f)
            .with_context(|| format!("{} names the shard \"{f}\"", index.display()))?;
    }
    Ok(files.into_iter().map(String::from).collect())
}

/// The shard files of `model.safetensors.index.json`, which must all be there.
fn shards_from_index(index: &Path) -> Result<Vec<PathBuf>> {
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for f in shard_names(index)? {
        let p = dir.join(&f);
        if !p.is_file() {
            bail!(
                "{} names shard {f}, which is missing from {}",
                index.display(),
                dir.display()
            );
        }
        out.push(p);
    }
    if out.is_empty() {
        bail!("{} lists no shards", index.display());
    }
    Ok(out)
}

pub(crate) use crate::util::{check_repo_id, check_revision};

/// `id` and `revision` checked as the Hub defines them, before either becomes part of a path
/// or a URL.
fn check_names(id: &str, revision: &str) -> Result<()> {
    check_repo_id(id).map_err(anyhow::Error::msg)?;
    check_revision(revision).map_err(anyhow::Error::msg)
}

/// Where a checkpoint is: a local directory, or a Hub repository at a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A Hugging Face checkpoint directory (config.json + safetensors).
    Local(PathBuf),
    /// A Hub repository id ("org/name") at a branch, tag or commit.
    Hub {
        /// The repository id.
        id: String,
        /// The branch, tag or commit (`DEFAULT_REVISION` when none is given).
        revision: String,
    },
}

impl Source {
    /// A local directory when `path` is given, else the Hub repository `id` at `revision`
    /// (default "main"); None when neither is given.
    pub fn of(path: Option<&Path>, id: Option<&str>, revision: Option<&str>) -> Option<Source> {
        match (path, id) {
            (Some(p), _) => Some(Source::Local(p.to_path_buf())),
            (None, Some(id)) => Some(Source::Hub {
                id: id.to_string(),
                revision: revision.unwrap_or(DEFAULT_REVISION).to_string(),
            }),
            (None, None) => None,
        }
    }
}

/// The checkpoint's files: a local directory as it is, or a Hub repository's snapshot from the
/// Hugging Face cache, downloading what the cache lacks.
pub fn model_files(src: &Source) -> Result<ModelFiles> {
    match src {
        Source::Local(dir) => ModelFiles::local(dir),
        Source::Hub { id, revision } => {
            snapshot(&HubEnv::from_env()?, id, revision, Refresh::IfIncomplete)
        }
    }
}

/// Only a checkpoint's config.json (memory plans need no weights): the local directory's, or
/// the Hub repository's at its revision, from the cache or fetched alone.
pub(crate) fn config_file(src: &Source) -> Result<PathBuf> {
    match src {
        Source::Local(dir) => {
            let c = dir.join("config.json");
            if !c.is_file() {
                bail!(
                    "{} has no config.json: is it a Hugging Face checkpoint directory?",
                    dir.display()
                );
            }
            Ok(c)
        }
        Source::Hub { id, revision } => {
            let rev = revision.as_str();
            check_names(id, rev)?;
            let env = HubEnv::from_env()?;
            let cache = RepoCache::new(&env.cache, id);
            if let Some(c) = cache.commit_for(rev) {
                if cache.has(&c, "config.json") == Some(true) {
                    return Ok(cache.snapshot(&c).join("config.json"));
                }
            }
            if env.offline {
                // The cache lacks it: `snapshot` says so, and how to get it.
                return snapshot(&env, id, rev, Refresh::IfIncomplete).map(|f| f.config);
            }
            let hub = Hub::new(&env);
            let at = At::model(id, rev, "config.json");
            let remote = match hub.head(&at, rev)? {
                Head::Found(r) => r,
                Head::Missing => bail!(missing(&hub, &at)),
            };
            cache.write_ref(rev, &remote.commit)?;
            hub.fetch(&cache, &at, &remote)?;
            Ok(cache.link(&remote.commit, "config.json", &remote.etag)?)
        }
    }
}

/// `lora-train download`: fetches `id` at `revision` into the cache, asking the Hub what the
/// revision is now (unless it is a commit the cache already holds completely).
pub fn download(id: &str, revision: &str) -> Result<ModelFiles> {
    snapshot(&HubEnv::from_env()?, id, revision, Refresh::Always)
}

/// When to ask the Hub about a revision the cache already holds completely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refresh {
    /// Never: a complete snapshot is used as it is (training).
    IfIncomplete,
    /// For branches and tags, always: they move (`download`). Commits never change.
    Always,
}

/// What the snapshot of `commit` lacks (empty: complete). Optional files that are neither
/// there nor known to be absent (`.no_exist`) count only when `strict`.
fn lacking(cache: &RepoCache, commit: &str, strict: bool) -> Vec<String> {
    let mut out = Vec::new();
    for (file, required) in META_FILES {
        match cache.has(commit, file) {
            Some(true) => {}
            Some(false) if !required => {}
            None if !required && !strict => {}
            _ => out.push(file.to_string()),
        }
    }
    let snap = cache.snapshot(commit);
    if snap.join(INDEX).is_file() {
        match shard_names(&snap.join(INDEX)) {
            Ok(names) => out.extend(names.into_iter().filter(|n| !snap.join(n).is_file())),
            Err(_) => out.push(INDEX.to_string()),
        }
    } else if !snap.join(SINGLE).is_file() {
        out.push(format!("{SINGLE} (or {INDEX} and its shards)"));
    }
    out
}

/// `id` at `revision` from the cache under `env`, fetching what it lacks.
pub(crate) fn snapshot(
    env: &HubEnv,
    id: &str,
    revision: &str,
    refresh: Refresh,
) -> Result<ModelFiles> {
    check_names(id, revision)?;
    let cache = RepoCache::new(&env.cache, id);
    let cached = cache.commit_for(revision);
    let complete = cached
        .as_ref()
        .filter(|c| lacking(&cache, c, !env.offline).is_empty());
    let use_cache = |commit: &str, why: &str| {
        crate::errln!("model {id} at \"{revision}\" = commit {commit}, {why}");
        ModelFiles::local(&cache.snapshot(commit))
    };
    if let Some(c) = complete {
        if env.offline || refresh == Refresh::IfIncomplete || is_commit(revision) {
            return use_cache(c, &format!("from the cache {}", cache.dir.display()));
        }
    }
    if env.offline {
        let what = match &cached {
            Some(c) => format!("lacks {}", lacking(&cache, c, false).join(", ")),
            None => "has no snapshot of it".to_string(),
        };
        bail!(
            "HF_HUB_OFFLINE is set and the cache {} {what} ({id} at revision \"{revision}\"): \
             download it first where the Hub is reachable (`lora-train download {id} --revision \
             {revision}`), or unset HF_HUB_OFFLINE",
            cache.dir.display()
        );
    }
    // One process at a time fetches a repository (a second one waits, then finds it fetched).
    let _lock = cache.lock_repo()?;
    let hub = Hub::new(env);
    match fetch_snapshot(&hub, &cache, id, revision) {
        Ok(commit) => ModelFiles::local(&cache.snapshot(&commit)),
        Err(e) => match (complete, e.downcast_ref::<Unreachable>()) {
            (Some(c), Some(u)) => {
                crate::errln!("warning: cannot reach {}: {}", u.endpoint, u.cause);
                use_cache(c, "as last downloaded (it may have moved since)")
            }
            _ => Err(e),
        },
    }
}

/// Downloads config.json, the optional META_FILES and the weights of `id` at `revision` into
/// the cache; returns the commit. config.json at `revision` pins the commit, and every other
/// file is fetched at that commit, so a push meanwhile cannot mix two versions.
fn fetch_snapshot(hub: &Hub, cache: &RepoCache, id: &str, revision: &str) -> Result<String> {
    let at = |file| At::model(id, revision, file);
    let config = match hub.head(&at("config.json"), revision)? {
        Head::Found(r) => r,
        Head::Missing => bail!(missing(hub, &at("config.json"))),
    };
    let commit = config.commit.clone();
    cache.write_ref(revision, &commit)?;
    let t0 = std::time::Instant::now();
    let mut bytes = hub.fetch(cache, &at("config.json"), &config)?;
    cache.link(&commit, "config.json", &config.etag)?;
    for (file, _) in &META_FILES[1..] {
        bytes += fetch_file(hub, cache, &at(file), &commit, false)?.unwrap_or(0);
    }
    let weights = match fetch_file(hub, cache, &at(INDEX), &commit, false)? {
        Some(b) => {
            bytes += b;
            shard_names(&cache.snapshot(&commit).join(INDEX))?
        }
        None => vec![SINGLE.to_string()],
    };
    for file in &weights {
        bytes += fetch_file(hub, cache, &at(file), &commit, true)?.unwrap_or(0);
    }
    crate::errln!(
        "model {id} at \"{revision}\" = commit {commit}: {} fetched in {:.1}s into {}",
        indicatif::HumanBytes(bytes),
        t0.elapsed().as_secs_f64(),
        cache.snapshot(&commit).display()
    );
    Ok(commit)
}

/// Fetches one file at `commit` unless the snapshot already knows it. Some(bytes fetched) when
/// the file exists, None when it does not (an error when `required`).
fn fetch_file(
    hub: &Hub,
    cache: &RepoCache,
    at: &At,
    commit: &str,
    required: bool,
) -> Result<Option<u64>> {
    match cache.has(commit, at.file) {
        Some(true) => return Ok(Some(0)),
        Some(false) if !required => return Ok(None),
        _ => {}
    }
    match hub.head(at, commit)? {
        Head::Found(remote) => {
            let bytes = hub.fetch(cache, at, &remote)?;
            cache.link(commit, at.file, &remote.etag)?;
            Ok(Some(bytes))
        }
        Head::Missing if !required => {
            cache.mark_missing(commit, at.file)?;
            Ok(None)
        }
        Head::Missing => bail!(missing(hub, at)),
    }
}

fn missing(hub: &Hub, at: &At) -> String {
    format!(
        "{} has no {at} (HTTP 404): lora-train needs a safetensors checkpoint (config.json and \
         model.safetensors, or model.safetensors.index.json with its shards; PyTorch .bin \
         weights are not read); check model.id and model.revision",
        hub.env.endpoint
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_as_the_hub_accepts_them() {
        for ok in ["gpt2", "org/name", "meta-llama/Llama-3.2-1B", "a_b/c.d-e"] {
            assert!(check_repo_id(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a/b/c",
            "org/",
            "/name",
            "org/na me",
            "a--b/c",
            "a/b..c",
            "-a/b",
            "a/b.",
        ] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
    }

    /// A cache holding `files` of org/m at `main`, with `absent` marked as not on the Hub.
    fn cache_with(root: &Path, files: &[(&str, &str)], absent: &[&str]) -> (HubEnv, String) {
        let commit = "ab".repeat(20);
        let c = RepoCache::new(root, "org/m");
        std::fs::create_dir_all(c.dir.join("blobs")).unwrap();
        for (i, (name, text)) in files.iter().enumerate() {
            std::fs::write(c.blob(&format!("e{i}")), text).unwrap();
            c.link(&commit, name, &format!("e{i}")).unwrap();
        }
        for name in absent {
            c.mark_missing(&commit, name).unwrap();
        }
        c.write_ref("main", &commit).unwrap();
        let env = HubEnv {
            // Nothing listens on port 9: any request would fail.
            endpoint: "http://127.0.0.1:9".into(),
            cache: root.to_owned(),
            token: None,
            offline: false,
            etag_timeout: std::time::Duration::from_secs(60),
            download_timeout: std::time::Duration::from_secs(60),
        };
        (env, commit)
    }

    #[test]
    fn a_complete_snapshot_needs_no_network_and_offline_names_what_is_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let index = r#"{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}"#;
        let files = [
            ("config.json", "{}"),
            ("tokenizer.json", "{}"),
            (INDEX, index),
            ("s1.safetensors", "x"),
            ("s2.safetensors", "y"),
        ];
        let absent = [
            "generation_config.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ];
        let (mut env, commit) = cache_with(tmp.path(), &files, &absent);
        let f = snapshot(&env, "org/m", "main", Refresh::IfIncomplete).unwrap();
        let snap = tmp.path().join("models--org--m/snapshots").join(&commit);
        assert_eq!(f.dir, snap);
        assert_eq!(
            f.weights,
            [snap.join("s1.safetensors"), snap.join("s2.safetensors")]
        );
        assert_eq!(f.tokenizer, Some(snap.join("tokenizer.json")));
        assert_eq!(f.tokenizer_config, None);
        // The commit itself, too.
        assert!(snapshot(&env, "org/m", &commit, Refresh::Always).is_ok());

        // Optional files neither there nor known absent: online, that is a reason to ask the
        // Hub (which is not there); offline, the snapshot is used without them.
        let tmp2 = tempfile::tempdir().unwrap();
        let (mut env2, _) = cache_with(tmp2.path(), &files, &[]);
        let e = snapshot(&env2, "org/m", "main", Refresh::IfIncomplete).unwrap_err();
        assert!(
            format!("{e:#}").starts_with("cannot reach http://127.0.0.1:9"),
            "{e:#}"
        );
        env2.offline = true;
        assert!(snapshot(&env2, "org/m", "main", Refresh::IfIncomplete).is_ok());

        // A shard missing, offline: the error lists it and says how to get it.
        std::fs::remove_file(snap.join("s2.safetensors")).unwrap();
        env.offline = true;
        let e = snapshot(&env, "org/m", "main", Refresh::IfIncomplete).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "HF_HUB_OFFLINE is set and the cache {} lacks s2.safetensors (org/m at revision \
                 \"main\"): download it first where the Hub is reachable (`lora-train download \
                 org/m --revision main`), or unset HF_HUB_OFFLINE",
                tmp.path().join("models--org--m").display()
            )
        );
    }
}
