//! The stop signal as the collectives see it: when one came (the handler in train::stop sets
//! it), and whether a collective gave up waiting after it (parallel's backends set it, the
//! launcher reads it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a rank still waits in a collective once a stop signal has come: the others
/// finish their step within it, unless they are stuck.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

static INTERRUPTED: OnceLock<Instant> = OnceLock::new();

/// A stop signal came (train::stop's handler): a collective that has waited `STOP_GRACE` since the
/// signal (or since it began, when it began later) fails.
pub fn interrupt() {
    let _ = INTERRUPTED.set(Instant::now());
}

/// When a stop signal came, if one did.
pub fn interrupted_at() -> Option<Instant> {
    INTERRUPTED.get().copied()
}

static GAVE_UP: AtomicBool = AtomicBool::new(false);

/// Whether a collective gave up waiting after a stop signal (`CommError::Interrupted`): the
/// run's failure is then the signal's stop.
pub fn gave_up_after_signal() -> bool {
    GAVE_UP.load(Ordering::SeqCst)
}

/// A collective gave up waiting after a stop signal (`gave_up_after_signal`).
pub fn note_gave_up() {
    GAVE_UP.store(true, Ordering::SeqCst);
}
