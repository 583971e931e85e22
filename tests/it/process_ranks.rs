//! CPU ranks as separate processes of the real binary, started through a launcher's
//! environment on loopback (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
//! Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID): the tiny recipe under ddp and fsdp ends
//! on the adapter that the same ranks as threads of one process give, to the bit (both sum the
//! ranks' gradients in rank order with the same function, so nothing may differ); a rank killed
//! mid-run ends every other rank with an error naming it, within seconds, leaves the last
//! checkpoint byte for byte as it was, and the run resumes from it to the unbroken run's
//! adapter; a rank that never comes ends the others after `parallel.timeout_s`.

use crate::common::{load_st, root, send_signal};
use candle_core::{DType, Device, Tensor};
use lora_train::parallel::cpu::CpuGroup;
use lora_train::parallel::launch;
use lora_train::parallel::tcp::TcpGroup;
use lora_train::parallel::Group;
use lora_train::train::Comm;
use lora_train::train::EnvRank;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The launcher's variables: a test's children get only the ones it sets.
const LAUNCHER_VARS: [&str; 11] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LORA_TRAIN_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
];

/// How a rank learns its place.
#[derive(Clone, Copy)]
enum Contract {
    Torchrun,
    Slurm,
}

/// A port no one listens on now (bound, read, released); the ranks meet on it as
/// MASTER_PORT + 1.
fn free_port() -> u16 {
    loop {
        let p = std::net::TcpListener::bind("0.0.0.0:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if p > 1024 {
            return p;
        }
    }
}

/// One test's directory: the run's output, the ranks' logs, a tokenized cache of its own.
struct Job {
    tmp: tempfile::TempDir,
}

impl Job {
    fn new() -> Job {
        Job {
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// The binary on the tiny recipe writing to `out`, with `sets`, and no launcher variable.
    fn cmd(&self, out: &str, sets: &[String], log: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lora-train"));
        c.current_dir(root())
            .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
            .arg(format!("output.dir={}", self.path(out).display()));
        for s in sets {
            c.args(["--set", s]);
        }
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        c.env("LORA_TRAIN_CACHE", self.path("cache"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(self.path(&format!("{log}.out"))).unwrap())
            .stderr(std::fs::File::create(self.path(&format!("{log}.err"))).unwrap());
        c
    }

    /// Rank `rank` of `world` as a process, meeting the others on loopback at `port`.
    fn rank(
        &self,
        how: Contract,
        rank: usize,
        world: usize,
        port: u16,
        out: &str,
        sets: &[String],
    ) -> Child {
        let mut c = self.cmd(out, sets, &format!("{out}-rank{rank}"));
        let (r, w, l) = match how {
            Contract::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            Contract::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        };
        c.env(r, rank.to_string())
            .env(w, world.to_string())
            .env(l, rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", (port - 1).to_string());
        c.spawn().unwrap()
    }

    /// Every rank of `world` started, each its own process.
    fn ranks(&self, how: Contract, world: usize, out: &str, sets: &[String]) -> Vec<Child> {
        let port = free_port();
        (0..world)
            .map(|r| self.rank(how, r, world, port, out, sets))
            .collect()
    }

    /// What rank `rank` of the run into `out` wrote to stderr.
    fn err(&self, out: &str, rank: usize) -> String {
        std::fs::read_to_string(self.path(&format!("{out}-rank{rank}.err"))).unwrap()
    }

    /// The run into `out` as `world` thread ranks of one process: the reference.
    fn threads(&self, world: usize, out: &str, sets: &[String]) {
        let devices: Vec<String> = (0..world).map(|d| d.to_string()).collect();
        let mut all = sets.to_vec();
        all.push(format!("parallel.devices=[{}]", devices.join(", ")));
        let log = format!("{out}-threads");
        let status = self.cmd(out, &all, &log).status().unwrap();
        let err = std::fs::read_to_string(self.path(&format!("{log}.err"))).unwrap();
        assert!(status.success(), "{out} as threads: {err}");
    }

    fn adapter(&self, out: &str) -> BTreeMap<String, Tensor> {
        load_st(&self.path(out).join("adapter_model.safetensors"))
            .into_iter()
            .collect()
    }
}

/// Waits for each child until `within` from now; kills and fails on one that outlives it.
fn wait_all(children: &mut [Child], within: Duration) -> Vec<ExitStatus> {
    let end = Instant::now() + within;
    let mut done: Vec<Option<ExitStatus>> = children.iter().map(|_| None).collect();
    while done.iter().any(Option::is_none) {
        for (c, d) in children.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                *d = c.try_wait().unwrap();
            }
        }
        if Instant::now() >= end && done.iter().any(Option::is_none) {
            for c in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("ranks still running {within:?} after the wait began: {done:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.into_iter().flatten().collect()
}

/// Bit for bit: same keys, same dtype, shape and bits.
fn assert_bits(what: &str, got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: adapter keys"
    );
    assert!(want.len() >= 4, "{what}: {} tensors", want.len());
    for (k, w) in want {
        let g = &got[k];
        assert_eq!((g.dtype(), g.dims()), (w.dtype(), w.dims()), "{what} {k}");
        let (g, w) = (
            g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let differ = g
            .iter()
            .zip(&w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what} {k}: {differ} of {} entries differ",
            w.len()
        );
    }
}

fn sets(strategy: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train.max_steps=6",
        "train.micro_batch=4",
        "train.log_every=1",
        "output.save_every=3",
        "parallel.timeout_s=60",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(format!("parallel.strategy={strategy}"));
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `world` processes (through `how`) against `world` threads: the same adapter to the bit,
/// the same losses, and the processes' checkpoints those of the threads.
fn processes_equal_threads(how: Contract, strategy: &str, world: usize) {
    let job = Job::new();
    let sets = sets(strategy, &[]);
    let mut ranks = job.ranks(how, world, "procs", &sets);
    let status = wait_all(&mut ranks, Duration::from_secs(240));
    for (r, s) in status.iter().enumerate() {
        assert!(s.success(), "rank {r}: {}", job.err("procs", r));
    }
    let lead = job.err("procs", 0);
    assert!(
        lead.contains(&format!(
            "{strategy} over {world} ranks (processes of a launcher's job"
        )),
        "{lead}"
    );
    job.threads(world, "threads", &sets);
    let what = format!("{strategy}: {world} processes vs {world} threads");
    assert_bits(&what, &job.adapter("procs"), &job.adapter("threads"));
    let ck = |out: &str| {
        load_st(&job.path(out).join("checkpoint-3/adapter_model.safetensors"))
            .into_iter()
            .collect::<BTreeMap<_, _>>()
    };
    assert_bits(&format!("{what}, step 3"), &ck("procs"), &ck("threads"));
    let losses = |out: &str| -> Vec<f64> {
        std::fs::read_to_string(job.path(out).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let l = losses("procs");
    assert_eq!(l.len(), 6, "rank 0 alone logs");
    assert_eq!(l, losses("threads"), "{what}");
    // Rank 0 alone writes and prints the run's summary; the others say who they were.
    let said = |r: usize| std::fs::read_to_string(job.path(&format!("procs-rank{r}.out"))).unwrap();
    assert!(said(0).starts_with("trained 6 steps in "), "{}", said(0));
    for r in 1..world {
        let want = format!(
            "rank {r} of {world}: trained 6 steps; rank 0 writes the adapter to {}\n",
            job.path("procs").display()
        );
        assert_eq!(said(r), want);
    }
}

#[test]
fn two_ddp_processes_through_torchrun_variables_equal_two_thread_ranks() {
    processes_equal_threads(Contract::Torchrun, "ddp", 2);
}

#[test]
fn two_fsdp_processes_through_torchrun_variables_equal_two_thread_ranks() {
    processes_equal_threads(Contract::Torchrun, "fsdp", 2);
}

#[test]
fn three_fsdp_processes_through_slurm_variables_equal_three_thread_ranks() {
    processes_equal_threads(Contract::Slurm, "fsdp", 3);
}

/// Every file under `dir`'s checkpoints, by path, with its bytes.
fn checkpoints(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut all = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("checkpoint-") {
            continue;
        }
        for f in std::fs::read_dir(e.path()).unwrap().flatten() {
            all.insert(f.path(), std::fs::read(f.path()).unwrap());
        }
    }
    all
}

/// Three ranks train a long run; once checkpoint-4 is there, rank `victim` is SIGKILLed.
/// The two others end within seconds with an error naming it; the checkpoints are as they
/// were; the run resumes from the last one to the adapter of a run that was never broken.
fn a_killed_rank_ends_the_others(victim: usize) {
    let job = Job::new();
    let world = 3;
    let sets = sets(
        "ddp",
        &[
            "train.max_steps=24",
            "train.log_every=4",
            "output.save_every=4",
            "parallel.timeout_s=300",
        ],
    );
    let mut ranks = job.ranks(Contract::Torchrun, world, "run", &sets);
    let out = job.path("run");
    let first = out.join("checkpoint-4");
    crate::common::wait_until("checkpoint-4", || {
        first.is_dir() || ranks.iter_mut().any(|c| c.try_wait().unwrap().is_some())
    });
    for (r, c) in ranks.iter_mut().enumerate() {
        let ended = c.try_wait().unwrap();
        assert!(
            ended.is_none(),
            "rank {r} ended before the kill: {}",
            job.err("run", r)
        );
    }
    let before = checkpoints(&out);
    send_signal(ranks[victim].id(), libc::SIGKILL);
    let t = Instant::now();
    let status = wait_all(&mut ranks, Duration::from_secs(60));
    let secs = t.elapsed().as_secs_f64();
    assert!(before.keys().any(|p| p.starts_with(&first)), "{before:?}");
    // Within seconds, though parallel.timeout_s is 300: the dead rank's socket closed.
    assert!(secs < 20.0, "the others ended {secs:.1} s after the kill");
    for r in (0..world).filter(|&r| r != victim) {
        let err = job.err("run", r);
        assert_eq!(status[r].code(), Some(1), "rank {r}: {err}");
        let want = format!(
            "rank {victim} of {world} failed: rank {victim}'s process ended without a word"
        );
        assert!(err.contains(&want), "rank {r}: {err}");
        assert!(err.contains("it was killed (SIGKILL"), "rank {r}: {err}");
    }
    // The checkpoints written before the kill are untouched; any written after it is whole.
    let after = checkpoints(&out);
    for (p, bytes) in &before {
        assert!(after.get(p) == Some(bytes), "{} changed", p.display());
    }
    let last = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("checkpoint-")?.parse::<usize>().ok()
        })
        .max()
        .unwrap();
    if victim != 0 {
        let lead = job.err("run", 0);
        let named = format!(
            "the last complete checkpoint is {}",
            out.join(format!("checkpoint-{last}")).display()
        );
        assert!(lead.contains(&named), "{lead}");
    }

    // Resumed by every rank, it ends where an unbroken run ends.
    let short: Vec<String> = sets
        .iter()
        .cloned()
        .chain(["train.resume=true".to_string()])
        .collect();
    let mut again = job.ranks(Contract::Torchrun, world, "run", &short);
    let status = wait_all(&mut again, Duration::from_secs(600));
    for (r, s) in status.iter().enumerate() {
        assert!(s.success(), "resumed rank {r}: {}", job.err("run", r));
    }
    let lead = job.err("run", 0);
    assert!(
        lead.contains(&format!(
            "resuming from {}",
            out.join(format!("checkpoint-{last}")).display()
        )),
        "{lead}"
    );
    job.threads(world, "unbroken", &sets);
    let what = format!("killed rank {victim}, resumed from step {last}, vs unbroken threads");
    assert_bits(&what, &job.adapter("run"), &job.adapter("unbroken"));
}

#[test]
fn a_rank_killed_mid_run_ends_every_other_rank_and_the_run_resumes() {
    a_killed_rank_ends_the_others(1);
}

#[test]
fn rank_zero_killed_mid_run_ends_every_other_rank_and_the_run_resumes() {
    a_killed_rank_ends_the_others(0);
}

#[test]
fn a_rank_that_never_comes_ends_the_others_after_the_timeout() {
    let job = Job::new();
    let sets = sets("ddp", &["parallel.timeout_s=3"]);
    // Rank 0 of 2 alone: it names the rank that never connected.
    let port = free_port();
    let t = Instant::now();
    let mut zero = vec![job.rank(Contract::Torchrun, 0, 2, port, "a", &sets)];
    let status = wait_all(&mut zero, Duration::from_secs(30));
    let secs = t.elapsed().as_secs_f64();
    let err = job.err("a", 0);
    assert_eq!(status[0].code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "rank 0 waited 3 s on port {port} for rank(s) [1], which never connected"
        )),
        "{err}"
    );
    assert!((3.0..15.0).contains(&secs), "{secs:.1} s");
    assert!(!job.path("a").exists(), "nothing written: {err}");
    // Rank 1 of 2 alone: rank 0 cannot be reached.
    let port = free_port();
    let t = Instant::now();
    let mut one = vec![job.rank(Contract::Torchrun, 1, 2, port, "b", &sets)];
    let status = wait_all(&mut one, Duration::from_secs(30));
    let secs = t.elapsed().as_secs_f64();
    let err = job.err("b", 1);
    assert_eq!(status[0].code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "rank 1 cannot reach rank 0 at 127.0.0.1:{port} (MASTER_ADDR 127.0.0.1"
        )),
        "{err}"
    );
    assert!((3.0..15.0).contains(&secs), "{secs:.1} s");
}

/// Runs `body` as each of `world` TCP ranks of this process (a thread each, meeting on
/// loopback): their results, rank order.
fn tcp_ranks<T: Send + 'static>(
    world: usize,
    body: impl Fn(usize, Box<dyn Comm>) -> anyhow::Result<T> + Send + Sync + 'static,
) -> Vec<anyhow::Result<T>> {
    let port = free_port();
    let body = std::sync::Arc::new(body);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                let e = EnvRank {
                    rank,
                    world,
                    local: rank,
                    addr: "127.0.0.1".into(),
                    port,
                };
                let group: std::sync::Arc<dyn Group> =
                    TcpGroup::connect(&e, Duration::from_secs(20))?;
                launch::process(group, rank, |comm| body(rank, comm))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// A tensor's dtype, dims and bits (through f64, exact for f32, bf16 and u8).
type Bits = (DType, Vec<usize>, Vec<u64>);

fn bits(t: &Tensor) -> Bits {
    let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
    let v = v
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    (t.dtype(), t.dims().to_vec(), v)
}

/// Every collective once, in f32, bf16 and u8: what each rank got.
fn every_collective(rank: usize, c: Box<dyn Comm>) -> anyhow::Result<Vec<Bits>> {
    let dev = Device::Cpu;
    let r = rank as f32;
    let x = Tensor::new(&[0.1f32 + r, 1e-8 * (r + 1.0), -3.0 / (r + 1.0)], &dev)?;
    let h = x.to_dtype(DType::BF16)?;
    let b = Tensor::new(&[rank as u8, 7], &dev)?;
    let got = [
        c.all_reduce_sum(&x)?,
        c.all_reduce_sum(&h)?,
        c.all_gather(&x.reshape((3, 1))?)?,
        c.all_gather(&b)?,
        c.broadcast(&x, 0)?,
        c.broadcast(&h, c.world() - 1)?,
    ];
    c.barrier()?;
    Ok(got.iter().map(bits).collect())
}

#[test]
fn tcp_collectives_give_every_rank_the_thread_ranks_bits() {
    for world in [2, 3] {
        let tcp: Vec<_> = tcp_ranks(world, every_collective)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let per_rank = std::sync::Mutex::new(vec![Vec::new(); world]);
        let per_rank = std::sync::Arc::new(per_rank);
        let sink = per_rank.clone();
        let body = move |rank: usize, c: Box<dyn Comm>| {
            sink.lock().unwrap()[rank] = every_collective(rank, c)?;
            Ok(())
        };
        let group = CpuGroup::new(world, Duration::from_secs(20));
        launch::threads(group, std::sync::Arc::new(body), Duration::from_secs(5)).unwrap();
        let threads = per_rank.lock().unwrap().clone();
        assert_eq!(tcp, threads, "{world} ranks");
        // Every rank got the same result, and the sum is rank order's.
        assert!(tcp.iter().all(|r| r == &tcp[0]));
        let sum: Vec<f32> = tcp[0][0]
            .2
            .iter()
            .map(|&b| f64::from_bits(b) as f32)
            .collect();
        let mut want = [0f32; 3];
        for r in 0..world {
            let v = r as f32;
            for (w, x) in want
                .iter_mut()
                .zip([0.1f32 + v, 1e-8 * (v + 1.0), -3.0 / (v + 1.0)])
            {
                *w += x;
            }
        }
        assert_eq!(sum, want);
    }
}

#[test]
fn a_tcp_rank_that_fails_ends_the_others_with_its_error() {
    let t = Instant::now();
    let res = tcp_ranks(3, |rank, c: Box<dyn Comm>| {
        let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        c.all_reduce_sum(&x)?;
        if rank == 2 {
            anyhow::bail!("train.jsonl:5: bad row");
        }
        c.all_reduce_sum(&x)?;
        Ok(())
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let errs: Vec<String> = res
        .into_iter()
        .map(|r| format!("{:#}", r.unwrap_err()))
        .collect();
    assert_eq!(errs[2], "rank 2 of 3 failed: train.jsonl:5: bad row");
    for e in &errs[..2] {
        assert_eq!(e, "rank 2 of 3 failed: train.jsonl:5: bad row");
    }
}

#[test]
fn one_launchers_variables_are_read_whole() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    // torchrun's set wins over Slurm's (torchrun started by srun), never mixed with it.
    let both = env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "3"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]);
    let e = EnvRank::from_env(&both).unwrap().unwrap();
    assert_eq!((e.rank, e.world, e.local, e.port), (1, 2, 0, 29501));
    let half = env(&[("RANK", "1"), ("SLURM_NTASKS", "8"), ("MASTER_ADDR", "n")]);
    let err = EnvRank::from_env(&half).unwrap_err().to_string();
    assert_eq!(
        err,
        "environment: RANK is set but WORLD_SIZE is not: set both"
    );
    let slurm = env(&[
        ("SLURM_PROCID", "8"),
        ("SLURM_NTASKS", "8"),
        ("MASTER_ADDR", "n"),
        ("MASTER_PORT", "1"),
    ]);
    let err = EnvRank::from_env(&slurm).unwrap_err().to_string();
    assert_eq!(
        err,
        "environment: SLURM_PROCID = 8 but SLURM_NTASKS = 8: a rank is 0..SLURM_NTASKS"
    );
    let port = env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("MASTER_ADDR", "n"),
        ("MASTER_PORT", "65535"),
    ]);
    let err = format!("{:#}", EnvRank::from_env(&port).unwrap_err());
    assert_eq!(
        err,
        "port 65536 (MASTER_PORT + 1, or LORA_TRAIN_PORT) is out of range 1..65535"
    );
}

#[test]
fn ranks_started_with_other_world_sizes_refuse_each_other_at_once() {
    let port = free_port();
    let t = Instant::now();
    let joined: Vec<_> = [(0, 2), (1, 3)]
        .into_iter()
        .map(|(rank, world)| {
            std::thread::spawn(move || {
                let e = EnvRank {
                    rank,
                    world,
                    local: 0,
                    addr: "127.0.0.1".into(),
                    port,
                };
                TcpGroup::connect(&e, Duration::from_secs(30)).map(|_| ())
            })
        })
        .collect();
    let errs: Vec<String> = joined
        .into_iter()
        .map(|j| format!("{:#}", j.join().unwrap().unwrap_err()))
        .collect();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(
        errs[0],
        "rank 1 was started with WORLD_SIZE = 3, rank 0 with 2: the launcher's variables differ between nodes"
    );
    assert_eq!(
        errs[1],
        format!("rank 1: rank 0 at 127.0.0.1:{port} closed the connection before the run began: rank 0's error says why")
    );
}

#[test]
fn ranks_that_see_another_checkpoint_than_rank_zero_refuse_to_resume() {
    // Rank 0 resumes from its checkpoint; rank 1's output.dir (a node without the shared
    // filesystem) holds none: every rank refuses, naming what differs.
    let job = Job::new();
    let first = sets("ddp", &[]);
    let mut ranks = job.ranks(Contract::Torchrun, 2, "a", &first);
    let status = wait_all(&mut ranks, Duration::from_secs(120));
    assert!(
        status.iter().all(ExitStatus::success),
        "{}",
        job.err("a", 0)
    );
    let again = sets("ddp", &["train.resume=true"]);
    let port = free_port();
    let mut ranks = vec![
        job.rank(Contract::Torchrun, 0, 2, port, "a", &again),
        job.rank(Contract::Torchrun, 1, 2, port, "b", &again),
    ];
    let status = wait_all(&mut ranks, Duration::from_secs(120));
    // Both find the difference; each reports the first failure it heard of (its own or the
    // other's), which names the output.dir of the rank that said it.
    let want = |out: &str| {
        format!(
            "rank 1 starts fresh but rank 0 resumes from step 6 (output.dir {}): every rank reads \
             the checkpoint that rank 0 wrote, so output.dir must be on a filesystem every node \
             shares, at the same path",
            job.path(out).display()
        )
    };
    for (r, out) in [(0, "a"), (1, "b")] {
        let err = job.err(out, r);
        assert_eq!(status[r].code(), Some(1), "rank {r}: {err}");
        assert!(
            err.contains(&want("a")) || err.contains(&want("b")),
            "rank {r}: {err}"
        );
    }
    // Rank 0's checkpoint is still there; rank 1 wrote nothing.
    assert!(job.path("a").join("checkpoint-6").is_dir());
    assert!(!job.path("b").exists());
}
