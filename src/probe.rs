//! `lora-train probe`: the smoke ramp. One full training step (forward, head, backward,
//! optimizer: train::step's engine, as training runs it) at micro-batch 1 and seq 64, then seq doubling up to the recipe's seq_len, then
//! micro-batch doubling, each with the device pool's peak per phase, until the first
//! allocation failure: the knee (the last shape that ran) and the phase that broke.
//!
//! The model is the recipe's (weights loaded, adapters fresh); the data are random token ids
//! of each shape (the memory of a step depends on the shapes only). On the CPU there are no
//! device peaks: the ramp reports times, and `train.max_memory` caps the CPU accounting.

use crate::lora::LoraSpec;
use crate::memory::{self, plan::fmt_bytes};
use crate::model::Model;
use crate::parallel::Solo;
use crate::recipe::Recipe;
use crate::train::device_and_dtype;
use crate::train::driver::Keep;
use crate::train::optim::AdamW;
use crate::train::step::{adapter_params, Engine};
use anyhow::Result;
use std::time::Instant;

/// One rung of the ramp.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rung {
    pub micro_batch: usize,
    pub seq: usize,
    pub seconds: f64,
    /// The pool's peak in each phase (bytes; empty on the CPU).
    pub peaks: std::collections::BTreeMap<&'static str, u64>,
}

/// Where the ramp stopped.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failure {
    pub micro_batch: usize,
    pub seq: usize,
    pub phase: &'static str,
    pub cause: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeReport {
    pub rungs: Vec<Rung>,
    /// The first allocation failure (None: the whole ramp ran).
    pub oom: Option<Failure>,
    /// The device pool's peak after loading (CUDA).
    pub load_peak: Option<u64>,
    pub capacity: Option<u64>,
}

/// The ramp's shapes: (micro-batch, seq).
pub fn ramp(seq_len: usize, max_micro_batch: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut t = 64.min(seq_len);
    while t < seq_len {
        out.push((1, t));
        t *= 2;
    }
    out.push((1, seq_len));
    let mut b = 2;
    while b <= max_micro_batch {
        out.push((b, seq_len));
        b *= 2;
    }
    out
}

pub fn run(recipe: &Recipe, max_micro_batch: usize) -> Result<ProbeReport> {
    let (dev, dtype) = device_and_dtype(recipe)?;
    memory::keep_pool_memory(&dev)?;
    let max_memory = recipe.max_memory();
    let ballast = match max_memory {
        Some(m) => memory::hold_ballast(&dev, m)?,
        None => None,
    };
    let capacity = max_memory.or(ballast.as_ref().map(|b| b.total));
    memory::reset_peak(&dev)?;
    let files = crate::hub::model_files(&recipe.model)?;
    let spec = LoraSpec {
        rank: recipe.lora.rank,
        alpha: recipe.lora.alpha,
        dropout: 0.0,
        rslora: recipe.lora.rslora,
        dora: false,
        targets: recipe.target_modules()?,
    };
    // As training loads it: its kernels, the adapters' forward folded (ops::fold).
    let kernels = crate::train::session::run_kernels(recipe, &files, &dev, dtype)?;
    let seed = recipe.train.seed;
    let (model, _) = crate::train::session::sharded_model(
        false,
        recipe.quant().for_checkpoint(&files.config)?,
        &crate::parallel::Solo,
        &kernels,
        &mut |loaded| Model::load_with(&files, dtype, &dev, &spec, seed, &kernels, loaded),
    )?;
    let load_peak = memory::stats(&dev)?.map(|s| s.used_high);
    let params = adapter_params(&model);
    let lora: u64 = params
        .iter()
        .map(|v| memory::tensor_bytes(v.as_tensor()))
        .sum();
    let fixed: u64 = model
        .layers
        .iter()
        .map(|l| {
            let ws = l.linears().into_iter();
            let moe = l.moe.iter().flat_map(|m| m.frozen());
            let moe: u64 = moe.map(memory::tensor_bytes).sum();
            moe + l.nf4_bytes() as u64
                + ws.map(|l| crate::parallel::fsdp::storage_bytes(&l.w) as u64)
                    .sum::<u64>()
        })
        .sum::<u64>()
        + memory::tensor_bytes(&model.embed)
        + memory::tensor_bytes(&model.lm_head)
        + 4 * lora;
    memory::set_cpu_budget(max_memory.filter(|_| dev.is_cpu()), fixed);
    let t = &recipe.train;
    let mut opt = AdamW::new(params, t.betas, t.eps, t.weight_decay)?;
    let keep = Keep::new(t.activation_checkpointing, t.offload_activations, &dev);
    let mut rep = ProbeReport {
        rungs: Vec::new(),
        oom: None,
        load_peak,
        capacity,
    };
    for (b, seq) in ramp(recipe.data.seq_len, max_micro_batch) {
        let batch = crate::bench::random_batch(b, seq, model.cfg.vocab_size, 7);
        let n = batch.n_targets().max(1);
        // The training step itself (train::step), at learning rate 0: the adapters stay.
        let mut engine = Engine::new(&model, &Solo, None, keep, t.max_grad_norm, None);
        let t0 = Instant::now();
        let res = engine.step(std::slice::from_ref(&batch), n, 0, &mut opt, 0.0);
        match res {
            Ok(done) => rep.rungs.push(Rung {
                micro_batch: b,
                seq,
                seconds: t0.elapsed().as_secs_f64(),
                peaks: done.peaks,
            }),
            Err(e) if memory::is_oom(&e) => {
                rep.oom = Some(Failure {
                    micro_batch: b,
                    seq,
                    phase: engine.meter.current(),
                    cause: format!("{e:#}").lines().next().unwrap_or("").to_string(),
                });
                break;
            }
            Err(e) => return Err(e),
        }
    }
    memory::set_cpu_budget(None, 0);
    drop(ballast);
    Ok(rep)
}

impl ProbeReport {
    /// The last shape that ran.
    pub fn knee(&self) -> Option<&Rung> {
        self.rungs.last()
    }

    pub fn render(&self) -> String {
        let mut out = String::from(
            "probe: one full step per shape on random token ids (forward, head, backward, optimizer)\n",
        );
        if let Some(l) = self.load_peak {
            out.push_str(&format!("after load: {}\n", fmt_bytes(l)));
        }
        if let Some(c) = self.capacity {
            out.push_str(&format!("capacity: {}\n", fmt_bytes(c)));
        }
        out.push_str("micro_batch      seq   seconds  peak per phase\n");
        for r in &self.rungs {
            let peaks = if r.peaks.is_empty() {
                "(not measured on the CPU)".to_string()
            } else {
                memory::PHASES
                    .iter()
                    .filter_map(|p| r.peaks.get(p).map(|v| format!("{p} {}", fmt_bytes(*v))))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push_str(&format!(
                "{:>11} {:>8} {:>9.3}  {peaks}\n",
                r.micro_batch, r.seq, r.seconds
            ));
        }
        match (&self.oom, self.knee()) {
            (Some(f), knee) => {
                out.push_str(&format!(
                    "out of memory at micro-batch {} × seq {} in the {} phase: {}\n",
                    f.micro_batch, f.seq, f.phase, f.cause
                ));
                match knee {
                    Some(k) => out.push_str(&format!(
                        "knee: micro-batch {} × seq {} is the largest shape that ran\n",
                        k.micro_batch, k.seq
                    )),
                    None => out.push_str("knee: none (the first shape already failed)\n"),
                }
            }
            (None, Some(k)) => out.push_str(&format!(
                "no out-of-memory up to micro-batch {} × seq {}\n",
                k.micro_batch, k.seq
            )),
            (None, None) => {}
        }
        out
    }

    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["knee"] = serde_json::to_value(self.knee()).unwrap_or_default();
        v
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ramp_doubles_seq_then_micro_batch() {
        assert_eq!(
            super::ramp(512, 8),
            vec![
                (1, 64),
                (1, 128),
                (1, 256),
                (1, 512),
                (2, 512),
                (4, 512),
                (8, 512)
            ]
        );
        // seq_len not a power of two: the last rung is seq_len itself.
        assert_eq!(super::ramp(100, 2), vec![(1, 64), (1, 100), (2, 100)]);
        assert_eq!(super::ramp(32, 1), vec![(1, 32)]);
    }
}
