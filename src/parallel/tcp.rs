//! Communicator of ranks that are processes, over TCP: CPU ranks that torchrun, Slurm or
//! mpirun started (`train::EnvRank`), on one host or many.
//!
//! defines: TcpGroup (this process's rank: its connections and the failures it has seen),
//! TcpComm (its `Comm`).
//!
//! A star through rank 0. Rank 0 listens on the job's port (`EnvRank::port`: MASTER_PORT + 1,
//! or LORA_TRAIN_PORT) on every interface; every other rank connects to MASTER_ADDR there and
//! says who it is, and the group starts once rank 0 has heard every rank. In a collective each
//! rank sends its tensor to rank 0 (`wire`), which combines the parts in rank order with the
//! thread ranks' own functions (`cpu::sum`, `cpu::concat`, `cpu::root`) and sends the result
//! back: every rank gets the bits that thread ranks of one process get.
//!
//! A thread per connection reads frames as they come, so a rank that dies (its socket
//! closes), fails (an Abort frame, which rank 0 forwards to every rank) or finishes (Bye) is
//! known at once wherever the others wait. Waits are bounded: rank 0 waits
//! `parallel.timeout_s` for the parts of a collective and names the ranks missing; the
//! others wait twice that for rank 0's answer (rank 0 times out first when another rank is
//! missing, and tells them), and `STOP_GRACE` after a stop signal.

use super::wire::{self, Frame, Op, Wire};
use super::{CommError, Group};
use crate::train::Comm;
use crate::train::EnvRank;
use crate::util::signal::STOP_GRACE;
use anyhow::{bail, Context};
use candle_core::{Result, Tensor};
use std::collections::VecDeque;
use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank looks at the clock and the stop signal.
const POLL: Duration = Duration::from_millis(100);
/// How long a connecting process has to say who it is.
const HELLO_WAIT: Duration = Duration::from_secs(10);

/// What the reader threads have seen, under the group's lock.
struct State {
    /// Collective frames not yet taken, by sender: rank 0 holds each other rank's parts;
    /// another rank holds rank 0's results at index 0.
    inbox: Vec<VecDeque<Frame>>,
    /// The first failure: (rank, its error chain).
    failure: Option<(usize, String)>,
    /// Ranks that said their run is over (and this rank, once its own is).
    ended: Vec<bool>,
    /// This rank is closing its connections: their ends are nobody's failure.
    closing: bool,
}

/// What the rank's threads share: its connections and what came through them.
struct Shared {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// How long a collective still waits once a stop signal has come.
    stop_grace: Duration,
    /// The write ends: on rank 0 one per other rank (index = rank); elsewhere rank 0's at 0.
    links: Vec<Option<Mutex<TcpStream>>>,
    /// The next collective's number (every rank counts the same).
    seq: AtomicU64,
    state: Mutex<State>,
    wake: Condvar,
    /// Held while a failure is recorded and told to the other ranks, and by `Drop` before it
    /// ends the write sides: the thread that sees the failure first can return and close the
    /// group while a reader thread is still forwarding it, and the forward must go out first.
    telling: Mutex<()>,
}

/// This process's rank of a job whose ranks are processes talking TCP through rank 0.
pub struct TcpGroup {
    shared: Arc<Shared>,
}

/// Why rank `rank`'s connection ended without a Bye or an Abort, as rank `seen_by` saw it.
fn lost(rank: usize, seen_by: usize, how: &str) -> String {
    format!(
        "rank {rank}'s process ended without a word (rank {seen_by}: {how}): it was killed \
         (SIGKILL, the out-of-memory killer, a lost node) or it crashed; its own log or the \
         launcher's says which"
    )
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single assignment or push: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `f` to rank `to` (rank 0, or on rank 0 any other rank).
    fn send(&self, to: usize, f: &Frame) -> std::io::Result<()> {
        let Some(Some(link)) = self.links.get(to) else {
            return Err(std::io::Error::other(format!("no connection to rank {to}")));
        };
        let mut s = link.lock().unwrap_or_else(|p| p.into_inner());
        wire::write(&mut *s, f)
    }

    /// Rank `rank` failed with `why`. The first failure is the group's: rank 0 forwards it to
    /// every other rank; another rank tells rank 0 of its own.
    fn fail(&self, rank: usize, why: &str) {
        // Poisoning carries no state here: the guard only orders the forward before a close.
        let _telling = self.telling.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut s = self.lock();
            if s.failure.is_some() {
                return;
            }
            s.failure = Some((rank, why.to_string()));
            self.wake.notify_all();
        }
        let f = Frame::Abort {
            rank: rank as u32,
            why: why.to_string(),
        };
        // A rank that is gone cannot be told: what is sent is best effort.
        match self.rank {
            0 => {
                for to in (1..self.world).filter(|&r| r != rank) {
                    let _ = self.send(to, &f);
                }
            }
            me if me == rank => {
                let _ = self.send(0, &f);
            }
            _ => {}
        }
    }

    /// Reads rank `from`'s frames until its connection ends.
    fn read_from(&self, from: usize, stream: TcpStream) {
        let mut r = BufReader::with_capacity(1 << 16, stream);
        loop {
            let how = match wire::read(&mut r) {
                Ok(Some(f @ Frame::Data { .. })) => {
                    self.lock().inbox[from].push_back(f);
                    self.wake.notify_all();
                    continue;
                }
                Ok(Some(Frame::Abort { rank, why })) => {
                    let rank = (rank as usize).min(self.world - 1);
                    self.fail(rank, &why);
                    continue;
                }
                Ok(Some(Frame::Bye)) => {
                    self.lock().ended[from] = true;
                    self.wake.notify_all();
                    continue;
                }
                Ok(Some(f)) => format!("it sent {f:?} mid-run"),
                Ok(None) => "its connection closed".to_string(),
                Err(e) => format!("its connection failed: {e}"),
            };
            let quiet = {
                let s = self.lock();
                s.closing || s.ended[from]
            };
            if !quiet {
                self.fail(from, &lost(from, self.rank, &how));
            }
            return;
        }
    }

    /// Waits until `take` gives a value, failing as the thread ranks do: at once when a rank
    /// failed or a rank waited for ended its run, at `deadline`, or `stop_grace` after a stop
    /// signal. `missing`: the ranks this wait is for. A failure of this rank's wait is the
    /// group's.
    fn wait<T>(
        &self,
        op: Op,
        deadline: Instant,
        mut take: impl FnMut(&mut State) -> Option<T>,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> std::result::Result<T, CommError> {
        let (me, start, op_name) = (self.rank, Instant::now(), op.name());
        let mut s = self.lock();
        let e = loop {
            if let Some((rank, why)) = &s.failure {
                return Err(CommError::Aborted {
                    me,
                    rank: *rank,
                    why: why.clone(),
                });
            }
            if let Some(v) = take(&mut s) {
                return Ok(v);
            }
            let missing = missing(&s);
            let ended: Vec<usize> = missing.iter().copied().filter(|&r| s.ended[r]).collect();
            let now = Instant::now();
            let stopped = crate::util::signal::interrupted_at()
                .map(|at| now.saturating_duration_since(at.max(start)))
                .filter(|d| *d >= self.stop_grace);
            match (now >= deadline, stopped) {
                _ if !ended.is_empty() => {
                    break CommError::Ended {
                        me,
                        op: op_name,
                        ended,
                    }
                }
                (true, _) if me == 0 => {
                    break CommError::Timeout {
                        me,
                        op: op_name,
                        missing,
                        secs: self.timeout.as_secs(),
                    }
                }
                (true, _) => {
                    break CommError::NoAnswer {
                        me,
                        op: op_name,
                        secs: now.duration_since(start).as_secs(),
                        timeout: self.timeout.as_secs(),
                    }
                }
                (false, Some(d)) => {
                    crate::util::signal::note_gave_up();
                    break CommError::Interrupted {
                        me,
                        op: op_name,
                        missing,
                        secs: d.as_secs(),
                    };
                }
                (false, None) => {
                    let left = deadline.saturating_duration_since(now).min(POLL);
                    s = self
                        .wake
                        .wait_timeout(s, left)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            }
        };
        drop(s);
        self.fail(me, &e.to_string());
        Err(e)
    }

    /// Collective number `seq` on rank 0: every rank's part, combined in rank order, sent
    /// back to each.
    fn gather_and_answer(&self, seq: u64, op: Op, arg: u32, x: &Tensor) -> Result<Tensor> {
        let peers = 1..self.world;
        let deadline = Instant::now() + self.timeout;
        let parts = self.wait(
            op,
            deadline,
            |s| match peers.clone().all(|r| !s.inbox[r].is_empty()) {
                true => Some(
                    peers
                        .clone()
                        .filter_map(|r| s.inbox[r].pop_front())
                        .collect::<Vec<_>>(),
                ),
                false => None,
            },
            |s| peers.clone().filter(|&r| s.inbox[r].is_empty()).collect(),
        )?;
        let res = self.combine(seq, op, arg, x, parts);
        match res {
            Ok((out, wire)) => {
                let f = Frame::Data {
                    seq,
                    op,
                    arg,
                    tensor: wire,
                };
                for to in 1..self.world {
                    // A rank that is gone: its reader reports it.
                    let _ = self.send(to, &f);
                }
                Ok(out)
            }
            Err(e) => {
                self.fail(0, &e);
                Err(candle_core::Error::Msg(e))
            }
        }
    }

    /// The result of collective `seq` from rank 0's `x` and the others' `parts` (rank
    /// order), and what goes back on the wire; an error says which rank disagrees.
    fn combine(
        &self,
        seq: u64,
        op: Op,
        arg: u32,
        x: &Tensor,
        parts: Vec<Frame>,
    ) -> std::result::Result<(Tensor, Option<Wire>), String> {
        let dev = x.device();
        let mut inputs = vec![x.clone()];
        for (i, p) in parts.into_iter().enumerate() {
            let r = i + 1;
            let Frame::Data {
                seq: s,
                op: o,
                arg: a,
                tensor,
            } = p
            else {
                return Err(format!("rank {r} sent a frame that is no collective's"));
            };
            if (s, o, a) != (seq, op, arg) {
                return Err(format!(
                    "the ranks disagree on the steps of the run: rank 0 is in collective {seq} \
                     ({} {arg}), rank {r} in collective {s} ({} {a})",
                    op.name(),
                    o.name()
                ));
            }
            if let Some(w) = tensor {
                let t = w.tensor(dev).map_err(|e| format!("rank {r}'s part: {e}"))?;
                if op == Op::AllReduce && (t.dims(), t.dtype()) != (x.dims(), x.dtype()) {
                    return Err(format!(
                        "all_reduce: rank {r} sends {:?} {:?}, rank 0 {:?} {:?}",
                        t.dtype(),
                        t.dims(),
                        x.dtype(),
                        x.dims()
                    ));
                }
                inputs.push(t);
            }
        }
        let out = match op {
            Op::AllReduce => super::cpu::sum(&inputs, 0),
            Op::AllGather => super::cpu::concat(&inputs, 0),
            Op::Broadcast if arg == 0 => x.copy(),
            // The root's part is the only tensor that came.
            Op::Broadcast => inputs.get(1).cloned().ok_or_else(|| {
                candle_core::Error::Msg(format!("broadcast: root {arg} sent no tensor"))
            }),
            Op::Barrier => return Ok((x.clone(), None)),
        };
        let out = out.map_err(|e| format!("{}: {e}", op.name()))?;
        let wire = Wire::of(&out).map_err(|e| format!("{}: {e}", op.name()))?;
        Ok((out, Some(wire)))
    }

    /// Collective number `seq` on a rank other than 0: its part to rank 0, the result back.
    fn ask_rank_zero(&self, seq: u64, op: Op, arg: u32, x: &Tensor) -> Result<Tensor> {
        let me = self.rank;
        let mine = match op {
            Op::AllReduce | Op::AllGather => Some(Wire::of(x)?),
            Op::Broadcast if arg as usize == me => Some(Wire::of(x)?),
            Op::Broadcast | Op::Barrier => None,
        };
        let part = Frame::Data {
            seq,
            op,
            arg,
            tensor: mine,
        };
        if let Err(e) = self.send(0, &part) {
            // Rank 0's reader thread may not have seen its end yet.
            self.fail(0, &lost(0, me, &format!("a send to it failed: {e}")));
        }
        let deadline = Instant::now() + 2 * self.timeout;
        let got = self.wait(op, deadline, |s| s.inbox[0].pop_front(), |_| vec![0])?;
        let (s, o, tensor) = match got {
            Frame::Data {
                seq, op, tensor, ..
            } => (seq, op, tensor),
            _ => (u64::MAX, op, None),
        };
        if (s, o) != (seq, op) {
            let why = format!(
                "rank 0 answered collective {s} ({}) to rank {me}'s collective {seq} ({})",
                o.name(),
                op.name()
            );
            self.fail(me, &why);
            return Err(candle_core::Error::Msg(why));
        }
        match tensor {
            Some(w) => w.tensor(x.device()),
            None => Ok(x.clone()),
        }
    }

    fn exchange(&self, op: Op, arg: usize, x: &Tensor) -> Result<Tensor> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        if let Some((rank, why)) = self.lock().failure.clone() {
            return Err(CommError::Aborted {
                me: self.rank,
                rank,
                why,
            }
            .into());
        }
        match self.rank {
            0 => self.gather_and_answer(seq, op, arg as u32, x),
            _ => self.ask_rank_zero(seq, op, arg as u32, x),
        }
    }
}

/// A stream's settings for the run: no batching of small frames, writes bounded by
/// `timeout` (a peer that stopped reading), reads unbounded (the waits bound them).
fn tune(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(None)?;
    s.set_write_timeout(Some(timeout))
}

/// MASTER_ADDR:port, an IPv4 address first (rank 0 listens on IPv4's every interface).
fn resolve(addr: &str, port: u16) -> anyhow::Result<SocketAddr> {
    let all: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve MASTER_ADDR {addr:?}"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .with_context(|| format!("MASTER_ADDR {addr:?} has no address"))
}

/// What a connecting process said.
enum Hello {
    /// A rank of this job.
    Rank(usize),
    /// Not a lora-train rank (a port scan, a stray client): ignored.
    Foreign(String),
}

/// Reads a connecting process's hello: its rank, or why the job cannot start.
fn hello(s: &mut TcpStream, world: usize) -> anyhow::Result<Hello> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(HELLO_WAIT))?;
    let (version, rank, w) = match wire::read(s) {
        Ok(Some(Frame::Hello {
            version,
            rank,
            world,
        })) => (version, rank as usize, world as usize),
        Ok(other) => return Ok(Hello::Foreign(format!("it sent {other:?}"))),
        Err(e) => return Ok(Hello::Foreign(e.to_string())),
    };
    if version != wire::VERSION {
        bail!(
            "rank {rank} runs another lora-train build (protocol {version}, rank 0's {}): run the same binary on every node",
            wire::VERSION
        );
    }
    if w != world {
        bail!("rank {rank} was started with WORLD_SIZE = {w}, rank 0 with {world}: the launcher's variables differ between nodes");
    }
    if rank == 0 || rank >= world {
        bail!("a process says it is rank {rank} of {world}: RANK / SLURM_PROCID must be 1..{world} on the ranks that connect to rank 0");
    }
    Ok(Hello::Rank(rank))
}

impl TcpGroup {
    /// This process's rank of `e`'s job, once every rank has joined: rank 0 listens on
    /// `e.port` until each other rank has said hello; the others connect to `e.addr:e.port`,
    /// retrying, and wait for rank 0's welcome. Either gives up after `timeout`.
    pub fn connect(e: &EnvRank, timeout: Duration) -> anyhow::Result<Arc<TcpGroup>> {
        let deadline = Instant::now() + timeout;
        let streams = match e.rank {
            0 => accept_ranks(e, timeout, deadline)?,
            _ => vec![Some(join_rank_zero(e, timeout, deadline)?)],
        };
        Self::start(e.rank, e.world, timeout, streams)
    }

    /// The group over connected `streams` (index = the rank at the other end), with a reader
    /// thread for each.
    fn start(
        rank: usize,
        world: usize,
        timeout: Duration,
        streams: Vec<Option<TcpStream>>,
    ) -> anyhow::Result<Arc<TcpGroup>> {
        let mut links = Vec::with_capacity(streams.len());
        let mut readers = Vec::new();
        for (r, s) in streams.into_iter().enumerate() {
            match s {
                Some(s) => {
                    tune(&s, timeout)?;
                    readers.push((r, s.try_clone()?));
                    links.push(Some(Mutex::new(s)));
                }
                None => links.push(None),
            }
        }
        let shared = Arc::new(Shared {
            rank,
            world,
            timeout,
            stop_grace: STOP_GRACE,
            links,
            seq: AtomicU64::new(0),
            state: Mutex::new(State {
                inbox: (0..world).map(|_| VecDeque::new()).collect(),
                failure: None,
                ended: vec![false; world],
                closing: false,
            }),
            wake: Condvar::new(),
            telling: Mutex::new(()),
        });
        for (r, s) in readers {
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("rank-{rank}-from-{r}"))
                .spawn(move || sh.read_from(r, s))
                .with_context(|| format!("rank {rank}: cannot start the reader of rank {r}"))?;
        }
        Ok(Arc::new(TcpGroup { shared }))
    }
}

/// Rank 0: listens on `e.port` until every other rank has said hello, then welcomes them.
fn accept_ranks(
    e: &EnvRank,
    timeout: Duration,
    deadline: Instant,
) -> anyhow::Result<Vec<Option<TcpStream>>> {
    let port = e.port;
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| {
        format!(
            "rank 0 cannot listen on port {port} (MASTER_PORT + 1, or LORA_TRAIN_PORT): is it \
             taken (another job on this host, a run still ending)? Pick another MASTER_PORT"
        )
    })?;
    listener.set_nonblocking(true)?;
    let mut streams: Vec<Option<TcpStream>> = (0..e.world).map(|_| None).collect();
    while streams.iter().skip(1).any(Option::is_none) {
        match listener.accept() {
            Ok((mut s, from)) => match hello(&mut s, e.world)? {
                Hello::Rank(r) if streams[r].is_some() => bail!(
                    "two processes say they are rank {r} (the second from {from}): check RANK / SLURM_PROCID"
                ),
                Hello::Rank(r) => streams[r] = Some(s),
                Hello::Foreign(why) => crate::errln!(
                    "rank 0: a connection from {from} to port {port} is not a lora-train rank ({why}): ignored"
                ),
            },
            Err(x) if x.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..e.world).filter(|&r| streams[r].is_none()).collect();
                    bail!(
                        "rank 0 waited {} s on port {port} for rank(s) {missing:?}, which never connected (parallel.timeout_s): are they started, with MASTER_ADDR = this host, and is the port open between the nodes?",
                        timeout.as_secs()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(x) => return Err(x).context("rank 0: accepting a rank"),
        }
    }
    let welcome = Frame::Welcome {
        world: e.world as u32,
    };
    for (r, s) in streams.iter_mut().enumerate() {
        if let Some(s) = s {
            wire::write(s, &welcome).with_context(|| format!("rank 0: welcoming rank {r}"))?;
        }
    }
    Ok(streams)
}

/// A rank other than 0: connects to rank 0 (retrying until `deadline`), says hello, and
/// waits for the welcome that says every rank is there.
fn join_rank_zero(e: &EnvRank, timeout: Duration, deadline: Instant) -> anyhow::Result<TcpStream> {
    let (me, port) = (e.rank, e.port);
    let target = resolve(&e.addr, port)?;
    let mut s = loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(x) => {
                return Err(x).with_context(|| {
                    format!(
                        "rank {me} cannot reach rank 0 at {target} (MASTER_ADDR {}, port MASTER_PORT + 1 or LORA_TRAIN_PORT) within {} s: is rank 0 running, and the port open between the nodes?",
                        e.addr,
                        timeout.as_secs()
                    )
                })
            }
        }
    };
    let hi = Frame::Hello {
        version: wire::VERSION,
        rank: me as u32,
        world: e.world as u32,
    };
    wire::write(&mut s, &hi).with_context(|| format!("rank {me}: greeting rank 0 at {target}"))?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_secs(1))))?;
    match wire::read(&mut s) {
        Ok(Some(Frame::Welcome { world })) if world as usize == e.world => Ok(s),
        Ok(Some(f)) => bail!("rank {me}: rank 0 at {target} answered {f:?}, not a welcome"),
        Ok(None) => bail!(
            "rank {me}: rank 0 at {target} closed the connection before the run began: rank 0's error says why"
        ),
        Err(x) => Err(x).with_context(|| {
            format!(
                "rank {me}: no welcome from rank 0 at {target} within {} s (it waits for every rank to connect)",
                timeout.as_secs()
            )
        }),
    }
}

impl Drop for TcpGroup {
    fn drop(&mut self) {
        // A failure being forwarded goes out before the write sides end (`Shared::telling`).
        let _telling = self
            .shared
            .telling
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.shared.lock().closing = true;
        for link in self.shared.links.iter().flatten() {
            let s = link.lock().unwrap_or_else(|p| p.into_inner());
            // The write side only: queued frames go out before the end, and the reader threads
            // keep draining what comes until the peer closes (a close with unread bytes would
            // reset the connection, and the peer could lose our last frame, an Abort's reason).
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

impl Group for TcpGroup {
    fn world(&self) -> usize {
        self.shared.world
    }

    fn comm(self: Arc<Self>, rank: usize) -> anyhow::Result<Box<dyn Comm>> {
        if rank != self.shared.rank {
            bail!(
                "this process is rank {} of a TCP group: it has no comm of rank {rank}",
                self.shared.rank
            );
        }
        Ok(Box::new(TcpComm { group: self }))
    }

    fn abort(&self, rank: usize, why: &str) {
        self.shared.fail(rank, why);
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.shared.lock().failure.clone()
    }

    /// This rank's run is over: the others learn it (Bye), so a collective still waiting for
    /// it fails at once.
    fn ended(&self, rank: usize) {
        let sh = &self.shared;
        if let Some(e) = sh.lock().ended.get_mut(rank) {
            *e = true;
        }
        if rank != sh.rank {
            return;
        }
        let to: Vec<usize> = match sh.rank {
            0 => (1..sh.world).collect(),
            _ => vec![0],
        };
        for r in to {
            let _ = sh.send(r, &Frame::Bye);
        }
    }
}

/// This process's end of a `TcpGroup`.
pub struct TcpComm {
    group: Arc<TcpGroup>,
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.group.shared.rank
    }
    fn world(&self) -> usize {
        self.group.shared.world
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.group.shared.exchange(Op::AllReduce, 0, x)
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.group.shared.exchange(Op::AllGather, 0, x)
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world() {
            return Err(candle_core::Error::Msg(format!(
                "broadcast from rank {root} of {}",
                self.world()
            )));
        }
        self.group.shared.exchange(Op::Broadcast, root, x)
    }
    fn barrier(&self) -> Result<()> {
        let z = Tensor::zeros(0, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        self.group.shared.exchange(Op::Barrier, 0, &z).map(|_| ())
    }
}
