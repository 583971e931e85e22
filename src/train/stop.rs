//! Why a run stops before its last step: a signal (SIGINT / SIGTERM), or a loss or gradient
//! that is not a finite number.
//!
//! The first SIGINT or SIGTERM sets a flag; the training loop finishes the step it is in,
//! saves a checkpoint and returns `Interrupted` (the CLI exits with `EXIT_INTERRUPTED`). A
//! second signal ends the process at once with `EXIT_SECOND_SIGNAL`; checkpoints are written
//! into a temporary directory and renamed, so the last complete one stays loadable. A signal
//! that comes while the run is still loading (the model, the data: nothing written yet) ends
//! the process at once with `EXIT_INTERRUPTED`. A signal that finds ranks stuck in a
//! collective (a rank that never joins) ends their wait within `util::signal::STOP_GRACE`, and
//! the run stops with `StoppedUnsaved`, naming the last complete checkpoint. A closed stdout
//! or stderr stops a run as the first signal does. `export` ends at once on the first signal,
//! its unfinished output removed (`exit_on_signal`).

use anyhow::Result;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Exit code after a signal, once the checkpoint is saved (the run can be resumed).
pub const EXIT_INTERRUPTED: u8 = 130;
/// Exit code when a second signal ends the process without waiting.
pub(crate) const EXIT_SECOND_SIGNAL: i32 = 131;

/// The run stopped on a signal after `step` of `total` steps, with a checkpoint saved.
#[derive(Debug, thiserror::Error)]
#[error("interrupted after step {step} of {total}; checkpoint saved to {}", checkpoint.display())]
pub struct Interrupted {
    /// The last step done.
    pub step: usize,
    pub(crate) total: usize,
    /// Where the checkpoint was saved.
    pub checkpoint: PathBuf,
}

/// The loss or the gradients of a step were NaN or infinite (and skip_nonfinite is off).
/// The update of that step was not applied.
#[derive(Debug)]
pub(crate) struct NonFinite {
    /// The 1-based number of the step that failed.
    pub(crate) step: usize,
    pub(crate) total: usize,
    /// e.g. "the loss is NaN and the gradient norm NaN".
    pub(crate) what: String,
    /// The newest checkpoint saved before that step (every step it covers was finite).
    pub(crate) last_checkpoint: Option<PathBuf>,
    pub(crate) lr: f64,
    /// Base weight dtype, e.g. "bf16".
    pub(crate) dtype: String,
    pub(crate) max_grad_norm: f64,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        writeln!(
            f,
            "step {} of {}: {}; stopped without applying that update",
            self.step, self.total, self.what
        )?;
        match &self.last_checkpoint {
            Some(p) => writeln!(
                f,
                "  last good checkpoint: {} (to go on with other settings, start a new run from its adapter: lora.init_adapter = \"{}\")",
                p.display(),
                p.display()
            )?,
            None => writeln!(f, "  last good checkpoint: none (output.save_every = 0)")?,
        }
        let mut hints = vec![format!("lower train.lr (now {:e})", self.lr)];
        if self.dtype != "f32" {
            hints.push(format!(
                "train the base in f32 (model.dtype = \"f32\"; now {}: it overflows sooner)",
                self.dtype
            ));
        }
        if self.max_grad_norm == 0.0 {
            hints.push("turn gradient clipping on (train.max_grad_norm = 1.0; now 0)".into());
        }
        hints.push("or set train.skip_nonfinite = true to skip such steps".into());
        write!(f, "  hints: {}", hints.join("; "))
    }
}

impl std::error::Error for NonFinite {}

/// A signal stopped the run where no checkpoint could be saved: ranks stuck in a collective
/// (every checkpoint already saved is complete).
#[derive(Debug, thiserror::Error)]
#[error("stopped by the signal without a new checkpoint: {why}; {}", match last_checkpoint {
    Some(p) => format!("the last complete checkpoint is {} (continue with train.resume = true)", p.display()),
    None => "there is no checkpoint".into(),
})]
pub struct StoppedUnsaved {
    pub(crate) why: String,
    pub(crate) last_checkpoint: Option<PathBuf>,
}

/// Where the run is, for the signal: still loading (a signal ends the process at once), in
/// the training loop (the step finishes and a checkpoint is saved), or ending on a signal.
const LOADING: u8 = 0;
const TRAINING: u8 = 1;
const EXITING: u8 = 2;

/// The first SIGINT / SIGTERM, as the training loop sees it.
#[derive(Clone)]
pub struct StopSignal {
    flag: Arc<AtomicBool>,
    announced: Arc<AtomicBool>,
    phase: Arc<AtomicU8>,
}

impl StopSignal {
    /// The run enters its training loop: from now on a signal finishes the step and saves.
    /// (When a signal already ends the process, this thread waits for that.)
    pub(crate) fn training(&self) {
        let cas =
            self.phase
                .compare_exchange(LOADING, TRAINING, Ordering::SeqCst, Ordering::SeqCst);
        if cas == Err(EXITING) {
            loop {
                std::thread::park();
            }
        }
    }

    /// A signal has arrived: finish the step, save, stop.
    pub(crate) fn received(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// A closed output stream (`util::out`): while loading, the process ends at once (nothing
    /// written); in the loop, the run stops at the step's end with a checkpoint, as on a signal.
    fn closed(&self, stream: crate::util::out::Stream) {
        let cas = self
            .phase
            .compare_exchange(LOADING, EXITING, Ordering::SeqCst, Ordering::SeqCst);
        if cas.is_ok() {
            crate::util::on_exit::exit(EXIT_INTERRUPTED.into());
        }
        if !self.flag.swap(true, Ordering::SeqCst) {
            crate::errln!(
                "{} was closed: finishing this step, then saving a checkpoint",
                stream.name()
            );
        }
        self.announced.store(true, Ordering::SeqCst);
    }

    /// For a command whose signals end it at once (`exit_on_signal`) that failed meanwhile:
    /// when a signal came, its removal of the unfinished output caused the failure, and the
    /// signal's exit (`EXIT_INTERRUPTED`) is the command's end, so wait for it (10 s at most).
    pub fn settle(&self) {
        let start = Instant::now();
        while self.received() && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits (1 s at most) until the line announcing the signal is printed, so that it comes
    /// before the lines that report the stop.
    pub(crate) fn wait_announced(&self) {
        let start = Instant::now();
        while !self.announced.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Installs a run's SIGINT / SIGTERM handlers. The first signal sets the flag that
/// `StopSignal::received` reads; a second one exits the process at once with
/// `EXIT_SECOND_SIGNAL`. A closed stdout or stderr (its reader gone: `util::out`) stops the
/// run as a first signal does: quietly, with a checkpoint.
pub(crate) fn install_signal_handlers() -> Result<StopSignal> {
    let stop = install()?;
    let on = stop.clone();
    crate::util::out::on_closed(Arc::new(move |stream| on.closed(stream)));
    Ok(stop)
}

/// The handlers of a command with no step to finish (`export`): it never leaves the loading
/// phase, so the first SIGINT / SIGTERM removes what `util::on_exit` holds (its unfinished
/// output, its lock) and exits with `EXIT_INTERRUPTED` at once; a second one, while that
/// removal runs, exits with `EXIT_SECOND_SIGNAL` (the next export removes what is left).
pub fn exit_on_signal() -> Result<StopSignal> {
    install()
}

fn install() -> Result<StopSignal> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        // Order matters: the exit is armed by the flag that the next handler sets.
        signal_hook::flag::register_conditional_shutdown(sig, EXIT_SECOND_SIGNAL, flag.clone())?;
        signal_hook::flag::register(sig, flag.clone())?;
    }
    // Say at once what will happen (a step may take a while); printing is not allowed in a
    // signal handler, so a thread waits for the signal and prints.
    let announced = Arc::new(AtomicBool::new(false));
    let said = announced.clone();
    let phase = Arc::new(AtomicU8::new(LOADING));
    let at = phase.clone();
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
            let cas = at.compare_exchange(LOADING, EXITING, Ordering::SeqCst, Ordering::SeqCst);
            if cas.is_ok() {
                // Removed before anything is printed: a blocked stderr must not keep them.
                let removed = crate::util::on_exit::remove_registered();
                match removed.is_empty() {
                    true => crate::errln!("\n{name} while loading: stopped (nothing was written)"),
                    false => crate::errln!(
                        "\n{name}: stopped; removed the unfinished {}",
                        removed
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }
                crate::util::on_exit::exit(EXIT_INTERRUPTED.into());
            }
            // Ranks waiting in a collective for one that never comes stop waiting soon.
            crate::util::signal::interrupt();
            crate::errln!(
                "\n{name}: finishing this step, then saving a checkpoint (send it again to quit at once)"
            );
            said.store(true, Ordering::SeqCst);
        }
    });
    Ok(StopSignal {
        flag,
        announced,
        phase,
    })
}

/// Exit code when the memory plan says the run does not fit (preflight, before loading).
pub const EXIT_DOES_NOT_FIT: u8 = 3;
/// Exit code when a device allocation failed mid-run (a real OOM).
pub const EXIT_OUT_OF_MEMORY: u8 = 4;

fn gib(x: u64) -> String {
    crate::util::fmt_bytes(x)
}

/// A device allocation failed mid-run (CUDA out of memory, or the CPU accounting's cap).
/// The step's update was not applied; checkpoints already saved are complete.
#[derive(Debug)]
pub struct OutOfMemory {
    pub(crate) rank: usize,
    /// forward, head, backward or optimizer.
    pub(crate) phase: &'static str,
    /// The 1-based step that failed (None: outside the training loop, e.g. bench / probe).
    pub(crate) step: Option<usize>,
    pub(crate) total: usize,
    /// The device pool's (or the CPU accounting's) peak before the failure.
    pub(crate) peak: Option<u64>,
    /// What the run had: max_memory or the card's memory.
    pub(crate) capacity: Option<u64>,
    /// The memory plan's forecast for this run.
    pub(crate) forecast: Option<crate::train::meter::Forecast>,
    pub(crate) remedies: Vec<String>,
    pub(crate) last_checkpoint: Option<PathBuf>,
    /// The failure as the allocator reported it.
    pub(crate) cause: String,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self.step {
            Some(s) => writeln!(
                f,
                "out of memory on rank {} in the {} phase of step {s} of {}; that step's update was not applied",
                self.rank, self.phase, self.total
            )?,
            None => writeln!(f, "out of memory on rank {} in the {} phase", self.rank, self.phase)?,
        }
        let opt = |x: Option<u64>| x.map(gib).unwrap_or_else(|| "unknown".into());
        writeln!(
            f,
            "  peak before the failure: {} of {}",
            opt(self.peak),
            opt(self.capacity)
        )?;
        if let Some(b) = &self.forecast {
            writeln!(
                f,
                "  forecast (memory plan, {} at micro-batch {}): {} in all, peak {} in {} (base {}, activations {}, transient {})",
                b.label,
                b.micro_batch,
                gib(b.total),
                gib(b.pool_peak),
                b.peak_phase,
                gib(b.base),
                gib(b.activations),
                gib(b.transient)
            )?;
        }
        if self.step.is_some() {
            match &self.last_checkpoint {
                Some(p) => writeln!(
                    f,
                    "  last checkpoint (intact): {} (continue with train.resume = true, where activation_checkpointing may change; or start a new run from its adapter: lora.init_adapter = \"{}\")",
                    p.display(),
                    p.display()
                )?,
                None => writeln!(f, "  last checkpoint: none (output.save_every = 0)")?,
            }
        }
        writeln!(f, "  remedies: {}", self.remedies.join("; "))?;
        write!(f, "  cause: {}", self.cause.lines().next().unwrap_or(""))
    }
}

impl std::error::Error for OutOfMemory {}

/// Several ranks stop at the same step: rank 0's decision (a signal) is broadcast with one
/// step's work and read at the next step's end, through pinned memory (a plain read would wait
/// for the next step's backward, queued before it), so no rank ever waits for it. One rank
/// stops at once.
pub(crate) struct Vote {
    world: usize,
    flag: Option<super::readback::Ticket>,
    rb: super::readback::Readbacks,
}

impl Vote {
    pub(crate) fn new(world: usize) -> Vote {
        Vote {
            world,
            flag: None,
            rb: super::readback::Readbacks::new(),
        }
    }

    /// Whether every rank stops after this step; `here`: rank 0 wants to (the others pass
    /// false). With several ranks the answer is rank 0's wish of the step before.
    pub(crate) fn stop(
        &mut self,
        here: bool,
        comm: &dyn super::comm::Comm,
        dev: &candle_core::Device,
    ) -> Result<bool> {
        if self.world == 1 {
            return Ok(here);
        }
        let before = match self.flag.take() {
            Some(f) => self.rb.read(f)?.first().is_some_and(|&x| x > 0.0),
            None => false,
        };
        let flag = candle_core::Tensor::new(&[here as u8 as f64], dev)?;
        let flag = comm.broadcast(&flag, 0)?;
        self.flag = Some(self.rb.start(&[&flag])?);
        Ok(before)
    }
}
