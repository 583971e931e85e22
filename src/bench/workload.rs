//! What a bench step does besides the plain step, as the `train` command would with the same
//! recipe settings: rows packed with short examples (block-diagonal attention), an eval
//! forward every N steps, a checkpoint every N steps; and the work all of it costs per trained
//! token, to predict a configuration's throughput from the plain one's.

use crate::data::{Batch, Example};
use crate::lora::LoraSpec;
use crate::model::{Model, ModelConfig};
use crate::run::checkpoint_write::{Snapshot, Writer};
use crate::train::driver::Par;
use crate::train::optim::AdamW;
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Rows of token ids [b · t] as a language-modelling batch of `pack` examples a row (each
/// row cut into `pack` runs of ⌊t / pack⌋ tokens, the last taking the rest): each position
/// predicts the next one of its example, positions restart at each, and attention stays
/// within it (`Batch::from_rows`, as packed training data). `pack` = 1: one sequence a row.
pub(crate) fn batch(ids: &[u32], b: usize, t: usize, pack: usize) -> Batch {
    let pack = pack.clamp(1, (t / 2).max(1));
    let len = t / pack;
    let examples: Vec<Vec<Example>> = (0..b)
        .map(|r| {
            let row = &ids[r * t..(r + 1) * t];
            (0..pack)
                .map(|k| {
                    let end = if k + 1 == pack { t } else { (k + 1) * len };
                    let ids = row[k * len..end].to_vec();
                    let labels = ids.iter().map(|&i| i as i64).collect();
                    Example { ids, labels }
                })
                .collect()
        })
        .collect();
    let rows: Vec<Vec<&Example>> = examples.iter().map(|r| r.iter().collect()).collect();
    let mut batch = Batch::from_rows(&rows, 0, pack > 1);
    if pack == 1 {
        batch.segments = None; // one sequence a row: the plain causal mask
    }
    batch
}

/// Counted tokens of a `batch` row of t tokens in `pack` examples: t − pack.
pub(crate) fn targets_per_row(t: usize, pack: usize) -> usize {
    t - pack.clamp(1, (t / 2).max(1))
}

/// The model FLOPs one trained token costs in this configuration, counted as
/// `bench::flops_per_token` counts the plain step's (frozen base: 2 per weight forward, 2 for
/// dL/dx backward; attention causal over the `seq` an example attends to) and adding what it
/// leaves out: the adapters' products (6·r·(in + out) a token and linear: x Aᵀ, (x Aᵀ) Bᵀ; their
/// dL/dx terms, dA and dB), the recompute of checkpointing, and the eval forwards (`eval`
/// tokens each `eval_every` steps of `step` trained tokens).
pub(crate) struct Work {
    pub(crate) n_linear: usize,
    pub(crate) adapter: usize,
    pub(crate) layers: usize,
    pub(crate) hidden: usize,
    pub(crate) seq: usize,
    /// Activation checkpointing of whole layers: one more forward.
    pub(crate) ckpt: bool,
    /// Under `activation_checkpointing = "mlp"`, the MLP input weights recomputed (of the
    /// layers that do not park gate and up: `bench::mlp_in_weights`), else 0.
    pub(crate) mlp_recompute: usize,
    pub(crate) eval_tokens: usize,
    pub(crate) step_tokens: usize,
    pub(crate) eval_every: usize,
}

impl Work {
    pub(crate) fn flops_per_token(&self) -> f64 {
        let attn = (self.layers * self.seq * self.hidden) as f64;
        let (base, ad) = (2.0 * self.n_linear as f64, 2.0 * self.adapter as f64);
        let fwd = base + ad + 2.0 * attn;
        let bwd = base + 2.0 * ad + 4.0 * attn;
        let eval = match self.eval_every {
            0 => 0.0,
            n => fwd * self.eval_tokens as f64 / (n * self.step_tokens.max(1)) as f64,
        };
        let recompute = match self.ckpt {
            true => fwd,
            false => 2.0 * self.mlp_recompute as f64,
        };
        fwd + bwd + recompute + eval
    }
}

/// Σ r · (in + out) over the adapted linears of every layer: the adapters' weights a token
/// multiplies (forward: 2 FLOPs each). A MoE's expert adapters count the k experts a token is
/// routed to: r · (C + 2I) for gate_up_proj, r · (I + C) for down_proj, each.
pub(crate) fn adapter_weights(cfg: &ModelConfig, spec: &LoraSpec) -> usize {
    let per_layer: usize = cfg
        .linears()
        .iter()
        .filter(|m| spec.targets(m))
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(i, o)| spec.rank * (i + o))
        .sum();
    let c = cfg.hidden_size;
    let experts = cfg.arch.moe.map_or(0, |m| {
        let [gate_up, down] = crate::model::EXPERT_PARAMS;
        [(gate_up, c + 2 * m.inter), (down, m.inter + c)]
            .iter()
            .filter(|(name, _)| spec.targets(name))
            .map(|(_, w)| m.top_k * spec.rank * w)
            .sum()
    });
    (per_layer + experts) * cfg.num_layers
}

/// Σ token CE over `batches` (the eval set), forward only, as the trainer's eval runs it.
pub(crate) fn eval(model: &Model, par: &Par, batches: &[Batch]) -> Result<f64> {
    let mut sum = 0.0;
    for b in batches {
        sum += crate::train::eval::ce_sum_par(model, par, b)?;
    }
    Ok(sum)
}

/// Checkpoints as the trainer writes them (run::checkpoint_write: host copies at the save,
/// the files written, fsynced and renamed into place on the writer thread), into a directory
/// of ours that is removed when this is dropped.
pub(crate) struct Saver {
    dir: PathBuf,
    keys: Vec<String>,
    writer: Writer,
}

impl Saver {
    pub(crate) fn new(model: &Model) -> Result<Saver> {
        let dir = std::env::temp_dir().join(format!("lora-train-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let keys = model
            .adapters()
            .flat_map(|(module, _)| ['A', 'B'].map(|w| crate::export::peft_key(module, w)))
            .collect();
        let writer = Writer::for_model(model)?;
        Ok(Saver { dir, keys, writer })
    }

    /// Starts step `step`'s checkpoint (replacing the one before: one is kept), after the
    /// previous one is written.
    pub(crate) fn save(
        &self,
        step: usize,
        model: &Model,
        spec: &LoraSpec,
        opt: &AdamW,
    ) -> Result<()> {
        let stage = self.writer.stage()?;
        let snap = Snapshot {
            adapter: Snapshot::adapter(model, stage)?,
            config: crate::export::adapter_config(spec, "bench", None)?,
            optimizer: Snapshot::optimizer(opt, &self.keys, stage)?,
            files: Vec::new(),
        };
        let tmp = self.dir.join(format!(".checkpoint-{step}.tmp"));
        let dst = self.dir.join("checkpoint");
        self.writer.start(snap, tmp, dst, || Ok(()))
    }

    /// Waits for the checkpoint in flight.
    pub(crate) fn wait(&self) -> Result<()> {
        self.writer.wait()
    }

    /// Seconds each finished checkpoint write took on the writer thread.
    pub(crate) fn write_seconds(&self) -> Vec<f64> {
        self.writer.write_seconds()
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        if let Err(e) = self.writer.wait() {
            crate::errln!("error: {e:#}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The bench's clock, the training loop's: a step is done when its loss is read.
pub(crate) struct Clock {
    warmup: usize,
    pub(crate) losses: Vec<f64>,
    done_at: Vec<Instant>,
    /// The pool's peak in each phase of the timed steps (CUDA).
    pub(crate) timed: crate::train::meter::PhaseMeter,
}

impl Clock {
    pub(crate) fn new(warmup: usize) -> Clock {
        Clock {
            warmup,
            losses: Vec::new(),
            done_at: Vec::new(),
            timed: crate::train::meter::PhaseMeter::default(),
        }
    }

    /// A step was read.
    pub(crate) fn record(&mut self, d: crate::train::step::Done) {
        self.done_at.push(Instant::now());
        self.losses.push(d.loss);
        if self.losses.len() > self.warmup {
            for (k, v) in d.peaks {
                let e = self.timed.peaks.entry(k).or_insert(0);
                *e = (*e).max(v);
            }
        }
    }

    /// The timed steps' window: from the last warm-up step's read (or `start`, without
    /// warm-up) to the last step's.
    fn window(&self, start: Instant) -> Option<(Instant, Instant)> {
        let from = match self.warmup {
            0 => Some(start),
            w => self.done_at.get(w - 1).copied(),
        };
        Some((from?, *self.done_at.last()?))
    }

    /// Seconds of the timed steps (`window`).
    pub(crate) fn seconds(&self, start: Instant) -> f64 {
        self.window(start)
            .map_or(0.0, |(f, l)| l.duration_since(f).as_secs_f64())
    }

    /// The timed steps' window in seconds since the Unix epoch, for tools that read the GPU's
    /// counters (power, energy) by wall time beside the run: scripts/energy.py.
    pub(crate) fn window_unix(&self, start: Instant) -> Option<[f64; 2]> {
        let (f, l) = self.window(start)?;
        let (now, sys) = (Instant::now(), SystemTime::now());
        let epoch = sys.duration_since(UNIX_EPOCH).ok()?.as_secs_f64();
        let ago = |t: Instant| now.duration_since(t).as_secs_f64();
        Some([epoch - ago(f), epoch - ago(l)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_hold_short_examples_with_their_own_positions_and_targets() {
        let (b, t) = (2, 10);
        let ids: Vec<u32> = (0..(b * t) as u32).collect();
        let plain = batch(&ids, b, t, 1);
        assert!(plain.segments.is_none());
        assert_eq!(plain.targets.len(), b * targets_per_row(t, 1));
        assert_eq!(plain.targets[0], (0, 1));
        let packed = batch(&ids, b, t, 3); // runs of 3, 3 and 4 tokens
        assert_eq!(packed.targets.len(), b * targets_per_row(t, 3));
        assert_eq!(&packed.positions[..t], &[0, 1, 2, 0, 1, 2, 0, 1, 2, 3]);
        let seg = packed.segments.as_ref().unwrap();
        assert_eq!(&seg[t..], &[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]);
        // No target crosses an example: position 2 (the first's last) predicts nothing.
        assert!(packed
            .targets
            .iter()
            .all(|&(i, _)| i % t != 2 && i % t != 5));
        assert!(packed.targets.contains(&(t + 3, (t + 4) as u32)));
    }

    #[test]
    fn work_adds_the_adapters_the_recompute_and_eval_to_the_plain_count() {
        let w = Work {
            n_linear: 1000,
            adapter: 100,
            layers: 2,
            hidden: 8,
            seq: 16,
            ckpt: false,
            mlp_recompute: 0,
            eval_tokens: 0,
            step_tokens: 64,
            eval_every: 0,
        };
        let attn = 2.0 * 16.0 * 8.0;
        let plain = crate::bench::flops_per_token(1000, 2, 8, 16, false);
        assert_eq!(w.flops_per_token(), plain + 6.0 * 100.0);
        assert!((plain - (4000.0 + 6.0 * attn)).abs() < 1e-9);
        let ck = Work { ckpt: true, ..w };
        let fwd = 2000.0 + 200.0 + 2.0 * attn;
        assert_eq!(ck.flops_per_token(), plain + 600.0 + fwd);
        let mlp = Work {
            mlp_recompute: 300,
            ..w
        };
        assert_eq!(mlp.flops_per_token(), plain + 600.0 + 600.0);
        let ev = Work {
            eval_tokens: 32,
            eval_every: 4,
            ckpt: false,
            ..ck
        };
        assert_eq!(ev.flops_per_token(), plain + 600.0 + fwd * 32.0 / 256.0);
    }
}
