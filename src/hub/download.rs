//! The Hub client: the resolve endpoint (`{endpoint}/{repo}/resolve/{revision}/{file}`), HEAD
//! for a file's commit, ETag and size, then GET with `Range` into `blobs/<etag>.incomplete`.
//!
//! As Python's huggingface_hub: relative redirects of HEAD are followed (renamed repos), an
//! absolute one is where the bytes are (a CDN for LFS files, with `X-Linked-Etag` /
//! `X-Linked-Size`), and an interrupted download continues from the bytes already on disk,
//! within a run (retries) and across runs (`fetch`). The token goes only to the endpoint's own
//! origin (scheme, host and port; CDN URLs are pre-signed) and is never printed. What a HEAD
//! answers is checked before it is used: a commit hash, an ETag usable as a file name, sizes
//! that are byte counts, the commit asked for when a commit was asked for.

use super::cache::is_commit;
pub use super::env::HubEnv;
use super::fetch::{byte_count, is_sha256};
use anyhow::{bail, Result};
use std::fmt;
use std::time::Duration;
use ureq::http::Response;

/// A model repository or a data set repository (`{endpoint}/datasets/{repo}/...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Model,
    Dataset,
}

/// Which file of which repository at which revision: every error names all three.
#[derive(Debug, Clone, Copy)]
pub(crate) struct At<'a> {
    pub(crate) repo: &'a str,
    /// As the user gave it (a branch, tag or commit).
    pub(crate) revision: &'a str,
    pub(crate) file: &'a str,
    pub(crate) kind: Kind,
}

impl<'a> At<'a> {
    pub(crate) fn model(repo: &'a str, revision: &'a str, file: &'a str) -> At<'a> {
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
pub(crate) struct Unreachable {
    pub(crate) endpoint: String,
    pub(crate) at: String,
    pub(crate) cause: String,
    pub(crate) cache: String,
    /// What an offline run needs, and how to get it there.
    pub(crate) need: String,
    pub(crate) how: String,
}

/// What HEAD on a resolve URL says about a file that exists.
#[derive(Debug, Clone)]
pub(crate) struct Remote {
    /// X-Repo-Commit: the commit the revision resolved to.
    pub(crate) commit: String,
    /// X-Linked-Etag (LFS: the sha256), else ETag; unquoted. Names the blob.
    pub(crate) etag: String,
    /// X-Linked-Size, else the Content-Length of a 2xx answer (a redirect's is its own body's).
    pub(crate) size: Option<u64>,
    /// The header `size` came from.
    pub(crate) size_from: &'static str,
    /// Where the bytes are: the resolve URL, or the absolute URL it redirects to.
    pub(crate) url: String,
}

pub(crate) enum Head {
    Found(Remote),
    /// 404 "EntryNotFound" (or a 404 without an error code): no such file at that revision.
    Missing,
}

/// A failed attempt: worth another try (after a pause, resuming), or not.
pub(super) enum Fail {
    Retry(String),
    Stop(anyhow::Error),
}

/// The Hub client of one run.
pub(crate) struct Hub<'a> {
    pub(crate) env: &'a HubEnv,
    agent: ureq::Agent,
    /// Attempts after the first, for transient failures (reset whenever a MiB arrives).
    pub(crate) retries: u32,
    /// First pause between attempts; doubles each time.
    pub(crate) backoff: Duration,
}

impl<'a> Hub<'a> {
    pub(crate) fn new(env: &'a HubEnv) -> Hub<'a> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("lora-train/", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(env.etag_timeout.min(Duration::from_secs(20))))
            .timeout_recv_response(Some(env.etag_timeout))
            .timeout_per_read(Some(env.download_timeout))
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
    pub(super) fn send(
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
        if let Some(t) = &self.env.token {
            if origin(url) == origin(&self.env.endpoint) {
                req = req.header("Authorization", format!("Bearer {}", t.secret()));
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
            crate::errln!("{at}: {retry}; trying again");
            std::thread::sleep(self.backoff * 2u32.pow(attempt.min(5)));
            attempt += 1;
        }
    }

    /// HEAD `file` at `revision` (a commit once known): the file's commit, ETag, size and
    /// download URL, or Missing. Errors for a missing repository or revision, for access
    /// refused, and for a server that does not speak the Hub's protocol.
    pub(crate) fn head(&self, at: &At, revision: &str) -> Result<Head> {
        let mut url = self.resolve_url(at, revision);
        for _hop in 0..8 {
            let resp = self.call(at, true, &url)?;
            let status = resp.status().as_u16();
            let h = |name: &str| header(&resp, name);
            let redirect = (300..400).contains(&status);
            let location = h("location").filter(|l| !l.trim().is_empty());
            match &location {
                Some(loc) if redirect && loc.starts_with('/') && !loc.starts_with("//") => {
                    url = format!("{}{loc}", origin(&url));
                    continue;
                }
                None if redirect => bail!(
                    "{} answered HEAD {url} with HTTP {status} and no Location (for {at}): is \
                     HF_ENDPOINT a Hugging Face Hub or a mirror of one?",
                    self.env.endpoint
                ),
                _ => {}
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
            return self
                .found(at, revision, &url, &resp, location)
                .map(Head::Found);
        }
        bail!(
            "{}: more than 8 redirects for {at} (the last to {url}): a redirect loop",
            self.env.endpoint
        )
    }

    /// What a HEAD that found the file at `url` says about it, checked.
    fn found(
        &self,
        at: &At,
        revision: &str,
        url: &str,
        resp: &Response<ureq::Body>,
        location: Option<String>,
    ) -> Result<Remote> {
        let h = |name: &str| header(resp, name);
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
        let commit = commit.to_lowercase();
        if is_commit(revision) && commit != revision.to_lowercase() {
            bail!(
                "{} answered HEAD {url} for commit {revision} with X-Repo-Commit {commit} (for \
                 {at}): is HF_ENDPOINT a Hugging Face Hub or a mirror of one?",
                self.env.endpoint
            );
        }
        let mut etag = h("x-linked-etag")
            .or_else(|| h("etag"))
            .map(|e| unquote_etag(&e))
            .ok_or_else(|| protocol("an ETag header"))?;
        // The ETag becomes a file name in blobs/ (and an LFS one is checked as the sha256).
        let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if !etag.chars().all(plain) || etag.trim_matches('.').is_empty() || etag.len() > 128 {
            return Err(protocol("a usable ETag"));
        }
        if is_sha256(&etag.to_ascii_lowercase()) {
            etag = etag.to_ascii_lowercase();
        }
        let count = |name: &str, v: String| {
            byte_count(name, &v).map_err(|m| {
                anyhow::anyhow!(
                    "{} answered HEAD {url} with {m} (for {at}): is HF_ENDPOINT a Hugging Face \
                     Hub or a mirror of one?",
                    self.env.endpoint
                )
            })
        };
        let redirect = (300..400).contains(&resp.status().as_u16());
        let (size, size_from) = match (h("x-linked-size"), h("content-length")) {
            (Some(v), _) => (Some(count("X-Linked-Size", v)?), "X-Linked-Size"),
            (None, Some(v)) if !redirect => (Some(count("Content-Length", v)?), "Content-Length"),
            _ => (None, ""),
        };
        let target = match location {
            Some(loc) if redirect => join_url(url, &loc),
            _ => url.to_string(),
        };
        if !is_http(&target) {
            bail!(
                "{} answered HEAD {url} with a redirect to {target}, which is not an http(s) URL \
                 (for {at})",
                self.env.endpoint
            );
        }
        Ok(Remote {
            commit,
            etag,
            size,
            size_from,
            url: target,
        })
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

/// An http:// or https:// URL (the only schemes a download may go to).
pub(super) fn is_http(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// `https://host:port/a/b` → `https://host:port`.
pub(super) fn origin(url: &str) -> &str {
    let start = url.find("://").map_or(0, |i| i + 3);
    match url[start..].find('/') {
        Some(i) => &url[..start + i],
        None => url,
    }
}

/// A Location header against the URL it answered.
pub(super) fn join_url(base: &str, loc: &str) -> String {
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

    #[test]
    fn urls_and_headers() {
        let e = HubEnv::from_vars(|k| match k {
            "HF_ENDPOINT" => Some("http://127.0.0.1:9".into()),
            "HOME" => Some("/h".into()),
            _ => None,
        })
        .unwrap();
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
        assert!(is_http("HTTPS://x") && is_http("http://x") && !is_http("file:///etc/passwd"));
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
