//! `[parallel]`: how to spread the run over devices.

use serde::{Deserialize, Serialize};

/// How the ranks share a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// One rank on one device.
    Single,
    /// Data parallel: every rank holds the whole model; the gradients are summed.
    Ddp,
    /// Fully sharded: each rank holds a shard of the frozen base, gathered a layer at a time.
    Fsdp,
}

impl Strategy {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Ddp => "ddp",
            Strategy::Fsdp => "fsdp",
        }
    }
}

/// `[parallel]`: how to spread the run over devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// "single" | "ddp" | "fsdp". Default: "single".
    #[serde(default = "d_strategy")]
    pub(crate) strategy: Strategy,
    /// CUDA ordinals to use, one rank each, or "all" (every visible GPU). With
    /// model.device = "cpu": virtual ranks (threads), e.g. [0, 1] for two. Default: [0].
    #[serde(default = "d_devices", deserialize_with = "devices_or_all")]
    pub devices: Vec<usize>,
    /// Seconds a rank waits in a collective for the others before the run fails (a rank
    /// that died or hangs). Default: 1800.
    #[serde(default = "d_timeout_s")]
    pub(crate) timeout_s: u64,
}

/// `devices = "all"` is kept as an empty list and resolved when the devices are opened.
fn devices_or_all<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Devices {
        List(Vec<usize>),
        Word(String),
    }
    match Devices::deserialize(d)? {
        Devices::List(v) => Ok(v),
        Devices::Word(w) if w == "all" => Ok(Vec::new()),
        Devices::Word(w) => Err(serde::de::Error::custom(format!(
            "parallel.devices = \"{w}\": expected a list of device ordinals like [0, 1], or \"all\""
        ))),
    }
}

fn d_timeout_s() -> u64 {
    1800
}

fn d_strategy() -> Strategy {
    Strategy::Single
}
fn d_devices() -> Vec<usize> {
    vec![0]
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            strategy: d_strategy(),
            devices: d_devices(),
            timeout_s: d_timeout_s(),
        }
    }
}
