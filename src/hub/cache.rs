//! The Hugging Face cache, laid out as Python's huggingface_hub lays it out, so that both
//! tools share downloads:
//!
//! ```text
//! <cache>/models--{org}--{name}/       (data sets: datasets--{org}--{name}/)
//!     blobs/<etag>                 file contents, named by ETag (sha256 for LFS files)
//!     blobs/<etag>.incomplete      a download in progress; resumed with an HTTP Range request
//!     refs/<revision>              the commit a branch or tag pointed to when last fetched
//!     snapshots/<commit>/<file>    relative symlink to ../../blobs/<etag>
//!     .no_exist/<commit>/<file>    empty: the file does not exist at that commit
//! <cache>/.locks/models--{org}--{name}/<etag>.lock    flock()ed while a blob downloads
//! <cache>/.locks/models--{org}--{name}/lora-train.lock   held while we fetch the repository
//! ```
//!
//! `<cache>` is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. Folder names
//! and the snapshot and blob paths are hf-hub's ([`hf_hub::CacheRepo`]); what it lacks is
//! here: atomic refs, `.no_exist`, checked relative links, blocking locks. Revisions and file
//! names are checked before they become paths (`refs/<revision>`, `snapshots/<commit>/<file>`).

use crate::util::lock::{flock_waiting, DirLock, LOCK_SUFFIX};
use crate::util::{atomic_write, check_revision};
use anyhow::{bail, Context, Result};
use hf_hub::{Repo, RepoType};
use std::path::{Path, PathBuf};

/// One repository's folder in the cache.
#[derive(Debug)]
pub(crate) struct RepoCache {
    /// `<cache>/models--{org}--{name}` (or `datasets--...`)
    pub(crate) dir: PathBuf,
    locks: PathBuf,
    repo: hf_hub::CacheRepo,
}

/// `org/name` → `models--org--name` (a bare `name` → `models--name`).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn folder_name(repo_id: &str) -> String {
    Repo::model(repo_id.to_string()).folder_name()
}

/// A full 40-hex-digit commit hash (what `refs/*` hold and `snapshots/*` are named by).
pub(crate) fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A file name inside a repository: relative, `/`-separated, no `.` / `..` / empty parts.
/// Shard names come from a downloaded index, so they are checked before they become paths.
pub(crate) fn check_repo_path(file: &str) -> Result<()> {
    if file.is_empty()
        || file.contains('\\')
        || file
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        bail!("\"{file}\" is not a file name inside a repository");
    }
    Ok(())
}

impl RepoCache {
    /// A model repository's folder.
    pub(crate) fn new(cache: &Path, repo_id: &str) -> RepoCache {
        Self::of(cache, Repo::model(repo_id.to_string()))
    }

    /// A data set repository's folder (`datasets--{org}--{name}`).
    pub(crate) fn dataset(cache: &Path, repo_id: &str) -> RepoCache {
        Self::of(cache, Repo::new(repo_id.to_string(), RepoType::Dataset))
    }

    fn of(cache: &Path, repo: Repo) -> RepoCache {
        let name = repo.folder_name();
        RepoCache {
            dir: cache.join(&name),
            locks: cache.join(".locks").join(name),
            repo: hf_hub::Cache::new(cache.to_owned()).repo(repo),
        }
    }

    pub(crate) fn blob(&self, etag: &str) -> PathBuf {
        self.repo.blob_path(etag)
    }

    pub(crate) fn incomplete(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub(crate) fn snapshot(&self, commit: &str) -> PathBuf {
        self.repo.pointer_path(commit)
    }

    /// Every file of the snapshot of `commit`, `/`-separated, in name order (none when there
    /// is no snapshot).
    pub(crate) fn snapshot_files(&self, commit: &str) -> Vec<String> {
        fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
            let Ok(rd) = std::fs::read_dir(dir) else {
                return;
            };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let rel = format!("{prefix}{name}");
                let p = e.path();
                if p.is_dir() {
                    walk(&p, &format!("{rel}/"), out);
                } else if p.is_file() {
                    out.push(rel);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.snapshot(commit), "", &mut out);
        out.sort();
        out
    }

    fn no_exist(&self, commit: &str, file: &str) -> PathBuf {
        self.dir.join(".no_exist").join(commit).join(file)
    }

    /// The commit `revision` names: itself when it is a commit hash, else `refs/<revision>`
    /// as last fetched (None when never fetched).
    pub(crate) fn commit_for(&self, revision: &str) -> Option<String> {
        if is_commit(revision) {
            return Some(revision.to_lowercase());
        }
        check_revision(revision).ok()?;
        let text = std::fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        let commit = text.trim();
        is_commit(commit).then(|| commit.to_string())
    }

    /// Records that `revision` (a branch or tag) points at `commit`.
    pub(crate) fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        if is_commit(revision) {
            return Ok(());
        }
        check_revision(revision).map_err(anyhow::Error::msg)?;
        let path = self.dir.join("refs").join(revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        atomic_write(&path, commit.as_bytes())
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` (replacing what was there).
    pub(crate) fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf> {
        check_repo_path(file)?;
        let pointer = self.snapshot(commit).join(file);
        let parent = pointer.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        let blob = self.blob(etag);
        let tmp = crate::util::tmp_path(&pointer);
        let _ = std::fs::remove_file(&tmp);
        #[cfg(unix)]
        {
            // snapshots/<commit>/a/b.json → ../../../blobs/<etag>: one `..` per directory level.
            let ups = 2 + file.matches('/').count();
            let target = Path::new(&"../".repeat(ups)).join("blobs").join(etag);
            std::os::unix::fs::symlink(&target, &tmp)
                .with_context(|| format!("cannot create the symlink {}", tmp.display()))?;
        }
        #[cfg(not(unix))]
        std::fs::copy(&blob, &tmp).with_context(|| format!("cannot copy {}", blob.display()))?;
        std::fs::rename(&tmp, &pointer)
            .with_context(|| format!("cannot create {}", pointer.display()))?;
        if !pointer.is_file() {
            bail!(
                "{} does not lead to {}: the cache is damaged; delete {} and download again",
                pointer.display(),
                blob.display(),
                self.dir.display()
            );
        }
        Ok(pointer)
    }

    /// Records that `file` does not exist at `commit` (so later runs need not ask).
    pub(crate) fn mark_missing(&self, commit: &str, file: &str) -> Result<()> {
        check_repo_path(file)?;
        let path = self.no_exist(commit, file);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&path, b"").with_context(|| format!("cannot write {}", path.display()))
    }

    /// `Some(true)`: the snapshot has `file`; `Some(false)`: known not to exist at `commit`;
    /// `None`: not known.
    pub(crate) fn has(&self, commit: &str, file: &str) -> Option<bool> {
        if self.snapshot(commit).join(file).is_file() {
            Some(true)
        } else if self.no_exist(commit, file).is_file() {
            Some(false)
        } else {
            None
        }
    }

    /// Takes this repository's lock for a fetch (`.locks/<folder>/lora-train.lock`), waiting
    /// while another process holds it; held until the guard drops.
    pub(crate) fn lock_repo(&self) -> Result<DirLock> {
        DirLock::wait(
            &self.locks.join(LOCK_SUFFIX),
            &self.dir,
            "lora-train download",
        )
    }

    /// Takes the download lock of `blobs/<etag>`; held until the guard drops. Another process
    /// (ours or Python's) downloading the same blob makes this wait for it.
    pub(crate) fn lock(&self, etag: &str) -> Result<BlobLock> {
        std::fs::create_dir_all(&self.locks)
            .with_context(|| format!("cannot create {}", self.locks.display()))?;
        let path = self.locks.join(format!("{etag}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        flock_waiting(
            &file,
            &path,
            "waiting for another download of the same file",
        )?;
        Ok(BlobLock { _file: file })
    }
}

/// Holds a blob's lock file open (and flock()ed on Unix); closing it releases the lock.
pub(crate) struct BlobLock {
    _file: std::fs::File,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_huggingface_hub() {
        let tmp = tempfile::tempdir().unwrap();
        let c = RepoCache::new(tmp.path(), "org/name");
        assert_eq!(c.dir, tmp.path().join("models--org--name"));
        assert_eq!(folder_name("gpt2"), "models--gpt2");
        let d = RepoCache::dataset(tmp.path(), "org/name");
        assert_eq!(d.dir, tmp.path().join("datasets--org--name"));
        assert_eq!(d.blob("e"), tmp.path().join("datasets--org--name/blobs/e"));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        assert!(is_commit(commit) && !is_commit("main") && !is_commit(&commit[1..]));

        // refs: a branch resolves through refs/, a commit to itself, an unknown one to None.
        assert_eq!(c.commit_for("main"), None);
        c.write_ref("main", commit).unwrap();
        c.write_ref("refs/pr/1", commit).unwrap();
        assert_eq!(
            std::fs::read_to_string(c.dir.join("refs/main")).unwrap(),
            commit
        );
        assert_eq!(c.commit_for("main").as_deref(), Some(commit));
        assert_eq!(c.commit_for("refs/pr/1").as_deref(), Some(commit));
        assert_eq!(c.commit_for(commit).as_deref(), Some(commit));

        // A pointer is a relative symlink into blobs/, also from a subdirectory.
        std::fs::create_dir_all(c.dir.join("blobs")).unwrap();
        std::fs::write(c.blob("e1"), "one").unwrap();
        let p = c.link(commit, "config.json", "e1").unwrap();
        assert_eq!(p, c.snapshot(commit).join("config.json"));
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "one");
        #[cfg(unix)]
        assert_eq!(std::fs::read_link(&p).unwrap(), Path::new("../../blobs/e1"));
        let p = c.link(commit, "sub/dir/x.json", "e1").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "one");
        #[cfg(unix)]
        assert_eq!(
            std::fs::read_link(&p).unwrap(),
            Path::new("../../../../blobs/e1")
        );
        assert_eq!(c.has(commit, "config.json"), Some(true));
        assert_eq!(c.snapshot_files(commit), ["config.json", "sub/dir/x.json"]);
        assert_eq!(c.has(commit, "tokenizer.json"), None);
        c.mark_missing(commit, "tokenizer.json").unwrap();
        assert_eq!(c.has(commit, "tokenizer.json"), Some(false));

        // Names from a downloaded index never leave the snapshot; revisions never leave refs/.
        for bad in ["../x", "a/../../x", "/etc/passwd", "", "a//b", "a\\b"] {
            assert!(c.link(commit, bad, "e1").is_err(), "{bad}");
        }
        for bad in [
            "/tmp/x", "../../x", "a/../b", "a//b", ".hidden", "x.lock", "",
        ] {
            assert!(c.write_ref(bad, commit).is_err(), "{bad}");
            assert_eq!(c.commit_for(bad), None, "{bad}");
        }
        // The lock can be taken again once released.
        drop(c.lock("e1").unwrap());
        drop(c.lock("e1").unwrap());
    }
}
