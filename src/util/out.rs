//! stdout and stderr written without panicking. `println!` / `eprintln!` panic when a write
//! fails (a pipe whose reader is gone, a redirect to a full disk), so every line of ours goes
//! through [`write`] (the `outln!`, `out!` and `errln!` macros; clippy's `print_stdout` and
//! `print_stderr` lints keep it so).
//!
//! The first failed write of a stream is handled once; that stream's later output is dropped:
//!
//! * Its reader is gone (EPIPE: `lora-train check | head -1`). stdout: the process ends at
//!   once, silently, with status 0, as ripgrep does: the reader asked for no more, and a
//!   pipeline under `set -o pipefail` should not fail because `head` stopped reading (a SIGPIPE
//!   death, 141, would). A run ([`on_closed`]) instead finishes its step, saves a checkpoint
//!   and exits as on SIGINT (130, resumable); after its adapter is saved, its status is
//!   unchanged. A closed stderr of any other command just drops its lines.
//! * Any other error (a full disk, EIO). stdout of a command whose product it is (`check`,
//!   `plan`, `download`, ...): nothing is said on the spot, and the command fails at its end
//!   with the error ([`failure`], exit 1), as GNU tools do on /dev/full. A run's streams are
//!   logs: the failure is reported once on the other stream, and the run goes on.
//!
//! The binary writes to the file descriptors directly ([`direct`]); the library alone (tests
//! that run it in-process) writes through `print!` / `eprint!`, which a test harness captures.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// One of the two output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// stdout: a command's product (`check`, `plan`, `download`, ...), a run's last lines.
    Out,
    /// stderr: logs, progress, errors.
    Err,
}

impl Stream {
    /// "stdout" or "stderr".
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stream::Out => "stdout",
            Stream::Err => "stderr",
        }
    }

    fn other(self) -> Stream {
        match self {
            Stream::Out => Stream::Err,
            Stream::Err => Stream::Out,
        }
    }

    fn state(self) -> &'static AtomicU8 {
        match self {
            Stream::Out => &STDOUT,
            Stream::Err => &STDERR,
        }
    }
}

/// A stream's state: writable, or failed once (later writes are dropped).
const OK: u8 = 0;
const FAILED: u8 = 1;

static STDOUT: AtomicU8 = AtomicU8::new(OK);
static STDERR: AtomicU8 = AtomicU8::new(OK);
static DIRECT: AtomicBool = AtomicBool::new(false);
/// The run's reaction to a closed stream (set: this process is a run, its streams are logs).
/// What a run does when one of its streams is closed (the stream that was).
pub(crate) type Hook = Arc<dyn Fn(Stream) + Send + Sync>;
static ON_CLOSED: Mutex<Option<Hook>> = Mutex::new(None);
/// stdout's failure other than a closed pipe, when stdout is a command's product.
static FAILURE: Mutex<Option<String>> = Mutex::new(None);

/// The binary's start: write to the file descriptors themselves from now on.
pub fn direct() {
    DIRECT.store(true, Ordering::SeqCst);
}

/// This process is a training run: its streams are logs, and `hook` is what a closed one
/// does (train: stop as on a signal).
pub fn on_closed(hook: Hook) {
    *ON_CLOSED.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
}

/// stdout's write error, when stdout is the command's product and not all of it was written.
pub fn failure() -> Option<String> {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Writes `args` to `s` (flushed); a failure is handled as the module says, never a panic.
pub fn write(s: Stream, args: fmt::Arguments) {
    if s.state().load(Ordering::SeqCst) != OK {
        return;
    }
    if !DIRECT.load(Ordering::SeqCst) {
        return captured(s, args);
    }
    let res = match s {
        Stream::Out => {
            let mut o = std::io::stdout().lock();
            o.write_fmt(args).and_then(|()| o.flush())
        }
        Stream::Err => std::io::stderr().lock().write_fmt(args),
    };
    if let Err(e) = res {
        failed(s, e);
    }
}

/// The library without the binary: through the macros a test harness captures.
#[allow(clippy::print_stdout, clippy::print_stderr)]
fn captured(s: Stream, args: fmt::Arguments) {
    match s {
        Stream::Out => print!("{args}"),
        Stream::Err => eprint!("{args}"),
    }
}

fn failed(s: Stream, e: std::io::Error) {
    if s.state().swap(FAILED, Ordering::SeqCst) != OK {
        return;
    }
    let run = ON_CLOSED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match (run, e.kind() == std::io::ErrorKind::BrokenPipe) {
        (Some(hook), true) => hook(s),
        (None, true) if s == Stream::Out => super::on_exit::exit(0),
        (None, true) => {}
        (Some(_), false) => {
            write(
                s.other(),
                format_args!(
                    "warning: cannot write to {} ({e}); its further lines are dropped\n",
                    s.name()
                ),
            );
        }
        (None, false) if s == Stream::Out => {
            *FAILURE.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("cannot write the output to stdout: {e}"));
        }
        (None, false) => {}
    }
}

/// `println!` that never panics (see the module).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::util::out::write($crate::util::out::Stream::Out, format_args!("\n"))
    };
    ($($t:tt)*) => {
        $crate::util::out::write(
            $crate::util::out::Stream::Out,
            format_args!("{}\n", format_args!($($t)*)),
        )
    };
}

/// `print!` that never panics (see the module).
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => {
        $crate::util::out::write($crate::util::out::Stream::Out, format_args!($($t)*))
    };
}

/// `eprintln!` that never panics (see the module).
#[macro_export]
macro_rules! errln {
    () => {
        $crate::util::out::write($crate::util::out::Stream::Err, format_args!("\n"))
    };
    ($($t:tt)*) => {
        $crate::util::out::write(
            $crate::util::out::Stream::Err,
            format_args!("{}\n", format_args!($($t)*)),
        )
    };
}
