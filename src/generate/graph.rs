//! One-token steps replayed as a CUDA graph: a step is ~300 kernels of a few microseconds'
//! launch cost each (candle's op, an allocation, the launch), which at 7B cost as much as the
//! weights' reads. Captured once, a step is one launch.
//!
//! What changes between steps lives in device memory that the graph reads: the token id and
//! its position (`Inputs::tok`, `Inputs::pos`, written before each launch), the KV cache (written
//! in place at the position) and the rotary tables (indexed by it); the attention kernel's
//! grid covers the whole cache. The step's output is copied into `Inputs::logits`. Every tensor
//! the step makes is allocated and freed inside the graph (memory nodes), so nothing escapes
//! it. A graph is tied to the cache's buffers: growing the cache captures a new one.
//!
//! An experiment (`LORA_TRAIN_EXPERIMENTS=decode_graph`, `Graph::new`; on a 7B base its first
//! replay fails, not yet understood: docs/kernels.md): for bf16 models without adapters when one stream runs everything (cudarc
//! is not managing several: no cross-stream events can be in a capture), after one eager step
//! (every module loaded). A capture that fails leaves the eager steps on.

use anyhow::{Context, Result};
use candle_core::cuda::cudarc::driver::{result, sys, CudaGraph};
use candle_core::{DType, Device, Tensor};

/// The per-step inputs and output in device memory.
pub(crate) struct Inputs {
    /// The token id to run: u32 [1].
    pub(crate) tok: Tensor,
    /// Its position: u32 [1].
    pub(crate) pos: Tensor,
    /// The step's logits: f32 [V].
    pub(crate) logits: Tensor,
}

/// What a graph is tied to: the cache's capacity and its first buffer's address.
pub(crate) type Key = (usize, u64);

impl Inputs {
    pub(crate) fn new(device: &Device, vocab: usize) -> Result<Inputs> {
        Ok(Inputs {
            tok: Tensor::zeros(1, DType::U32, device)?,
            pos: Tensor::zeros(1, DType::U32, device)?,
            logits: Tensor::zeros(vocab, DType::F32, device)?,
        })
    }

    /// Writes the token and its position for the next step (ordered on the stream before it).
    pub(crate) fn set(&self, tok: u32, pos: u32) -> Result<()> {
        let Device::Cuda(d) = self.tok.device() else {
            anyhow::bail!("a decode step's buffers are not on the GPU");
        };
        let stream = d.cuda_stream();
        for (t, v) in [(&self.tok, tok), (&self.pos, pos)] {
            let dst = super::cuda::addr(t)?;
            // SAFETY: dst is a live u32 [1] of ours on this stream's device; the source is a
            // host value, staged by the driver before the call returns.
            unsafe { result::memcpy_htod_async(dst, &[v], stream.cu_stream()) }
                .context("writing the decode step's token")?;
        }
        Ok(())
    }
}

/// The captured step, if any, and whether to capture.
#[derive(Default)]
pub(crate) struct Graph {
    graph: Option<(CudaGraph, Key)>,
    /// Whether to capture (cleared by a failed capture).
    pub(crate) on: bool,
    /// Steps run eagerly so far.
    pub(crate) eager: usize,
}

impl Graph {
    /// Captures are on with the `decode_graph` experiment (LORA_TRAIN_EXPERIMENTS), for bf16
    /// on CUDA when cudarc manages no cross-stream synchronisation, for a model without
    /// adapters (`adapters`: with them a captured step met an illegal address, not yet
    /// understood, so those steps run eagerly).
    pub(crate) fn new(device: &Device, dtype: DType, adapters: bool) -> Graph {
        let experiment = crate::ops::kernels::Experiments::from_env()
            .map(|e| e.decode_graph)
            .unwrap_or(false);
        let wanted = experiment && !adapters;
        let single = match device {
            Device::Cuda(d) => !d
                .cuda_stream()
                .context()
                .is_managing_stream_synchronization(),
            _ => false,
        };
        Graph {
            graph: None,
            on: wanted && single && dtype == DType::BF16,
            eager: 0,
        }
    }

    pub(crate) fn captured(&self) -> bool {
        self.graph.is_some()
    }

    /// Launches the graph captured for `key`; false when there is none (the caller runs the
    /// step, or captures it).
    pub(crate) fn replay(&self, key: Key) -> Result<bool> {
        match &self.graph {
            Some((g, k)) if *k == key => {
                g.launch().context("launching the decode step's graph")?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Captures `body` (the step, writing the logits buffer) on `device`'s stream into a graph
    /// for `key` and launches it. Ok(false) when the capture failed: nothing ran, and captures
    /// are off from now on.
    pub(crate) fn capture(
        &mut self,
        key: Key,
        device: &Device,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<bool> {
        self.graph = None;
        let Device::Cuda(d) = device else {
            return Ok(false);
        };
        let stream = d.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .context("beginning a graph capture")?;
        let ran = body();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (ran, graph) {
            (Ok(()), Ok(Some(g))) => {
                g.launch().context("launching the decode step's graph")?;
                self.graph = Some((g, key));
                Ok(true)
            }
            (ran, graph) => {
                let why = match (ran, graph) {
                    (Err(e), _) => format!("{e:#}"),
                    (_, Err(e)) => e.to_string(),
                    _ => "empty graph".to_string(),
                };
                crate::errln!("note: decoding without a CUDA graph (its capture failed: {why})");
                self.on = false;
                Ok(false)
            }
        }
    }
}
