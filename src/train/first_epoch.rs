//! A streaming run's first epoch (see train_data.rs): its steps made from the training
//! examples as they land (`data::stream`), in file order, into rows as the sampler makes them
//! (`data::Packer`) and steps of micro_batch × grad_accum rows as `TrainData::epoch_plan`
//! chunks them, so that every step is the one a run that waited for the whole preparation
//! takes.

use crate::data::stream::View;
use crate::data::{Batch, Example, ExampleRef, Packer};
use crate::recipe::DataSection;
use anyhow::Result;
use std::collections::VecDeque;

/// A step: its micro-batches, each rows of example indices.
type Step = Vec<Vec<Vec<usize>>>;

/// The first epoch's steps, made as the examples land.
pub(crate) struct FirstEpoch {
    view: View,
    packer: Packer,
    pack: bool,
    /// The next example to hand the packer.
    next: usize,
    /// Rows made, not yet in a step.
    rows: VecDeque<Vec<usize>>,
    /// Every example has landed (and the packer's last row is made).
    ended: bool,
    /// The next step's index in the epoch.
    index: usize,
}

impl FirstEpoch {
    /// The first epoch of the examples `view` shows, rows made as `cfg` says.
    pub(crate) fn new(view: View, cfg: &DataSection) -> FirstEpoch {
        FirstEpoch {
            view,
            packer: Packer::new(cfg.pack, cfg.seq_len),
            pack: cfg.pack,
            next: 0,
            rows: VecDeque::new(),
            ended: false,
            index: 0,
        }
    }

    /// The next step's index and micro-batches (rows of example indices), once its examples
    /// have landed; None when the epoch is over. Err: the preparation failed.
    pub(crate) fn next(
        &mut self,
        micro_batch: usize,
        grad_accum: usize,
    ) -> Result<Option<(usize, Step)>> {
        let want = (micro_batch * grad_accum).max(1);
        while self.rows.len() < want && !self.ended {
            let (n, ended) = self.view.wait_past(self.next)?;
            for i in self.next..n {
                if let Some(r) = self.packer.push(i, self.view.len_of(i)?) {
                    self.rows.push_back(r);
                }
            }
            self.next = n;
            if ended {
                self.rows.extend(self.packer.finish());
                self.ended = true;
            }
        }
        if self.rows.is_empty() {
            return Ok(None);
        }
        let take: Vec<Vec<usize>> = self.rows.drain(..want.min(self.rows.len())).collect();
        let micro = take
            .chunks(micro_batch.max(1))
            .map(|c| c.to_vec())
            .collect();
        self.index += 1;
        Ok(Some((self.index - 1, micro)))
    }

    /// The micro-batch of `rows`, read from the file being written.
    pub(crate) fn batch(&self, rows: &[Vec<usize>], pad_id: u32) -> Result<Batch> {
        let ex = rows
            .iter()
            .map(|r| r.iter().map(|&i| self.view.example(i)).collect())
            .collect::<Result<Vec<Vec<Example>>>>()?;
        let refs: Vec<Vec<ExampleRef>> = ex
            .iter()
            .map(|r| {
                r.iter()
                    .map(|e| ExampleRef {
                        ids: &e.ids,
                        labels: &e.labels,
                    })
                    .collect()
            })
            .collect();
        Ok(Batch::from_rows(&refs, pad_id, self.pack))
    }
}
