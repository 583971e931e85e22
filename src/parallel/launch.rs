//! Starting the ranks: threads of this process (one per device; CPU "devices" are virtual
//! ranks), or one process per rank started by torchrun / mpirun / Slurm (`EnvRank`).
//!
//! A rank that fails aborts its group, so every other rank's collectives fail at once; the run
//! then reports the first failing rank's error (rank number + its error chain).

use super::{Comm, Group};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's body: (rank, its comm) → its result. Rank 0's result is the run's.
pub(crate) type Body<T> = dyn Fn(usize, Box<dyn Comm>) -> Result<T> + Send + Sync;

/// Runs `body` on `group.world()` threads, rank r on thread r, each with the comm the group
/// makes for it on that thread. Returns rank 0's result when every rank succeeded; else the
/// first failure, with the failing rank's number. A rank that neither returns nor joins the
/// others' collectives is waited for at most `grace` after the first failure.
pub fn threads<T: Send + 'static>(
    group: Arc<dyn Group>,
    body: Arc<Body<T>>,
    grace: Duration,
) -> Result<T> {
    let world = group.world();
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    for rank in 0..world {
        let (group, body, tx) = (group.clone(), body.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let comm = group.clone().comm(rank)?;
                    body(rank, comm)
                }));
                let res = run.unwrap_or_else(|p| {
                    Err(anyhow!("panicked: {}", crate::util::panic_message(&*p)))
                });
                match &res {
                    Err(e) => group.abort(rank, &format!("{e:#}")),
                    Ok(_) => group.ended(rank),
                }
                // The launcher may have stopped listening (it gave up on a stuck rank).
                let _ = tx.send((rank, res));
            })
            .with_context(|| format!("cannot start the thread of rank {rank}"))?;
    }
    drop(tx);
    let mut results: Vec<Option<Result<T>>> = (0..world).map(|_| None).collect();
    let mut give_up: Option<Instant> = None;
    let mut left = world;
    while left > 0 {
        let wait = match give_up {
            Some(at) => at.saturating_duration_since(Instant::now()),
            None => Duration::from_millis(200),
        };
        match rx.recv_timeout(wait) {
            Ok((rank, res)) => {
                results[rank] = Some(res);
                left -= 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout)
                if give_up.is_some_and(|at| Instant::now() >= at) =>
            {
                break
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if give_up.is_none() && group.failure().is_some() {
            give_up = Some(Instant::now() + grace);
        }
    }
    if let Some((rank, why)) = group.failure() {
        return Err(match results.get_mut(rank).and_then(Option::take) {
            Some(Err(e)) => e.context(format!("rank {rank} of {world} failed")),
            _ => anyhow!("rank {rank} of {world} failed: {why}"),
        });
    }
    match results.into_iter().next().flatten() {
        Some(res) => res,
        None => bail!("rank 0 ended without a result"),
    }
}

/// This process's place in a multi-process run, from the launcher's environment:
/// torchrun / mpirun-style RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or Slurm's
/// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (with MASTER_ADDR / MASTER_PORT set by the job).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvRank {
    /// This process's rank (RANK, SLURM_PROCID).
    pub rank: usize,
    /// Ranks in the job (WORLD_SIZE, SLURM_NTASKS).
    pub world: usize,
    /// The rank among this host's ranks: the CUDA ordinal it uses.
    pub local: usize,
    /// Rank 0's host and the port of our id exchange: MASTER_PORT + 1 (torchrun's own
    /// rendezvous store listens on MASTER_PORT itself), or LORA_TRAIN_PORT.
    pub addr: String,
    /// The port of the id exchange (see `addr`).
    pub port: u16,
}

impl EnvRank {
    /// None when no launcher variables are set (or WORLD_SIZE is 1).
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<EnvRank>> {
        let pick = |a: &str, b: &str| get(a).or_else(|| get(b));
        let num = |name: &str, v: String| -> Result<usize> {
            v.trim()
                .parse()
                .with_context(|| format!("environment variable {name} = {v:?} is not a number"))
        };
        let (Some(rank), Some(world)) = (
            pick("RANK", "SLURM_PROCID"),
            pick("WORLD_SIZE", "SLURM_NTASKS"),
        ) else {
            return Ok(None);
        };
        // The variables read, as the messages name them (torchrun's, else Slurm's).
        let name = |a: &'static str, b: &'static str| if get(a).is_some() { a } else { b };
        let (rank_var, world_var) = (
            name("RANK", "SLURM_PROCID"),
            name("WORLD_SIZE", "SLURM_NTASKS"),
        );
        let (rank, world) = (num(rank_var, rank)?, num(world_var, world)?);
        if world <= 1 {
            return Ok(None);
        }
        if rank >= world {
            bail!("environment: {rank_var} = {rank} but {world_var} = {world}");
        }
        let local = match pick("LOCAL_RANK", "SLURM_LOCALID") {
            Some(v) => num(name("LOCAL_RANK", "SLURM_LOCALID"), v)?,
            None => 0,
        };
        let slurm = match world_var {
            "SLURM_NTASKS" => " (in an sbatch script: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500; README, \"Several GPUs\")",
            _ => "",
        };
        let addr = get("MASTER_ADDR").with_context(|| {
            format!("{world_var} = {world} ({rank_var} = {rank}) but MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host>{slurm}")
        })?;
        let port = match get("LORA_TRAIN_PORT") {
            Some(p) => num("LORA_TRAIN_PORT", p)?,
            None => {
                let p = get("MASTER_PORT").with_context(|| {
                    format!("{world_var} = {world} ({rank_var} = {rank}) but MASTER_PORT is not set: export MASTER_PORT=<a free port>{slurm}")
                })?;
                num("MASTER_PORT", p)? + 1
            }
        };
        let port = u16::try_from(port).map_err(|_| anyhow!("port {port} is out of range"))?;
        Ok(Some(EnvRank {
            rank,
            world,
            local,
            addr,
            port,
        }))
    }
}

/// Rank 0 hands `payload` (e.g. the NCCL unique id) to ranks 1..world over TCP: it listens on
/// `addr:port` until every other rank has fetched it; the others retry connecting until
/// `timeout`. Returns the payload on every rank.
pub fn share(
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let Some(payload) = payload else {
            bail!("rank 0 has nothing to share");
        };
        let listener = TcpListener::bind(("0.0.0.0", port))
            .with_context(|| format!("rank 0 cannot listen on port {port} (MASTER_PORT + 1, or LORA_TRAIN_PORT): is it taken?"))?;
        listener.set_nonblocking(true)?;
        let mut served = 0;
        while served + 1 < world {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.write_all(&(payload.len() as u32).to_le_bytes())?;
                    s.write_all(payload)?;
                    served += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        bail!(
                            "rank 0: only {served} of {} ranks connected to port {port} within {} s",
                            world - 1,
                            timeout.as_secs()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).context("rank 0: accepting a rank"),
            }
        }
        return Ok(payload.to_vec());
    }
    let target = (addr, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve MASTER_ADDR {addr}"))?
        .next()
        .with_context(|| format!("MASTER_ADDR {addr} has no address"))?;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
            Ok(mut s) => {
                s.set_read_timeout(Some(timeout))?;
                let mut n = [0u8; 4];
                s.read_exact(&mut n)?;
                let mut buf = vec![0u8; u32::from_le_bytes(n) as usize];
                s.read_exact(&mut buf)
                    .with_context(|| format!("rank {rank}: reading the id from {target}"))?;
                return Ok(buf);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "rank {rank}: cannot reach rank 0 at {target} within {} s",
                        timeout.as_secs()
                    )
                })
            }
        }
    }
}
