//! The Hub client: the resolve endpoint (`{endpoint}/{repo}/resolve/{revision}/{file}`), HEAD
//! for a file's commit, ETag and size, then GET with `Range` into `blobs/<etag>.incomplete`.
//!
//! As Python's huggingface_hub: relative redirects of HEAD are followed (renamed repos), an
//! absolute one is where the bytes are (a CDN for LFS files, with `X-Linked-Etag` /
//! `X-Linked-Size`), and an interrupted download continues from the bytes already on disk,
//! within a run (retries) and across runs. The token goes only to the endpoint's own origin
//! (CDN URLs are pre-signed) and is never printed.

use super::cache::{is_commit, RepoCache};
use super::progress::FileBar;
use anyhow::{bail, Context, Result};
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;
use ureq::http::Response;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A Hub access token. Debug and Display print `***`; only the Authorization header sees it.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// The token itself, for a client that sends it (hf-hub's API).
    pub(super) fn secret(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Where the Hub is, where the cache is, and how to authenticate: the environment variables
/// Python's huggingface_hub reads, with its defaults.
#[derive(Debug, Clone)]
pub struct HubEnv {
    /// $HF_ENDPOINT without a trailing `/`. Default: https://huggingface.co
    pub endpoint: String,
    /// $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    /// ~/.cache/huggingface/hub.
    pub cache: PathBuf,
    /// $HF_TOKEN, else the file $HF_TOKEN_PATH, else $HF_HOME/token (`huggingface-cli login`).
    pub token: Option<Token>,
    /// $HF_HUB_OFFLINE is 1 / true / yes / on: never use the network.
    pub offline: bool,
}

impl HubEnv {
    pub fn from_env() -> HubEnv {
        HubEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// The same from any variable lookup (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> HubEnv {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = var("HOME").map(PathBuf::from).unwrap_or_default();
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache"))
                .join("huggingface")
        });
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token = var("HF_TOKEN")
            .or_else(|| {
                let path = var("HF_TOKEN_PATH")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(path).ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .map(Token);
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        HubEnv {
            endpoint,
            cache,
            token,
            offline,
        }
    }
}

/// A model repository or a data set repository (`{endpoint}/datasets/{repo}/...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Model,
    Dataset,
}

/// Which file of which repository at which revision: every error names all three.
#[derive(Debug, Clone, Copy)]
pub struct At<'a> {
    pub repo: &'a str,
    /// As the user gave it (a branch, tag or commit).
    pub revision: &'a str,
    pub file: &'a str,
    pub kind: Kind,
}

impl<'a> At<'a> {
    pub fn model(repo: &'a str, revision: &'a str, file: &'a str) -> At<'a> {
        At {
            repo,
            revision,
            file,
            kind: Kind::Model,
        }
    }
}

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let kind = match self.kind {
            Kind::Model => "",
            Kind::Dataset => "data set ",
        };
        write!(
            f,
            "{} of {kind}{} at revision \"{}\"",
            self.file, self.repo, self.revision
        )
    }
}

/// The Hub could not be reached (no route, DNS, refused, timeouts after retries): the one
/// failure that a complete cache can stand in for.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot reach {endpoint} to download {at}: {cause}\n  Check the network, a proxy \
     (HTTPS_PROXY) or HF_ENDPOINT. Offline runs (HF_HUB_OFFLINE=1) need {need} in the cache \
     {cache}: {how}"
)]
pub struct Unreachable {
    pub endpoint: String,
    pub at: String,
    pub cause: String,
    pub cache: String,
    /// What an offline run needs, and how to get it there.
    pub need: String,
    pub how: String,
}

/// What HEAD on a resolve URL says about a file that exists.
#[derive(Debug, Clone)]
pub struct Remote {
    /// X-Repo-Commit: the commit the revision resolved to.
    pub commit: String,
    /// X-Linked-Etag (LFS: the sha256), else ETag; unquoted. Names the blob.
    pub etag: String,
    /// X-Linked-Size, else Content-Length.
    pub size: Option<u64>,
    /// Where the bytes are: the resolve URL, or the absolute URL it redirects to.
    pub url: String,
}

pub enum Head {
    Found(Remote),
    /// 404 "EntryNotFound" (or a 404 without an error code): no such file at that revision.
    Missing,
}

/// A failed attempt: worth another try (after a pause, resuming), or not.
enum Fail {
    Retry(String),
    Stop(anyhow::Error),
}

/// The Hub client of one run.
pub struct Hub<'a> {
    pub env: &'a HubEnv,
    agent: ureq::Agent,
    /// Attempts after the first, for transient failures (reset whenever bytes arrive).
    pub retries: u32,
    /// First pause between attempts; doubles each time.
    pub backoff: Duration,
}

impl<'a> Hub<'a> {
    pub fn new(env: &'a HubEnv) -> Hub<'a> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("lora-train/", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(20)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .build();
        Hub {
            env,
            agent: config.into(),
            retries: 4,
            backoff: Duration::from_millis(500),
        }
    }

    fn resolve_url(&self, at: &At, revision: &str) -> String {
        // Revisions such as refs/pr/1 are one path segment: their `/` is escaped.
        let file: Vec<String> = at.file.split('/').map(encode).collect();
        let kind = match at.kind {
            Kind::Model => "",
            Kind::Dataset => "datasets/",
        };
        format!(
            "{}/{kind}{}/resolve/{}/{}",
            self.env.endpoint,
            at.repo,
            encode(revision),
            file.join("/")
        )
    }

    /// One request; the token is attached only for the endpoint's own origin.
    fn send(
        &self,
        head: bool,
        url: &str,
        from: Option<u64>,
    ) -> Result<Response<ureq::Body>, ureq::Error> {
        let mut req = if head {
            self.agent.head(url)
        } else {
            self.agent.get(url)
        };
        req = req.header("Accept-Encoding", "identity");
        if let Some(Token(t)) = &self.env.token {
            if origin(url) == origin(&self.env.endpoint) {
                req = req.header("Authorization", format!("Bearer {t}"));
            }
        }
        if let Some(from) = from {
            req = req.header("Range", format!("bytes={from}-"));
        }
        req.call()
    }

    pub(super) fn unreachable(&self, at: &At, cause: String) -> anyhow::Error {
        unreachable(self.env, at, cause)
    }

    /// One request with retries of transient failures (time-outs, dropped connections,
    /// 429 and 5xx); a host that does not exist or refuses connections fails at once.
    fn call(&self, at: &At, head: bool, url: &str) -> Result<Response<ureq::Body>> {
        let mut attempt = 0;
        loop {
            let (res, retry) = match self.send(head, url, None) {
                Ok(r) if transient_status(r.status().as_u16()) => {
                    let s = r.status().as_u16();
                    (Ok(r), format!("HTTP {s}"))
                }
                Ok(r) => return Ok(r),
                Err(e) if transient_error(&e) => {
                    let msg = e.to_string();
                    (Err(e), msg)
                }
                Err(e) => return Err(self.unreachable(at, e.to_string())),
            };
            if attempt >= self.retries {
                return match res {
                    Ok(r) => Ok(r),
                    Err(e) => Err(self.unreachable(at, e.to_string())),
                };
            }
            eprintln!("{at}: {retry}; trying again");
            std::thread::sleep(self.backoff * 2u32.pow(attempt.min(5)));
            attempt += 1;
        }
    }

    /// HEAD `file` at `revision` (a commit once known): the file's commit, ETag, size and
    /// download URL, or Missing. Errors for a missing repository or revision, for access
    /// refused, and for a server that does not speak the Hub's protocol.
    pub fn head(&self, at: &At, revision: &str) -> Result<Head> {
        let mut url = self.resolve_url(at, revision);
        for _hop in 0..8 {
            let resp = self.call(at, true, &url)?;
            let status = resp.status().as_u16();
            let h = |name: &str| header(&resp, name);
            if (300..400).contains(&status) {
                if let Some(loc) =
                    h("location").filter(|l| l.starts_with('/') && !l.starts_with("//"))
                {
                    url = format!("{}{loc}", origin(&url));
                    continue;
                }
            }
            if !(200..400).contains(&status) {
                if status == 404
                    && !matches!(
                        h("x-error-code").as_deref(),
                        Some("RepositoryNotFound" | "RevisionNotFound")
                    )
                {
                    return Ok(Head::Missing);
                }
                return Err(http_error(self.env, at, status, &resp));
            }
            let protocol = |what: &str| {
                anyhow::anyhow!(
                    "{} answered HEAD {url} without {what} (for {at}): is HF_ENDPOINT a Hugging \
                     Face Hub or a mirror of one?",
                    self.env.endpoint
                )
            };
            let commit = h("x-repo-commit").ok_or_else(|| protocol("an X-Repo-Commit header"))?;
            if !is_commit(&commit) {
                return Err(protocol("a commit hash in X-Repo-Commit"));
            }
            let etag = h("x-linked-etag")
                .or_else(|| h("etag"))
                .map(|e| unquote_etag(&e))
                .ok_or_else(|| protocol("an ETag header"))?;
            // The ETag becomes a file name in blobs/.
            let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
            if !etag.chars().all(plain) || etag.trim_matches('.').is_empty() {
                return Err(protocol("a usable ETag"));
            }
            let size = h("x-linked-size")
                .or_else(|| h("content-length"))
                .and_then(|s| s.trim().parse().ok());
            let target = match h("location") {
                Some(loc) if (300..400).contains(&status) => join_url(&url, &loc),
                _ => url,
            };
            return Ok(Head::Found(Remote {
                commit: commit.to_lowercase(),
                etag,
                size,
                url: target,
            }));
        }
        bail!("{}: too many redirects for {at}", self.env.endpoint)
    }

    /// Makes `blobs/<etag>` hold `remote`'s bytes: nothing to do when it is there, else
    /// downloads into `blobs/<etag>.incomplete` (continuing what an earlier attempt or run left
    /// there), checks the size and renames. Returns the bytes that came over the network.
    pub fn fetch(&self, cache: &RepoCache, at: &At, remote: &Remote) -> Result<u64> {
        let blob = cache.blob(&remote.etag);
        if blob.is_file() {
            return Ok(0);
        }
        let blobs = cache.dir.join("blobs");
        std::fs::create_dir_all(&blobs)
            .with_context(|| format!("cannot create {}", blobs.display()))?;
        let _lock = cache.lock(&remote.etag)?;
        if blob.is_file() {
            return Ok(0); // another process finished it while we waited for the lock
        }
        let part = cache.incomplete(&remote.etag);
        // Append mode: after a truncation to 0 the writes start at 0 again.
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&part)
            .with_context(|| format!("cannot open {}", part.display()))?;
        let len = |f: &File| f.metadata().map(|m| m.len());
        let mut have = len(&file)?;
        if remote.size.is_some_and(|s| have > s) {
            file.set_len(0)?;
            have = 0;
        }
        let bar = FileBar::new(at.file, remote.size, have);
        if have > 0 {
            bar.note(&format!(
                "{}: resuming at byte {have} of {}",
                at.file,
                remote.size.map_or("?".into(), |s| s.to_string())
            ));
        }
        let started_at = have;
        let mut attempt = 0;
        loop {
            if remote.size == Some(have) {
                break;
            }
            let before = have;
            let res = self.get_into(&mut file, at, &remote.url, have, &bar);
            have = len(&file)?;
            match res {
                Ok(()) => break,
                Err(Fail::Stop(e)) => return Err(e),
                Err(Fail::Retry(why)) => {
                    if have > before {
                        attempt = 0; // progress was made: this is a flaky link, not a dead one
                    }
                    if attempt >= self.retries {
                        bar.abandon();
                        let kept = format!(
                            "{why} (after {} attempts; {have} bytes kept in {} for the next run)",
                            self.retries + 1,
                            part.display()
                        );
                        return Err(self.unreachable(at, kept));
                    }
                    bar.note(&format!("{}: {why}; resuming at byte {have}", at.file));
                    std::thread::sleep(self.backoff * 2u32.pow(attempt.min(5)));
                    attempt += 1;
                }
            }
        }
        file.sync_all()
            .with_context(|| format!("cannot write {}", part.display()))?;
        drop(file);
        if let Some(size) = remote.size {
            if have != size {
                let _ = std::fs::remove_file(&part);
                bail!(
                    "{at}: downloaded {have} bytes, the Hub announced {size}; the partial file \
                     was deleted: run again"
                );
            }
        }
        // An LFS file's ETag is its sha256.
        if is_sha256(&remote.etag) {
            let got = sha256_file(&part)?;
            if got != remote.etag {
                let _ = std::fs::remove_file(&part);
                bail!(
                    "{at}: the downloaded bytes have sha256 {got}, but the Hub names the file by \
                     its sha256 {}; the download was deleted: run again (a proxy or mirror that \
                     alters files gives this every time)",
                    remote.etag
                );
            }
        }
        std::fs::rename(&part, &blob)
            .with_context(|| format!("cannot rename {} to {}", part.display(), blob.display()))?;
        bar.finish(have - started_at);
        Ok(have - started_at)
    }

    /// One GET from byte `from` to the end, appended to `file`.
    fn get_into(
        &self,
        file: &mut File,
        at: &At,
        url: &str,
        from: u64,
        bar: &FileBar,
    ) -> Result<(), Fail> {
        let mut url = url.to_string();
        let mut hops = 0;
        let resp = loop {
            let resp = match self.send(false, &url, (from > 0).then_some(from)) {
                Ok(r) => r,
                Err(e) if transient_error(&e) => return Err(Fail::Retry(e.to_string())),
                Err(e) => return Err(Fail::Stop(self.unreachable(at, e.to_string()))),
            };
            let status = resp.status().as_u16();
            match header(&resp, "location") {
                Some(loc) if (300..400).contains(&status) && hops < 8 => {
                    url = join_url(&url, &loc);
                    hops += 1;
                }
                _ => break resp,
            }
        };
        let status = resp.status().as_u16();
        let io = |e: std::io::Error| {
            Fail::Stop(anyhow::Error::from(e).context(format!("cannot write the download of {at}")))
        };
        match status {
            206 => {
                let range = header(&resp, "content-range").unwrap_or_default();
                if !range.starts_with(&format!("bytes {from}-")) {
                    file.set_len(0).map_err(io)?;
                    bar.set_position(0);
                    return Err(Fail::Retry(format!(
                        "the server sent the range \"{range}\" for bytes {from}-"
                    )));
                }
            }
            200 => {
                // The whole file, whatever was asked: start over.
                file.set_len(0).map_err(io)?;
                bar.set_position(0);
            }
            416 => {
                file.set_len(0).map_err(io)?;
                bar.set_position(0);
                return Err(Fail::Retry(format!(
                    "bytes {from}- are beyond the end (HTTP 416)"
                )));
            }
            s if transient_status(s) => return Err(Fail::Retry(format!("HTTP {s}"))),
            s => return Err(Fail::Stop(http_error(self.env, at, s, &resp))),
        }
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 18];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Fail::Retry(format!("connection dropped ({e})"))),
            };
            file.write_all(&buf[..n]).map_err(io)?;
            bar.inc(n as u64);
        }
    }
}

/// The error for a Hub that cannot be reached, with what an offline run needs.
pub(super) fn unreachable(env: &HubEnv, at: &At, cause: String) -> anyhow::Error {
    let (need, how) = match at.kind {
        Kind::Model => (
            "every file of the revision".to_string(),
            format!(
                "download it where the Hub is reachable (`lora-train download {} --revision {}`) \
                 or copy that cache here.",
                at.repo, at.revision
            ),
        ),
        Kind::Dataset => (
            "the data set's files".to_string(),
            "train once where the Hub is reachable, or copy that cache here.".to_string(),
        ),
    };
    Unreachable {
        endpoint: env.endpoint.clone(),
        at: at.to_string(),
        cause,
        cache: env.cache.display().to_string(),
        need,
        how,
    }
    .into()
}

/// 64 lowercase hex digits: the ETag the Hub gives an LFS file (its sha256).
fn is_sha256(etag: &str) -> bool {
    etag.len() == 64 && etag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The sha256 of a file, in lowercase hex, read in 1 MiB pieces.
pub fn sha256_file(path: &std::path::Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

pub(super) fn header(resp: &Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.to_string())
}

pub(super) fn transient_status(s: u16) -> bool {
    matches!(s, 408 | 429 | 500 | 502 | 503 | 504)
}

/// Worth retrying: time-outs and connections that broke, not hosts that are not there.
pub(super) fn transient_error(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::*;
    match e {
        ureq::Error::Timeout(_) | ureq::Error::Protocol(_) => true,
        ureq::Error::Io(io) => !matches!(
            io.kind(),
            ConnectionRefused
                | NotFound
                | PermissionDenied
                | AddrNotAvailable
                | NetworkUnreachable
                | HostUnreachable
        ),
        _ => false,
    }
}

/// The error for a final HTTP status, naming repo, revision, file, and what to do.
pub(super) fn http_error(
    env: &HubEnv,
    at: &At,
    status: u16,
    resp: &Response<ureq::Body>,
) -> anyhow::Error {
    let code = header(resp, "x-error-code").unwrap_or_default();
    let server = header(resp, "x-error-message")
        .map(|m| format!(": \"{m}\""))
        .unwrap_or_default();
    let ep = &env.endpoint;
    let (repo, rev) = (at.repo, at.revision);
    // What the repository is, where its page is, and the key that sets its revision.
    let (noun, page, rev_key) = match at.kind {
        Kind::Model => (
            "model",
            format!("{ep}/{repo}"),
            "model.revision (or --revision)",
        ),
        Kind::Dataset => ("data set", format!("{ep}/datasets/{repo}"), "data.revision"),
    };
    let token = if env.token.is_some() {
        "the token that was sent (HF_TOKEN or the token file) cannot read it: use a token of an \
         account that has access"
    } else {
        "no token was sent: set HF_TOKEN to an access token (huggingface.co/settings/tokens)"
    };
    match (status, code.as_str()) {
        (_, "GatedRepo") => anyhow::anyhow!(
            "{repo} is a gated {noun} ({ep} answered HTTP {status} for {at}{server}): accept its \
             license at {page} while logged in, and {token}"
        ),
        (404, "RevisionNotFound") => anyhow::anyhow!(
            "{repo} has no revision \"{rev}\" on {ep} (HTTP 404 for {at}{server}): set \
             {rev_key} to an existing branch, tag or commit"
        ),
        (401 | 403 | 404, "RepositoryNotFound") | (401 | 403, _) => anyhow::anyhow!(
            "{ep} refused {at} (HTTP {status}{server}): the repository does not exist, or it is \
             private or gated; check the id \"{repo}\", and for a private or gated {noun} \
             {token} and accept its license on {page}"
        ),
        _ => anyhow::anyhow!(
            "{ep} answered HTTP {status} for {at}{server}{}",
            if status >= 500 {
                "; the Hub may be down: try again later"
            } else {
                ""
            }
        ),
    }
}

/// `W/"abc"` → `abc`.
fn unquote_etag(e: &str) -> String {
    e.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// `https://host:port/a/b` → `https://host:port`.
fn origin(url: &str) -> &str {
    let start = url.find("://").map_or(0, |i| i + 3);
    match url[start..].find('/') {
        Some(i) => &url[..start + i],
        None => url,
    }
}

/// A Location header against the URL it answered.
fn join_url(base: &str, loc: &str) -> String {
    if loc.contains("://") {
        loc.to_string()
    } else if let Some(rest) = loc.strip_prefix("//") {
        let scheme = base.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else if loc.starts_with('/') {
        format!("{}{loc}", origin(base))
    } else {
        let dir = base.rfind('/').map_or(base, |i| &base[..=i]);
        format!("{dir}{loc}")
    }
}

/// Percent-encodes one path segment (everything but RFC 3986 unreserved characters).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> HubEnv {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn environment_as_huggingface_hub_reads_it() {
        let e = env(&[("HOME", "/h")]);
        assert_eq!(e.endpoint, "https://huggingface.co");
        assert_eq!(e.cache, PathBuf::from("/h/.cache/huggingface/hub"));
        assert!(e.token.is_none() && !e.offline);
        let e = env(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(e.cache, PathBuf::from("/x/huggingface/hub"));
        let e = env(&[
            ("HOME", "/h"),
            ("HF_HOME", "/hf"),
            ("HF_ENDPOINT", "http://m:1/"),
        ]);
        assert_eq!(e.cache, PathBuf::from("/hf/hub"));
        assert_eq!(e.endpoint, "http://m:1");
        let e = env(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "1"),
        ]);
        assert_eq!(e.cache, PathBuf::from("/c"));
        assert!(e.offline);
        for (v, off) in [("0", false), ("true", true), ("ON", true), ("", false)] {
            assert_eq!(env(&[("HF_HUB_OFFLINE", v)]).offline, off, "{v}");
        }

        // HF_TOKEN wins over the token file; the file is $HF_HOME/token unless HF_TOKEN_PATH.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("token"), "hf_file\n").unwrap();
        let home = tmp.path().to_str().unwrap();
        let e = env(&[("HF_HOME", home)]);
        assert_eq!(e.token.as_ref().map(|t| t.0.as_str()), Some("hf_file"));
        let e = env(&[("HF_HOME", home), ("HF_TOKEN", "hf_env")]);
        assert_eq!(e.token.as_ref().map(|t| t.0.as_str()), Some("hf_env"));
        // ... and is never printed.
        let shown = format!("{e:?}");
        assert!(
            !shown.contains("hf_env") && shown.contains("Token(***)"),
            "{shown}"
        );
    }

    #[test]
    fn urls_and_headers() {
        let e = env(&[("HF_ENDPOINT", "http://127.0.0.1:9")]);
        let hub = Hub::new(&e);
        let at = At::model("org/m", "refs/pr/1", "sub dir/a+b.json");
        assert_eq!(
            hub.resolve_url(&at, "refs/pr/1"),
            "http://127.0.0.1:9/org/m/resolve/refs%2Fpr%2F1/sub%20dir/a%2Bb.json"
        );
        let at = At {
            kind: Kind::Dataset,
            ..At::model("org/d", "main", "data/train-00000-of-00001.parquet")
        };
        assert_eq!(
            hub.resolve_url(&at, "main"),
            "http://127.0.0.1:9/datasets/org/d/resolve/main/data/train-00000-of-00001.parquet"
        );
        assert_eq!(
            at.to_string(),
            "data/train-00000-of-00001.parquet of data set org/d at revision \"main\""
        );
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("x");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(is_sha256(&"ab".repeat(32)) && !is_sha256(&"AB".repeat(32)));
        assert_eq!(origin("https://h.co:8/a/b?c"), "https://h.co:8");
        assert_eq!(origin("http://h"), "http://h");
        assert_eq!(join_url("http://a/x/y", "/z"), "http://a/z");
        assert_eq!(join_url("http://a/x/y", "z"), "http://a/x/z");
        assert_eq!(join_url("https://a/x", "//cdn/q"), "https://cdn/q");
        assert_eq!(
            join_url("http://a/x", "https://cdn/q?s=1"),
            "https://cdn/q?s=1"
        );
        assert_eq!(unquote_etag("W/\"abc\""), "abc");
        assert_eq!(unquote_etag("\"e\""), "e");
    }
}
