use candle_core::{DType, Device, Tensor};
use lora_train::recipe::Recipe;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The repository root: the build's, or LORA_TRAIN_ROOT when the test binary was built on
/// another machine (the GPU runs carry a prebuilt test binary to the device).
pub fn root() -> PathBuf {
    std::env::var_os("LORA_TRAIN_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The entries of a tensor, as f32 on the host.
pub fn host_f32(t: &Tensor) -> Vec<f32> {
    let t = t
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// max |a − b| over all entries.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// ‖got − want‖₂ / ‖want‖₂ ≤ tol: for bf16 runs, where elementwise bounds are meaningless.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn assert_rel_l2(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    let rel = rel_l2(what, got, want);
    if rel > tol / 2.0 {
        eprintln!("{what}: relative L2 error {rel:.3e}, over half the tolerance {tol:.1e}");
    }
    assert!(
        rel <= tol,
        "{what}: relative L2 error {rel:.3e} > {tol:.1e}"
    );
}

/// ‖got − want‖ / ‖want‖ over all entries (f64 sums).
pub fn rel_l2(what: &str, got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (host_f32(got), host_f32(want));
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let num = norm(&mut g.iter().zip(&w).map(|(a, b)| (*a - *b) as f64));
    let den = norm(&mut w.iter().map(|&b| b as f64));
    num / den.max(1e-30)
}

pub fn golden_dir(case: &str) -> PathBuf {
    root().join("tests/fixtures/golden").join(case)
}

pub fn load_st(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// |got − want| ≤ rtol·|want| + atol·max|want| elementwise (atol relative to the tensor's scale,
/// for entries that are near zero), with the worst offender in the message.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (host_f32(got), host_f32(want));
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let mut worst = (0usize, 0f64);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let err = (*a as f64 - *b as f64).abs();
        let tol = rtol * (*b as f64).abs() + atol * scale;
        let ratio = err / tol.max(f64::MIN_POSITIVE);
        assert!(a.is_finite(), "{what}: non-finite value at {i}");
        if ratio > worst.1 {
            worst = (i, ratio);
        }
    }
    let i = worst.0;
    if std::env::var_os("GOLDEN_REPORT").is_some() {
        // the worst element's error as a fraction of its tolerance, and of |want|
        let rel = (g[i] as f64 - w[i] as f64).abs() / (w[i] as f64).abs().max(1e-30);
        eprintln!(
            "{what}: {:.3} of the tolerance, relative error {rel:.2e}",
            worst.1
        );
    }
    assert!(
        worst.1 <= 1.0,
        "{what}: element {i}: got {} want {} (error {:.3}x the tolerance rtol {rtol} atol {atol}·{scale:.3e})",
        g[i],
        w[i],
        worst.1
    );
}

/// Writes a recipe into `dir` and loads it.
pub fn recipe(dir: &Path, text: &str, sets: &[&str]) -> Recipe {
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Recipe::load(&p, &sets).unwrap()
}

/// A training session on a golden case's recipe (`golden_recipe`) with `sets` applied; the
/// directory holding its recipe and output lives as long as the returned guard.
pub fn golden_session(case: &str, sets: &[&str]) -> (tempfile::TempDir, Session) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = recipe(tmp.path(), &golden_recipe(case, &out), sets);
    let s = Session::new(r).unwrap();
    (tmp, s)
}

/// A recipe training a golden case's model from its init adapter on its train.jsonl,
/// with the optimiser settings of scripts/reference_peft.py.
pub fn golden_recipe(case: &str, out: &Path) -> String {
    let d = golden_dir(case);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("meta.json")).unwrap()).unwrap();
    let model = d.join(meta["model_dir"].as_str().unwrap());
    let o = &meta["opt"];
    format!(
        r#"
[model]
path = "{model}"
dtype = "f32"
[lora]
init_adapter = "{adapter}"
[data]
train = "{train}"
format = "tokens"
seq_len = 64
shuffle = false
[train]
micro_batch = {mb}
max_steps = {steps}
lr = {lr}
betas = [{b1}, {b2}]
eps = {eps}
weight_decay = {wd}
max_grad_norm = {clip}
schedule = "{sched}"
warmup_steps = {warm}
[output]
dir = "{out}"
"#,
        model = model.display(),
        adapter = d.join("init_adapter").display(),
        train = d.join("train.jsonl").display(),
        mb = o["micro_batch"],
        steps = o["steps"],
        lr = o["lr"],
        b1 = o["betas"][0],
        b2 = o["betas"][1],
        eps = o["eps"],
        wd = o["weight_decay"],
        clip = o["max_grad_norm"],
        sched = o["schedule"].as_str().unwrap(),
        warm = o["warmup_steps"],
        out = out.display(),
    )
}

/// Standard normal entries of shape `dims`, drawn on the CPU (so the same values whatever
/// `dev`), rounded to bf16 and put on `dev`.
#[cfg(feature = "cuda")]
pub fn randn_bf16(dims: &[usize], dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1.0, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// Fails the calling test unless this machine has at least `n` CUDA GPUs: a test that needs
/// them never passes without running (the GPU check runs it where they are).
#[cfg(feature = "cuda")]
pub fn need_gpus(n: usize, test: &str) {
    let count = candle_core::cuda::cudarc::driver::CudaContext::device_count().unwrap_or(0);
    assert!(
        count as usize >= n,
        "{test} needs {n} GPUs, this machine has {count}: run it where there are {n} (scripts/device_gpu_check.sh peercopy)"
    );
}

/// A copy of the directory tree `from` at `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// An HTTP/1.1 request's head read from a test server's connection: (method, path, headers
/// by lower-case name).
pub fn read_request_head(
    s: &std::net::TcpStream,
) -> std::io::Result<(String, String, std::collections::BTreeMap<String, String>)> {
    use std::io::BufRead;
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let mut reader = std::io::BufReader::new(s.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = std::collections::BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Ok((method, path, headers))
}

/// LoRA rank 8, alpha 16 on every linear, no dropout: the adapters of the GPU model tests.
#[cfg(feature = "cuda")]
pub fn all_linear_r8() -> lora_train::lora::LoraSpec {
    lora_train::lora::LoraSpec {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        rslora: false,
        dora: false,
        targets: lora_train::model::ALL_LINEAR
            .iter()
            .map(|s| s.to_string())
            .collect(),
    }
}

/// A pipe: (read end, write end), both close-on-exec (std's `io::pipe` is newer than our MSRV).
pub fn pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array we pass.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned by nothing else.
    unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    }
}

/// Fills the pipe that `w` writes into until one more byte would block, through a second,
/// non-blocking open of it (`w`'s own descriptor, a child's stdout or stderr, keeps blocking):
/// the next write of its writer waits until the reader reads. The filler is newlines.
pub fn fill_pipe(w: &impl std::os::fd::AsRawFd) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", w.as_raw_fd()))
        .unwrap();
    for chunk in [4096, 1] {
        loop {
            match f.write(&vec![b'\n'; chunk]) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling a pipe: {e}"),
            }
        }
    }
}

/// A child whose stderr is a full pipe: it stops at its first line to stderr, holding what it
/// holds by then, until `finish` reads.
pub struct Blocked {
    pub child: std::process::Child,
    reader: std::fs::File,
}

impl Blocked {
    /// Spawns `cmd` (stdout discarded) with its stderr a full pipe.
    pub fn spawn(mut cmd: std::process::Command) -> Blocked {
        let (reader, w) = pipe();
        fill_pipe(&w);
        let child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(w)
            .spawn()
            .unwrap();
        // `cmd` held our copy of the write end: without it, the reader sees the end.
        drop(cmd);
        Blocked { child, reader }
    }

    /// Reads the pipe to its end (the filler dropped) and waits for the child.
    pub fn finish(mut self) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let mut bytes = Vec::new();
        self.reader.read_to_end(&mut bytes).unwrap();
        let status = self.child.wait().unwrap();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
        (status, lines.join("\n"))
    }
}

/// Waits until `what` holds (checked every 5 ms); a test's deadline of 60 s, not a timing.
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "waited 60 s for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Sends `sig` to process `pid` (a child of this test, not yet reaped).
pub fn send_signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

/// A one-rank training session with its data, as `train` makes them (the library keeps the
/// rank's session and the data apart: bench and probe have no data set).
pub struct Session {
    pub s: lora_train::train::Session,
    pub d: lora_train::train::TrainData,
}

impl std::ops::Deref for Session {
    type Target = lora_train::train::Session;
    fn deref(&self) -> &Self::Target {
        &self.s
    }
}

impl std::ops::DerefMut for Session {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.s
    }
}

impl Session {
    /// The recipe resolved, its model loaded on its first device, its data read.
    pub fn new(r: Recipe) -> anyhow::Result<Session> {
        let s = lora_train::train::Session::new(r)?;
        let d = lora_train::train::TrainData::load(&s)?;
        Ok(Session { s, d })
    }

    /// Rank `comm.rank()`'s session on device `ordinal`.
    pub fn for_rank(
        r: Recipe,
        comm: Box<dyn lora_train::train::Comm>,
        ordinal: usize,
    ) -> anyhow::Result<Session> {
        use lora_train::{run::Machine, train::RunConfig};
        let run = std::sync::Arc::new(RunConfig::resolve(r, Machine::Open)?);
        let s = lora_train::train::Session::load(run, comm, ordinal)?;
        let d = lora_train::train::TrainData::load(&s)?;
        Ok(Session { s, d })
    }

    pub fn batch(&self, rows: &[Vec<usize>]) -> lora_train::data::Batch {
        self.d.batch(rows).unwrap()
    }

    pub fn train(&self, out: &Path) -> anyhow::Result<lora_train::run::RunSummary> {
        self.s.train(&self.d, out)
    }

    pub fn train_from(
        &self,
        out: &Path,
        resume: Option<&lora_train::run::checkpoint::Checkpoint>,
        stop: &dyn Fn(usize) -> bool,
    ) -> anyhow::Result<lora_train::run::RunSummary> {
        self.s.train_from(&self.d, out, resume, stop)
    }

    pub fn eval_loss(&self) -> anyhow::Result<Option<(f64, usize)>> {
        self.d.eval_loss(&self.s)
    }

    pub fn steps_from(
        &self,
        c: lora_train::train::train_data::Cursor,
    ) -> anyhow::Result<lora_train::train::train_data::Steps<'_>> {
        self.d.steps_from(c)
    }
}

/// A model of random weights as `Model::random_with` builds it, from the values a `Build`
/// holds (the tests' shorthand).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // its callers are CUDA tests
pub fn random_model(
    cfg: lora_train::model::ModelConfig,
    dtype: DType,
    dev: &Device,
    spec: &lora_train::lora::LoraSpec,
    seed: u64,
    kernels: &lora_train::ops::Kernels,
    loaded: lora_train::model::decoder::Loaded,
) -> anyhow::Result<lora_train::model::Model> {
    let mut b = lora_train::model::Build::new(cfg, dtype, dev, spec, seed)?;
    b.kernels = *kernels;
    lora_train::model::Model::random_with(&b, loaded)
}
