//! Starting the ranks: threads of this process (one per device; CPU "devices" are virtual
//! ranks), or one process per rank started by torchrun / mpirun / Slurm (`process`; its place in
//! the job: `train::EnvRank`).
//!
//! A rank that fails aborts its group, so every other rank's collectives fail at once; the run
//! then reports the first failing rank's error (rank number + its error chain).

use super::{CommError, Group};
use crate::train::Comm;
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
            _ => CommError::Failed { rank, world, why }.into(),
        });
    }
    match results.into_iter().next().flatten() {
        Some(res) => res,
        None => bail!("rank 0 ended without a result"),
    }
}

/// Runs `body` as rank `rank` of `group`, whose other ranks are other processes: its
/// result when it succeeded (the others then learn that it ended); else the group is aborted
/// with its error (the others' collectives fail at once) and the run's first failure is
/// returned, naming its rank: this rank's own error, or another rank's as this one heard it.
pub fn process<T>(
    group: Arc<dyn Group>,
    rank: usize,
    body: impl FnOnce(Box<dyn Comm>) -> Result<T>,
) -> Result<T> {
    let world = group.world();
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let comm = group.clone().comm(rank)?;
        body(comm)
    }));
    let res = run.unwrap_or_else(|p| Err(anyhow!("panicked: {}", crate::util::panic_message(&*p))));
    match res {
        Ok(v) => {
            group.ended(rank);
            Ok(v)
        }
        Err(e) => {
            group.abort(rank, &format!("{e:#}"));
            Err(match group.failure() {
                Some((r, why)) if r != rank => CommError::Failed {
                    rank: r,
                    world,
                    why,
                }
                .into(),
                _ => e.context(format!("rank {rank} of {world} failed")),
            })
        }
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
