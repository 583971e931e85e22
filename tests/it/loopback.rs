//! A second loopback "Hub" for data sets and config-only models: the resolve endpoint
//! (`/{repo}/resolve/{rev}/{file}`, `/datasets/{repo}/resolve/...`: HEAD with ETag and
//! X-Repo-Commit, LFS files 302 to a "CDN" on `localhost` with X-Linked-Etag = sha256 and
//! X-Linked-Size, GET with Range) and the repository API
//! (`/api/datasets/{repo}/revision/{rev}`: {"sha", "siblings": [{"rfilename"}]}). Errors carry
//! X-Error-Code as the Hub's do. One connection at a time, in a thread that stops when dropped
//! (or after two minutes).

use crate::hub::sha256;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";

/// A repository: `datasets/org/name` or `org/name`, its files, and whether it is gated.
#[derive(Clone, Default)]
pub struct Repo {
    pub files: BTreeMap<String, Vec<u8>>,
    pub gated: bool,
    /// Files served with other bytes than their ETag (sha256) names.
    pub corrupt: Vec<String>,
}

impl Repo {
    pub fn add(mut self, name: &str, bytes: Vec<u8>) -> Repo {
        self.files.insert(name.to_string(), bytes);
        self
    }
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    /// Host header: 127.0.0.1 for the Hub, localhost for its CDN.
    pub host: String,
    pub path: String,
}

pub struct Server {
    pub port: u16,
    log: Arc<Mutex<Vec<Req>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(repos: BTreeMap<String, Repo>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (log2, stop2) = (log.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !stop2.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = serve(s, port, &repos, &log2);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Server {
            port,
            log,
            stop,
            thread: Some(thread),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requests(&self) -> Vec<Req> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lfs(name: &str) -> bool {
    name.ends_with(".parquet") || name.ends_with(".safetensors")
}

/// The ETag a file is served with: its sha256 (LFS), else a git-sha1-like stand-in.
pub fn etag(name: &str, bytes: &[u8]) -> String {
    let h = sha256(bytes);
    match lfs(name) {
        true => h,
        false => h[..40].to_string(),
    }
}

fn serve(
    s: TcpStream,
    port: u16,
    repos: &BTreeMap<String, Repo>,
    log: &Mutex<Vec<Req>>,
) -> std::io::Result<()> {
    let (method, path, headers) = crate::common::read_request_head(&s)?;
    let host = headers.get("host").cloned().unwrap_or_default();
    log.lock().unwrap().push(Req {
        method: method.clone(),
        host,
        path: path.clone(),
    });
    let head = method == "HEAD";
    let mut out = s;
    let mut reply = |status: &str, hs: &[(&str, String)], body: &[u8]| {
        let mut text = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in hs {
            text.push_str(&format!("{k}: {v}\r\n"));
        }
        text.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        out.write_all(text.as_bytes())?;
        if !head {
            out.write_all(body)?;
        }
        out.flush()
    };
    let error = |code: &str| {
        let status = match code {
            "GatedRepo" | "RepositoryNotFound" => "401 Unauthorized",
            _ => "404 Not Found",
        };
        let msg = format!("{code} (loopback hub)");
        (
            status,
            vec![
                ("X-Error-Code", code.to_string()),
                ("X-Error-Message", msg.clone()),
            ],
            msg,
        )
    };
    // The CDN: bytes by ETag, with Range.
    if let Some(rest) = path.strip_prefix("/cdn/") {
        let (key, tag) = rest.rsplit_once('/').unwrap_or(("", rest));
        let found = repos.get(&key.replace('~', "/")).and_then(|r| {
            r.files
                .iter()
                .find(|(n, b)| etag(n, b) == tag)
                .map(|(n, b)| (r, n, b))
        });
        let Some((repo, name, bytes)) = found else {
            let (s, h, m) = error("EntryNotFound");
            return reply(s, &h, m.as_bytes());
        };
        let mut bytes = bytes.clone();
        if repo.corrupt.contains(name) {
            bytes[0] ^= 0xff;
        }
        let from: usize = headers
            .get("range")
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .map_or(0, |n| n.parse().unwrap_or(0));
        let body = &bytes[from.min(bytes.len())..];
        return match headers.contains_key("range") {
            true => {
                let range = format!("bytes {from}-{}/{}", bytes.len() - 1, bytes.len());
                reply("206 Partial Content", &[("Content-Range", range)], body)
            }
            false => reply("200 OK", &[], body),
        };
    }
    // The API: /api/datasets/{org}/{name}/revision/{rev}
    if let Some(rest) = path.strip_prefix("/api/datasets/") {
        let seg: Vec<&str> = rest.splitn(4, '/').collect();
        let key = format!("datasets/{}/{}", seg[0], seg.get(1).unwrap_or(&""));
        let (Some(repo), Some(&"revision")) = (repos.get(&key), seg.get(2)) else {
            let (s, h, m) = error("RepositoryNotFound");
            return reply(s, &h, m.as_bytes());
        };
        if repo.gated {
            let (s, h, m) = error("GatedRepo");
            return reply(s, &h, m.as_bytes());
        }
        if seg.get(3).is_some_and(|r| *r != "main" && *r != COMMIT) {
            let (s, h, m) = error("RevisionNotFound");
            return reply(s, &h, m.as_bytes());
        }
        let mut names: Vec<&str> = repo.files.keys().map(String::as_str).collect();
        names.push(".gitattributes");
        let siblings: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({ "rfilename": n }))
            .collect();
        let body = serde_json::json!({ "id": key, "sha": COMMIT, "siblings": siblings });
        return reply("200 OK", &[], body.to_string().as_bytes());
    }
    // The resolve endpoint: /[datasets/]{org}/{name}/resolve/{rev}/{file}
    let rest = path.trim_start_matches('/');
    let (kind, rest) = match rest.strip_prefix("datasets/") {
        Some(r) => ("datasets/", r),
        None => ("", rest),
    };
    let seg: Vec<&str> = rest.splitn(4, '/').collect();
    if seg.len() != 4 || seg[2] != "resolve" {
        let (s, h, m) = error("EntryNotFound");
        return reply(s, &h, m.as_bytes());
    }
    let key = format!("{kind}{}/{}", seg[0], seg[1]);
    let Some(repo) = repos.get(&key) else {
        let (s, h, m) = error("RepositoryNotFound");
        return reply(s, &h, m.as_bytes());
    };
    if repo.gated {
        let (s, h, m) = error("GatedRepo");
        return reply(s, &h, m.as_bytes());
    }
    let (rev, file) = seg[3].split_once('/').unwrap_or(("", ""));
    if rev != "main" && rev != COMMIT {
        let (s, h, m) = error("RevisionNotFound");
        return reply(s, &h, m.as_bytes());
    }
    let Some(bytes) = repo.files.get(file) else {
        let (s, h, m) = error("EntryNotFound");
        return reply(s, &h, m.as_bytes());
    };
    let tag = etag(file, bytes);
    let mut hs = vec![("X-Repo-Commit", COMMIT.to_string())];
    if lfs(file) {
        let cdn = key.replace('/', "~");
        hs.push((
            "Location",
            format!("http://localhost:{port}/cdn/{cdn}/{tag}"),
        ));
        hs.push(("X-Linked-Etag", format!("\"{tag}\"")));
        hs.push(("X-Linked-Size", bytes.len().to_string()));
        hs.push(("ETag", "\"redirect-etag\"".into()));
        reply("302 Found", &hs, b"")
    } else {
        hs.push(("ETag", format!("\"{tag}\"")));
        reply("200 OK", &hs, bytes)
    }
}

/// The binary with a clean Hub environment: HF_HOME = `hf`, HF_ENDPOINT = `endpoint`, and no
/// token, cache, offline or proxy setting of the machine's.
pub fn hub_command(hf: &std::path::Path, endpoint: &str) -> assert_cmd::Command {
    assert_cmd::Command::from_std(hub_std_command(hf, endpoint))
}

/// `hub_command` as a std Command (for a child the test signals).
pub fn hub_std_command(hf: &std::path::Path, endpoint: &str) -> std::process::Command {
    let mut c = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    for k in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "XDG_CACHE_HOME",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        c.env_remove(k);
    }
    c.env("HF_HOME", hf).env("HF_ENDPOINT", endpoint);
    c
}
