//! What each rank of one process posts for the others to read in place, and its orderly
//! departure (NCCL's peer copies: parallel::nccl; generic here, so that the CPU tests cover it).
//!
//! A rank posts a value (its frozen shards, their addresses); the others read the table. The
//! value may still be read by a peer after its owner is done with it, and it must be dropped
//! on its owner's thread (a CUDA tensor's last owner also frees its device's cuBLAS handle and
//! the like, with whatever context the dropping thread has current). So `leave` waits, for a
//! bounded time, until every rank has left, then drops the caller's value on the caller's
//! thread; a rank that never comes (hung) leaves the value leaked rather than freed under a
//! reader or from another thread.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The table: one slot per rank.
pub struct Posted<T> {
    slots: Mutex<Vec<Option<T>>>,
    /// Ranks that have called `leave`.
    left: Mutex<usize>,
    all_left: Condvar,
    wait: Duration,
}

/// What `leave` did with the caller's value.
#[derive(Debug, PartialEq, Eq)]
pub enum Left {
    /// It had posted nothing.
    Nothing,
    /// Every rank left: the value was dropped on this thread.
    Dropped,
    /// Some rank did not leave within the wait: the value was leaked.
    Leaked,
}

impl<T> Posted<T> {
    /// `wait`: how long `leave` waits for the other ranks.
    pub fn new(wait: Duration) -> Posted<T> {
        Posted {
            slots: Mutex::new(Vec::new()),
            left: Mutex::new(0),
            all_left: Condvar::new(),
            wait,
        }
    }

    /// Posts rank `rank`'s value (replacing an earlier one).
    pub fn post(&self, rank: usize, value: T) {
        let mut slots = self.slots();
        if slots.len() <= rank {
            slots.resize_with(rank + 1, || None);
        }
        slots[rank] = Some(value);
    }

    /// The table, by rank (None: nothing posted), locked while the guard lives.
    pub fn slots(&self) -> MutexGuard<'_, Vec<Option<T>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `rank` of `world` is done reading the others' values: takes its own value out of
    /// the table, waits until all `world` ranks have left (each counts, posted or not), and
    /// drops it here (`Dropped`), or leaks it when the wait runs out (`Leaked`).
    pub fn leave(&self, rank: usize, world: usize) -> Left {
        let mine = self.slots().get_mut(rank).and_then(Option::take);
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        *left += 1;
        self.all_left.notify_all();
        let Some(mine) = mine else {
            return Left::Nothing;
        };
        let until = Instant::now() + self.wait;
        while *left < world {
            let now = Instant::now();
            if now >= until {
                std::mem::forget(mine);
                return Left::Leaked;
            }
            left = match self.all_left.wait_timeout(left, until - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        drop(left);
        drop(mine);
        Left::Dropped
    }
}

impl<T> Default for Posted<T> {
    /// A 10 s wait.
    fn default() -> Self {
        Posted::new(Duration::from_secs(10))
    }
}
