//! A loopback Hub that can lie: it answers as the Hub does (the resolve endpoint with HEAD,
//! ETag and X-Repo-Commit, LFS files redirected to a "CDN" on `localhost` with X-Linked-Etag /
//! X-Linked-Size and Range, the data set API), except where a test's `Lie` answers a request
//! first. Each connection is served on a thread of its own (a dripping or silent answer does
//! not hold up the next one); the server stops when dropped.

use crate::hub::sha256;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const REPO: &str = "tiny/m";
pub const DATASET: &str = "tiny/d";
pub const COMMIT: &str = "fedcba9876543210fedcba9876543210fedcba98";
pub const TOKEN: &str = "hf_liar_test_token_5e2d77";
pub const CONFIG: &str = "/tiny/m/resolve/main/config.json";
/// Files after config.json are asked for at the commit config.json named.
pub const WEIGHTS: &str =
    "/tiny/m/resolve/fedcba9876543210fedcba9876543210fedcba98/model.safetensors";

/// config.json as served.
pub fn config() -> Vec<u8> {
    b"{\"model_type\": \"llama\", \"hidden_size\": 64}\n".to_vec()
}

/// model.safetensors as served (LFS): 200 kB of a pattern.
pub fn weights() -> Vec<u8> {
    (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect()
}

/// The honest bytes of a file of the model repository.
pub fn honest(file: &str) -> Option<Vec<u8>> {
    match file {
        "config.json" => Some(config()),
        "model.safetensors" => Some(weights()),
        _ => None,
    }
}

/// A non-LFS file's ETag (a stand-in for its git blob id).
pub fn git_etag(bytes: &[u8]) -> String {
    sha256(bytes)[..40].to_string()
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    pub host: String,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

impl Req {
    /// Range's first byte (0 without one).
    pub fn from(&self) -> usize {
        self.range
            .as_deref()
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .map_or(0, |n| n.parse().unwrap_or(0))
    }
}

/// How a body goes out.
pub enum Body {
    /// All of it.
    Bytes(Vec<u8>),
    /// The first n bytes, then the connection closes.
    Cut(Vec<u8>, usize),
    /// One byte per period.
    Drip(Vec<u8>, Duration),
}

/// An answer: a status line and headers (Content-Length only where given), a body; or
/// nothing at all for a while (`silent`).
pub struct Reply {
    pub status: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: Body,
    pub silent: Option<Duration>,
}

impl Reply {
    /// `status` with `headers` and `body`, its Content-Length added.
    pub fn new(status: &'static str, headers: Vec<(&'static str, String)>, body: Vec<u8>) -> Reply {
        let mut headers = headers;
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        {
            headers.push(("Content-Length", body.len().to_string()));
        }
        Reply {
            status,
            headers,
            body: Body::Bytes(body),
            silent: None,
        }
    }

    /// `status` with `headers` exactly as given and `body` sent as `Body` says.
    pub fn raw(status: &'static str, headers: Vec<(&'static str, String)>, body: Body) -> Reply {
        Reply {
            status,
            headers,
            body,
            silent: None,
        }
    }

    /// No answer for `d`, then the connection closes.
    pub fn silent(d: Duration) -> Reply {
        Reply {
            status: "",
            headers: vec![],
            body: Body::Bytes(vec![]),
            silent: Some(d),
        }
    }

    /// A Hub error with its X-Error-Code.
    pub fn error(status: &'static str, code: &str) -> Reply {
        let msg = format!("{code} (lying hub)");
        Reply::new(
            status,
            vec![
                ("X-Error-Code", code.to_string()),
                ("X-Error-Message", msg.clone()),
            ],
            msg.into_bytes(),
        )
    }
}

/// A test's lie: the answer to a request (the how-many-th with this method and path, from 0;
/// the server's port), or None for the honest one.
pub type Lie = Arc<dyn Fn(&Req, usize, u16) -> Option<Reply> + Send + Sync>;

/// The server's settings: its lie, and the token every request to 127.0.0.1 must carry (with
/// X-Error-Code GatedRepo, 401 without one, 403 with another).
#[derive(Clone)]
pub struct Liar {
    pub lie: Lie,
    pub token: Option<String>,
}

pub struct Server {
    pub port: u16,
    log: Arc<Mutex<Vec<Req>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(liar: Liar) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (log2, stop2) = (log.clone(), stop.clone());
        let counts = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(180);
            while !stop2.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((s, _)) => {
                        let (liar, log, counts) = (liar.clone(), log2.clone(), counts.clone());
                        std::thread::spawn(move || {
                            let _ = serve(s, port, &liar, &log, &counts);
                        });
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

fn serve(
    s: TcpStream,
    port: u16,
    liar: &Liar,
    log: &Mutex<Vec<Req>>,
    counts: &Mutex<BTreeMap<String, usize>>,
) -> std::io::Result<()> {
    let (method, path, headers) = crate::common::read_request_head(&s)?;
    let req = Req {
        method: method.clone(),
        host: headers.get("host").cloned().unwrap_or_default(),
        path: path.clone(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    log.lock().unwrap().push(req.clone());
    let n = {
        let mut c = counts.lock().unwrap();
        let e = c.entry(format!("{method} {path}")).or_insert(0);
        *e += 1;
        *e - 1
    };
    let reply = (liar.lie)(&req, n, port).unwrap_or_else(|| truthful(&req, port, liar));
    send(s, &reply, method == "HEAD")
}

fn send(mut out: TcpStream, r: &Reply, head: bool) -> std::io::Result<()> {
    if let Some(d) = r.silent {
        std::thread::sleep(d);
        return out.shutdown(std::net::Shutdown::Both);
    }
    let mut text = format!("HTTP/1.1 {}\r\nConnection: close\r\n", r.status);
    for (k, v) in &r.headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("\r\n");
    out.write_all(text.as_bytes())?;
    if !head {
        match &r.body {
            Body::Bytes(b) => out.write_all(b)?,
            Body::Cut(b, n) => {
                out.write_all(&b[..*n])?;
                out.flush()?;
                return out.shutdown(std::net::Shutdown::Both);
            }
            Body::Drip(b, every) => {
                for byte in b {
                    out.write_all(&[*byte])?;
                    out.flush()?;
                    std::thread::sleep(*every);
                }
            }
        }
    }
    out.flush()
}

/// The honest Hub.
fn truthful(req: &Req, port: u16, liar: &Liar) -> Reply {
    let path = req.path.as_str();
    // The CDN: LFS bytes by sha256, with Range.
    if let Some(tag) = path.strip_prefix("/cdn/") {
        let w = weights();
        if tag != sha256(&w) {
            return Reply::error("404 Not Found", "EntryNotFound");
        }
        return partial(&w, req);
    }
    if let Some(rest) = path.strip_prefix("/api/datasets/") {
        if !rest.starts_with(&format!("{DATASET}/revision/")) {
            return Reply::error("401 Unauthorized", "RepositoryNotFound");
        }
        let body = serde_json::json!({
            "id": DATASET, "sha": COMMIT, "siblings": [{"rfilename": "train.jsonl"}]
        });
        return Reply::new("200 OK", vec![], body.to_string().into_bytes());
    }
    let seg: Vec<&str> = path.splitn(5, '/').skip(1).collect();
    if seg.len() != 4 || seg[2] != "resolve" {
        return Reply::error("404 Not Found", "EntryNotFound");
    }
    if let Some(t) = &liar.token {
        let ok = req.auth.as_deref() == Some(&format!("Bearer {t}"));
        match (ok, req.auth.is_some()) {
            (true, _) => {}
            (false, false) => return Reply::error("401 Unauthorized", "GatedRepo"),
            (false, true) => return Reply::error("403 Forbidden", "GatedRepo"),
        }
    }
    if format!("{}/{}", seg[0], seg[1]) != REPO {
        return Reply::error("401 Unauthorized", "RepositoryNotFound");
    }
    let (rev, file) = seg[3].split_once('/').unwrap_or(("", ""));
    if rev != "main" && rev != COMMIT {
        return Reply::error("404 Not Found", "RevisionNotFound");
    }
    match file {
        "config.json" => {
            let c = config();
            Reply::new(
                "200 OK",
                vec![
                    ("X-Repo-Commit", COMMIT.to_string()),
                    ("ETag", format!("\"{}\"", git_etag(&c))),
                ],
                c,
            )
        }
        "model.safetensors" => lfs_redirect(&weights(), port),
        _ => Reply::error("404 Not Found", "EntryNotFound"),
    }
}

/// The Hub's answer for an LFS file: 302 to the CDN, its own ETag and length not the file's.
pub fn lfs_redirect(bytes: &[u8], port: u16) -> Reply {
    let tag = sha256(bytes);
    Reply::new(
        "302 Found",
        vec![
            ("X-Repo-Commit", COMMIT.to_string()),
            ("Location", format!("http://localhost:{port}/cdn/{tag}")),
            ("X-Linked-Etag", format!("\"{tag}\"")),
            ("X-Linked-Size", bytes.len().to_string()),
            ("ETag", "\"redirect-etag\"".into()),
        ],
        vec![],
    )
}

/// `bytes` from the request's Range on: 206 with Content-Range, or 200 without a Range.
pub fn partial(bytes: &[u8], req: &Req) -> Reply {
    let from = req.from().min(bytes.len());
    match req.range.is_some() {
        true => Reply::new(
            "206 Partial Content",
            vec![(
                "Content-Range",
                format!("bytes {from}-{}/{}", bytes.len() - 1, bytes.len()),
            )],
            bytes[from..].to_vec(),
        ),
        false => Reply::new("200 OK", vec![], bytes.to_vec()),
    }
}

// Lies, ready-made.

/// A lie told to `method` on `path` only (every time).
pub fn at(
    method: &'static str,
    path: &'static str,
    f: impl Fn(&Req, usize, u16) -> Reply + Send + Sync + 'static,
) -> Lie {
    Arc::new(move |r: &Req, n, port| (r.method == method && r.path == path).then(|| f(r, n, port)))
}

/// A lie told to the CDN's GETs.
pub fn cdn(f: impl Fn(&Req, usize, u16) -> Option<Reply> + Send + Sync + 'static) -> Lie {
    Arc::new(move |r: &Req, n, port| {
        (r.method == "GET" && r.path.starts_with("/cdn/"))
            .then(|| f(r, n, port))
            .flatten()
    })
}

pub fn s(x: &str) -> String {
    x.to_string()
}

pub fn commit_hdr() -> (&'static str, String) {
    ("X-Repo-Commit", COMMIT.to_string())
}

pub fn config_etag() -> (&'static str, String) {
    ("ETag", format!("\"{}\"", git_etag(&config())))
}

/// HEAD model.safetensors as the Hub answers it, with `f` applied to its headers.
pub fn weights_head(
    f: impl Fn(&mut Vec<(&'static str, String)>, u16) + Send + Sync + 'static,
) -> Lie {
    at("HEAD", WEIGHTS, move |_, _, port| {
        let mut r = lfs_redirect(&weights(), port);
        f(&mut r.headers, port);
        r
    })
}

pub fn set(h: &mut Vec<(&'static str, String)>, k: &'static str, v: String) {
    h.retain(|(x, _)| !x.eq_ignore_ascii_case(k));
    h.push((k, v));
}

/// A redirect of config.json's HEAD to `path` on `localhost` (another origin), 0 bytes long.
pub fn config_elsewhere(path: &'static str, served: Vec<u8>) -> Lie {
    Arc::new(move |r: &Req, _, port| {
        if r.path == CONFIG {
            return Some(Reply::new(
                "302 Found",
                vec![
                    commit_hdr(),
                    config_etag(),
                    ("Location", format!("http://localhost:{port}{path}")),
                ],
                vec![],
            ));
        }
        (r.path == path).then(|| Reply::new("200 OK", vec![], served.clone()))
    })
}

/// An index.json served at `main` (and the commit) with `body`.
pub fn index(body: &'static str) -> Lie {
    Arc::new(move |r: &Req, _, _| {
        r.path.ends_with("/model.safetensors.index.json").then(|| {
            Reply::new(
                "200 OK",
                vec![
                    commit_hdr(),
                    ("ETag", format!("\"{}\"", git_etag(body.as_bytes()))),
                ],
                body.as_bytes().to_vec(),
            )
        })
    })
}
