//! In-process communicator: the ranks are threads sharing one slot table.
//!
//! Each collective is a rendezvous: every rank puts its tensor into its slot; the last to arrive
//! combines them (sum, concatenation, root's copy), publishes the result under a new generation
//! number and wakes the others. Waits are bounded by `timeout` and end early when any rank
//! aborts the group, when a rank they wait for has ended its run, or `STOP_GRACE` after a stop
//! signal, so a dead, finished or stuck rank stops the run instead of hanging it.
//!
//! Sums add the ranks' tensors in rank order on one thread, so every rank gets bit-identical
//! results (identical optimiser steps on every rank).

use super::{CommError, Group};
use crate::train::Comm;
use crate::util::signal::STOP_GRACE;
use candle_core::{Result, Tensor};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the last rank to arrive computes from the ranks' inputs (in rank order).
type Combine = fn(&[Tensor], usize) -> Result<Tensor>;

struct State {
    /// Bumped each time a collective completes.
    generation: u64,
    slots: Vec<Option<Tensor>>,
    arrived: usize,
    /// The result of the collective that completed last.
    result: Option<std::result::Result<Tensor, String>>,
    /// The first failure: (rank, error chain).
    aborted: Option<(usize, String)>,
    /// Ranks whose run returned.
    ended: Vec<bool>,
}

/// How often a waiting rank looks at the stop signal.
const POLL: Duration = Duration::from_millis(100);

/// The shared state of `world` thread ranks.
pub struct CpuGroup {
    world: usize,
    timeout: Duration,
    /// How long a collective still waits once a stop signal has come.
    stop_grace: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

impl CpuGroup {
    /// `world` ranks on threads of this process; a collective waits at most `timeout` for
    /// the others.
    pub fn new(world: usize, timeout: Duration) -> Arc<CpuGroup> {
        Arc::new(CpuGroup {
            world,
            timeout,
            stop_grace: STOP_GRACE,
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; world],
                arrived: 0,
                result: None,
                aborted: None,
                ended: vec![false; world],
            }),
            wake: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked holding the lock left the table consistent (every update is a
        // single assignment), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted(&self, me: usize, s: &State) -> Option<CommError> {
        s.aborted.as_ref().map(|(rank, why)| CommError::Aborted {
            me,
            rank: *rank,
            why: why.clone(),
        })
    }

    /// One collective: `x` in, the combined result out, on every rank.
    fn exchange(
        &self,
        me: usize,
        op: &'static str,
        x: &Tensor,
        arg: usize,
        combine: Combine,
    ) -> Result<Tensor> {
        let mut s = self.lock();
        if let Some(e) = self.aborted(me, &s) {
            return Err(e.into());
        }
        s.slots[me] = Some(x.clone());
        s.arrived += 1;
        let mine = s.generation;
        if s.arrived == self.world {
            let inputs: Vec<Tensor> = s.slots.iter_mut().filter_map(Option::take).collect();
            s.result = Some(combine(&inputs, arg).map_err(|e| format!("{op}: {e}")));
            s.arrived = 0;
            s.generation += 1;
            self.wake.notify_all();
        } else {
            let start = Instant::now();
            let deadline = start + self.timeout;
            while s.generation == mine {
                if let Some(e) = self.aborted(me, &s) {
                    return Err(e.into());
                }
                let missing: Vec<usize> =
                    (0..self.world).filter(|&r| s.slots[r].is_none()).collect();
                let ended: Vec<usize> = missing.iter().copied().filter(|&r| s.ended[r]).collect();
                let now = Instant::now();
                let stopped = crate::util::signal::interrupted_at()
                    .map(|at| now.saturating_duration_since(at.max(start)))
                    .filter(|d| *d >= self.stop_grace);
                let e = match (now >= deadline, stopped) {
                    _ if !ended.is_empty() => CommError::Ended { me, op, ended },
                    (true, _) => CommError::Timeout {
                        me,
                        op,
                        missing,
                        secs: self.timeout.as_secs(),
                    },
                    (false, Some(d)) => {
                        crate::util::signal::note_gave_up();
                        CommError::Interrupted {
                            me,
                            op,
                            missing,
                            secs: d.as_secs(),
                        }
                    }
                    (false, None) => {
                        s = self
                            .wake
                            .wait_timeout(s, (deadline - now).min(POLL))
                            .map(|(g, _)| g)
                            .unwrap_or_else(|p| p.into_inner().0);
                        continue;
                    }
                };
                // The whole group fails: the others would wait just as long.
                if s.aborted.is_none() {
                    s.aborted = Some((me, e.to_string()));
                }
                self.wake.notify_all();
                return Err(e.into());
            }
        }
        // The result stays until the next collective completes, which needs this rank.
        match &s.result {
            Some(Ok(t)) => Ok(t.clone()),
            Some(Err(e)) => Err(candle_core::Error::msg(e.clone())),
            None => Err(candle_core::Error::msg(format!("{op}: no result"))),
        }
    }
}

impl Group for CpuGroup {
    fn world(&self) -> usize {
        self.world
    }

    fn comm(self: Arc<Self>, rank: usize) -> anyhow::Result<Box<dyn Comm>> {
        Ok(Box::new(CpuComm { rank, group: self }))
    }

    fn abort(&self, rank: usize, why: &str) {
        let mut s = self.lock();
        if s.aborted.is_none() {
            s.aborted = Some((rank, why.to_string()));
        }
        self.wake.notify_all();
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.lock().aborted.clone()
    }

    fn ended(&self, rank: usize) {
        let mut s = self.lock();
        if let Some(e) = s.ended.get_mut(rank) {
            *e = true;
        }
        self.wake.notify_all();
    }
}

/// One thread-rank's end of a `CpuGroup`.
pub(crate) struct CpuComm {
    rank: usize,
    group: Arc<CpuGroup>,
}

/// Σ of `xs` in rank order (the order decides the bits).
pub(super) fn sum(xs: &[Tensor], _: usize) -> Result<Tensor> {
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        acc = (acc + x)?;
    }
    Ok(acc)
}

/// `xs` flattened and concatenated in rank order.
pub(super) fn concat(xs: &[Tensor], _: usize) -> Result<Tensor> {
    let flat = xs
        .iter()
        .map(|x| x.flatten_all())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat, 0)
}

fn root(xs: &[Tensor], root: usize) -> Result<Tensor> {
    Ok(xs[root].clone())
}

impl Comm for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.group.world
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.group.exchange(self.rank, "all_reduce", x, 0, sum)
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.group.exchange(self.rank, "all_gather", x, 0, concat)
    }
    fn broadcast(&self, x: &Tensor, r: usize) -> Result<Tensor> {
        // A copy: the result must not share storage with root's tensor (which root may `set`).
        self.group
            .exchange(self.rank, "broadcast", x, r, root)?
            .copy()
    }
    fn barrier(&self) -> Result<()> {
        let z = Tensor::zeros(0, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        self.group
            .exchange(self.rank, "barrier", &z, 0, root)
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn group(world: usize, timeout: Duration, stop_grace: Duration) -> Arc<CpuGroup> {
        let g = CpuGroup::new(world, timeout);
        Arc::new(CpuGroup {
            stop_grace,
            ..Arc::into_inner(g).unwrap()
        })
    }

    #[test]
    fn a_collective_waiting_for_a_rank_that_ended_or_past_a_stop_signal_fails_at_once() {
        let x = Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        // Rank 1 finished its run: rank 0's sum cannot complete, and says why at once.
        let g = group(2, Duration::from_secs(60), STOP_GRACE);
        g.ended(1);
        let t = Instant::now();
        let e = g.clone().comm(0).unwrap().all_reduce_sum(&x).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            e.to_string()
                .contains("for rank(s) [1], which ended their run"),
            "{e}"
        );
        assert!(g.failure().is_some_and(|(r, _)| r == 0));

        // A stop signal: a rank waiting for one that never comes gives up after the grace.
        let g = group(2, Duration::from_secs(60), Duration::from_millis(300));
        crate::util::signal::interrupt();
        let t = Instant::now();
        let e = g.comm(0).unwrap().all_reduce_sum(&x).unwrap_err();
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert!(
            e.to_string()
                .contains("after the stop signal: they are stuck"),
            "{e}"
        );
    }
}
